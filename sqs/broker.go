package sqs

import (
	"context"
	"fmt"
	"log/slog"
	"net/url"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/aws/smithy-go/middleware"

	"go.opentelemetry.io/otel"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/msgmetrics"
)

// Limits of Amazon SQS that Ferry works within.
const (
	// MaxBatch is the most entries one batch call takes.
	MaxBatch = 10
	// MaxAttributes is the most message attributes one message carries.
	MaxAttributes = 10
	// DefaultMaxMessageSize is the message size limit assumed for a queue
	// that does not report its MaximumMessageSize (1 MiB, SQS's ceiling
	// since 2025).
	DefaultMaxMessageSize = 1 << 20
	// MaxBatchSize is the most bytes one SendMessageBatch carries, summed
	// over its messages.
	MaxBatchSize = 1 << 20
	// MaxVisibility is the longest a message can stay invisible after one
	// receive, extensions included.
	MaxVisibility = 12 * time.Hour
)

// Broker is Ferry over Amazon SQS through one *sqs.Client of
// aws-sdk-go-v2. It is a [consumer.Publisher], and it builds consumers of
// its queues with NewConsumer. It is safe for concurrent use.
type Broker struct {
	client *awssqs.Client
	cfg    config

	mu      sync.Mutex
	queues  map[string]*queueInfo // by the name or URL a caller gave
	drivers map[*sqsDriver]struct{}
	closed  chan struct{}
	once    sync.Once

	endpointOnce sync.Once
	endpointName string

	stats   brokerStats
	metrics *msgmetrics.Publisher
}

type brokerStats struct {
	leasesLost, visibilityCapped, released atomic.Int64
}

// Stats is a snapshot of a Broker's counters, summed over its consumers.
type Stats struct {
	// LeasesLost counts deliveries whose extension SQS refused because the
	// receipt handle was no longer good (its visibility had run out, and
	// another receive may hold the message). Their extension ends quietly;
	// each is counted once. A growing count says that handlers outlive the
	// visibility timeout by more than the extensions can cover.
	LeasesLost int64
	// VisibilityCapped counts deliveries that reached SQS's 12-hour limit
	// of visibility after one receive: they are not extended further and
	// are delivered again when the limit passes.
	VisibilityCapped int64
	// Released counts messages received from SQS but never handed to a
	// handler, because their consumer stopped first; they were made
	// visible again at once.
	Released int64
}

// Stats returns a snapshot of the broker's counters.
func (b *Broker) Stats() Stats {
	return Stats{
		LeasesLost:       b.stats.leasesLost.Load(),
		VisibilityCapped: b.stats.visibilityCapped.Load(),
		Released:         b.stats.released.Load(),
	}
}

var (
	_ consumer.Broker      = (*Broker)(nil)
	_ consumer.SystemNamer = (*Broker)(nil)
	_ driver.Opener        = (*Broker)(nil)
)

// System names the broker as OpenTelemetry's messaging.system does:
// [MessagingSystem].
func (b *Broker) System() string { return MessagingSystem }

// MessagingSystem is SQS's messaging.system in OpenTelemetry's semantic
// conventions, in traces and metrics (Broker.System).
const MessagingSystem = "aws_sqs"

// New returns a Broker over client, which the caller configured with
// whatever region, credentials, endpoint, retryer and HTTP client the
// deployment needs (config.LoadDefaultConfig and sqs.NewFromConfig, the
// default credential chain, or sqs.New with explicit options). The Broker
// does not change the client and makes no call until it is used. It fails
// with a *[consumer.ConfigError] when client is nil or an option is invalid.
func New(client *awssqs.Client, opts ...Option) (*Broker, error) {
	if client == nil {
		return nil, consumer.ConfigErrorf("client", "must not be nil")
	}
	c := config{waitTime: MaxWaitTime, settleWindow: 10 * time.Millisecond, publishParallel: 8, receivers: 32}
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o(&c); err != nil {
			return nil, err
		}
	}
	if c.logger == nil {
		c.logger = slog.Default()
	}
	if c.meters == nil {
		c.meters = otel.GetMeterProvider()
	}
	pm, err := msgmetrics.NewPublisher(c.meters, MessagingSystem)
	if err != nil {
		return nil, fmt.Errorf("sqs: metrics: %w", err)
	}
	return &Broker{
		metrics: pm,
		client:  client,
		cfg:     c,
		queues:  make(map[string]*queueInfo),
		drivers: make(map[*sqsDriver]struct{}),
		closed:  make(chan struct{}),
	}, nil
}

// Client returns the client the broker was built over.
func (b *Broker) Client() *awssqs.Client { return b.client }

// Close closes the broker: later calls fail with [ErrClosed], and every
// consumer built by it ends its Run with a fatal error wrapping [ErrClosed]
// (messages it held and did not settle come back after their visibility
// timeout). It waits up to two seconds for their short receives to end by
// themselves and gives back what they bring (see Stopping in the package
// documentation). The client stays usable.
// Close is safe to call more than once.
func (b *Broker) Close() error {
	b.once.Do(func() { close(b.closed) })
	b.mu.Lock()
	ds := make([]*sqsDriver, 0, len(b.drivers))
	for d := range b.drivers {
		ds = append(ds, d)
	}
	b.mu.Unlock()
	var wg sync.WaitGroup
	for _, d := range ds {
		wg.Add(1)
		go func() { defer wg.Done(); _ = d.Close() }()
	}
	wg.Wait()
	return nil
}

func (b *Broker) isClosed() bool {
	select {
	case <-b.closed:
		return true
	default:
		return false
	}
}

// queueInfo is what the broker knows of one queue.
type queueInfo struct {
	url, name    string
	fifo         bool
	contentDedup bool
	maxSize      int
	visibility   time.Duration
}

// queueAttributes are the attributes the broker reads once per queue.
var queueAttributes = []types.QueueAttributeName{
	types.QueueAttributeNameVisibilityTimeout,
	types.QueueAttributeNameFifoQueue,
	types.QueueAttributeNameMaximumMessageSize,
	types.QueueAttributeNameContentBasedDeduplication,
}

// queueName returns the name of the queue that queue, a name or a queue
// URL, names, or a *[consumer.ConfigError] when it names none.
func queueName(queue string) (string, error) {
	if queue == "" {
		return "", consumer.ConfigErrorf("queue", "must not be empty")
	}
	if strings.HasPrefix(queue, "https://") || strings.HasPrefix(queue, "http://") {
		u, err := url.Parse(queue)
		if err != nil || path.Base(u.Path) == "" || path.Base(u.Path) == "/" || path.Base(u.Path) == "." {
			return "", consumer.ConfigErrorf("queue", "%q is not a queue URL", queue)
		}
		return path.Base(u.Path), nil
	}
	return queue, nil
}

// endpoint names where the client sends its requests, for errors: the
// host of its BaseEndpoint, or of the endpoint the SDK resolves for its
// region. Never a credential.
func (b *Broker) endpoint() string {
	b.endpointOnce.Do(func() {
		o := b.client.Options()
		b.endpointName = "SQS in region " + o.Region
		if o.BaseEndpoint != nil {
			if u, err := url.Parse(*o.BaseEndpoint); err == nil && u.Host != "" {
				b.endpointName = u.Host
			}
			return
		}
		r := o.EndpointResolverV2
		if r == nil {
			r = awssqs.NewDefaultEndpointResolverV2()
		}
		ep, err := r.ResolveEndpoint(context.Background(), awssqs.EndpointParameters{
			Region:       aws.String(o.Region),
			UseFIPS:      aws.Bool(o.EndpointOptions.UseFIPSEndpoint == aws.FIPSEndpointStateEnabled),
			UseDualStack: aws.Bool(o.EndpointOptions.UseDualStackEndpoint == aws.DualStackEndpointStateEnabled),
		})
		if err == nil && ep.URI.Host != "" {
			b.endpointName = ep.URI.Host
		}
	})
	return b.endpointName
}

// resolve returns the queue named by queue, a name or a URL, from the
// cache or from SQS (see lookUp).
func (b *Broker) resolve(ctx context.Context, queue string) (*queueInfo, error) {
	b.mu.Lock()
	q := b.queues[queue]
	b.mu.Unlock()
	if q != nil {
		return q, nil
	}
	return b.lookUp(ctx, queue)
}

// lookUp asks SQS for the queue named by queue (GetQueueUrl for a name,
// then GetQueueAttributes) and caches what it says. Its errors are
// callErrors: a queue that does not exist wraps
// [consumer.ErrSourceNotFound], and so on.
func (b *Broker) lookUp(ctx context.Context, queue string) (*queueInfo, error) {
	name, err := queueName(queue)
	if err != nil {
		return nil, err
	}
	q := &queueInfo{name: name}
	last := &lastAttempt{}
	ctx = context.WithValue(ctx, lastAttemptKey{}, last)
	if name != queue {
		q.url = queue
	} else {
		out, err := b.client.GetQueueUrl(ctx, &awssqs.GetQueueUrlInput{QueueName: aws.String(queue)}, recordAttempts)
		if err != nil {
			return nil, b.callErr("GetQueueUrl", name, err, last.get())
		}
		q.url = aws.ToString(out.QueueUrl)
	}
	out, err := b.client.GetQueueAttributes(ctx, &awssqs.GetQueueAttributesInput{
		QueueUrl: aws.String(q.url), AttributeNames: queueAttributes,
	}, recordAttempts)
	if err != nil {
		return nil, b.callErr("GetQueueAttributes", q.name, err, last.get())
	}
	a := out.Attributes
	q.fifo = a[string(types.QueueAttributeNameFifoQueue)] == "true" || strings.HasSuffix(q.name, ".fifo")
	q.contentDedup = a[string(types.QueueAttributeNameContentBasedDeduplication)] == "true"
	q.maxSize = DefaultMaxMessageSize
	if v, err := strconv.Atoi(a[string(types.QueueAttributeNameMaximumMessageSize)]); err == nil && v > 0 {
		q.maxSize = v
	}
	if v, err := strconv.Atoi(a[string(types.QueueAttributeNameVisibilityTimeout)]); err == nil && v >= 0 {
		q.visibility = time.Duration(v) * time.Second
	}
	b.mu.Lock()
	b.queues[queue] = q
	b.mu.Unlock()
	return q, nil
}

// forget drops a queue from the cache (it was deleted, or its attributes
// may have changed).
func (b *Broker) forget(queue string) {
	b.mu.Lock()
	delete(b.queues, queue)
	b.mu.Unlock()
}

// callErr is callError for a call of this broker's client about queue.
func (b *Broker) callErr(op, queue string, err, last error) error {
	return callError(op, queue, b.endpoint(), err, last)
}

// lastAttemptKey is the context key of a call's lastAttempt.
type lastAttemptKey struct{}

// lastAttempt holds the error of the latest attempt of one SDK call: when
// the call ends on its deadline while the SDK waits to try again, its own
// error says only that, and this says what the client saw.
type lastAttempt struct {
	mu  sync.Mutex
	err error
}

func (a *lastAttempt) get() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.err
}

// recordAttempts is a per-call option that adds, inside the SDK's retry
// loop, a middleware keeping each failed attempt's error in the
// lastAttempt of the call's context.
func recordAttempts(o *awssqs.Options) {
	o.APIOptions = append(slices.Clip(o.APIOptions), func(stack *middleware.Stack) error {
		m := middleware.FinalizeMiddlewareFunc("FerryLastAttempt", func(ctx context.Context, in middleware.FinalizeInput, next middleware.FinalizeHandler) (middleware.FinalizeOutput, middleware.Metadata, error) {
			out, md, err := next.HandleFinalize(ctx, in)
			if a, ok := ctx.Value(lastAttemptKey{}).(*lastAttempt); ok && err != nil {
				a.mu.Lock()
				a.err = err
				a.mu.Unlock()
			}
			return out, md, err
		})
		if err := stack.Finalize.Insert(m, "Retry", middleware.After); err != nil {
			// A client without the SDK's retry middleware: every call
			// is one attempt.
			return stack.Finalize.Add(m, middleware.After)
		}
		return nil
	})
}

// NewConsumer returns a delivery loop over the queue named by queue (a name
// or a queue URL): [consumer.NewOn] over the Broker, with opts. It makes
// no call to SQS: the consumer looks its queue up when Run starts, and
// until then, and whenever SQS cannot be reached or the queue does not
// exist, Run retries with backoff and says so (see Errors in the package
// documentation). A consumer built while SQS is down, or before its queue
// is created, starts consuming once both are there. It fails with a
// *[consumer.ConfigError] when queue names no queue or an option is invalid.
func (b *Broker) NewConsumer(ctx context.Context, queue string, opts ...consumer.Option) (*consumer.Loop, error) {
	return consumer.NewOn(ctx, b, queue, opts...)
}

// Driver returns the raw driver over a queue, for [consumer.NewOn] or a loop
// of one's own ([driver.Opener]; SQS needs nothing of cfg). It makes no call
// to SQS (ctx is not used): the driver
// looks the queue up in Connect ([driver.Connector]), or in the first Fetch
// or Lag when nobody called Connect, and again after SQS said the queue
// does not exist. It implements [driver.Extender] (the lease is the queue's
// visibility timeout, once the queue was looked up), [driver.LagReporter],
// [driver.Drainer] and [driver.Aser] (a *types.Message target gets the message
// as ReceiveMessage returned it). Each consumer needs its own; several
// drivers of one queue share its messages as SQS shares them between
// receivers. It fails with a *[consumer.ConfigError] when queue names no
// queue, and with [ErrClosed] on a closed broker.
func (b *Broker) Driver(_ context.Context, queue string, _ driver.Config) (driver.Driver, error) {
	if b.isClosed() {
		return nil, fmt.Errorf("sqs: driver for %q: %w", queue, ErrClosed)
	}
	name, err := queueName(queue)
	if err != nil {
		return nil, err
	}
	d := newDriver(b, queue, name)
	b.mu.Lock()
	if b.isClosed() {
		b.mu.Unlock()
		_ = d.Close()
		return nil, fmt.Errorf("sqs: driver for %q: %w", queue, ErrClosed)
	}
	b.drivers[d] = struct{}{}
	b.mu.Unlock()
	return d, nil
}

func (b *Broker) dropDriver(d *sqsDriver) {
	b.mu.Lock()
	delete(b.drivers, d)
	b.mu.Unlock()
}
