package rabbit

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"go.opentelemetry.io/otel"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/msgmetrics"
	"github.com/ferrymq/ferry/internal/urlsecret"
)

// Broker is a connection to RabbitMQ: a [consumer.Publisher], and the source
// of Drivers and Consumers over its queues. It owns two connections, one for
// publishing and one for consuming, so that a broker blocking publishers
// (an alarm) never holds back acks, and reopens either when it is lost. It
// is safe for concurrent use.
type Broker struct {
	cfg      config
	uris     []amqp.URI // the nodes, in the URL's order (see nodeURLs)
	redacted string
	log      *slog.Logger

	pubConn  *connMgr
	consConn *connMgr
	pub      *publisher
	metrics  *msgmetrics.Publisher

	idPrefix string
	idSeq    atomic.Uint64

	mu         sync.Mutex
	drivers    map[*queueDriver]struct{}
	dropWarned map[string]bool // queues whose drop warning was logged

	sched   schedule    // the declarations of delayed publish
	orphans orphanWatch // of the queue delayed messages go to when theirs is gone

	connected atomic.Bool // a connection was ever opened (see classify)

	closeOnce sync.Once
	closed    chan struct{}
	life      context.Context // cancelled by Close: bounds every dial
	endLife   context.CancelFunc
}

var (
	_ consumer.Broker      = (*Broker)(nil)
	_ consumer.SystemNamer = (*Broker)(nil)
	_ driver.Opener        = (*Broker)(nil)
)

// System names the broker as OpenTelemetry's messaging.system does:
// [MessagingSystem].
func (b *Broker) System() string { return MessagingSystem }

// MessagingSystem is RabbitMQ's messaging.system in OpenTelemetry's
// semantic conventions, in traces and metrics (Broker.System).
const MessagingSystem = "rabbitmq"

// Redact returns rawURL with its password replaced by "xxxxx", for logs and
// errors. The user information runs from after "amqp://" to the last "@"
// of rawURL, so that a password holding any character, "@", "/" and
// whitespace included, is hidden whole, whether or not the URL parses.
func Redact(rawURL string) string { return urlsecret.Redact(rawURL) }

// Dial connects to the RabbitMQ at url (amqp:// or amqps://, with the vhost
// as its path; several hosts separated by commas are the nodes of a
// cluster, see the package doc's Several nodes) and declares the topology
// of WithTopology. An invalid URL or
// option fails with a *[consumer.ConfigError]; a broker that cannot be reached
// fails with an error wrapping [consumer.ErrUnreachable], one that refuses the
// credentials, the vhost, the TLS handshake or the topology with an error
// wrapping [consumer.ErrRefused], each wrapping the cause too (an
// *amqp091.Error where the broker said why). Neither error holds the
// password.
//
// Dial fails fast because the Broker is a publisher too: a service that
// publishes learns of a wrong URL, or of a broker that is down, when it
// starts rather than at its first Publish. The Drivers and consumers of a
// Broker need no connection to be built (they connect when they run, and
// reconnect by themselves), so [WithLazyConnect] gives a Broker, and
// consumers, that can be built while RabbitMQ is down.
func Dial(rawURL string, opts ...Option) (*Broker, error) {
	c := config{
		logger:      slog.Default(),
		window:      DefaultConfirmWindow,
		dialTimeout: DefaultDialTimeout,
		heartbeat:   DefaultHeartbeat,
		backoffMin:  DefaultReconnectMin,
		backoffMax:  DefaultReconnectMax,
		retryDelays: DefaultRetryDelays,
		name:        "ferry",
	}
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o(&c); err != nil {
			return nil, err
		}
	}
	redacted := Redact(rawURL)
	if err := urlsecret.Check(rawURL); err != nil {
		// url.Parse would read a part of the password as the host, the
		// vhost or the query, and errors quote those.
		return nil, consumer.ConfigErrorf("URL", "%s: the user and password %v", redacted, err)
	}
	nodes, err := nodeURLs(rawURL)
	if err != nil {
		return nil, consumer.ConfigErrorf("URL", "%s: %v", redacted, err)
	}
	var uris []amqp.URI
	for _, one := range nodes {
		uri, err := amqp.ParseURI(one)
		if err != nil {
			// url.Parse's errors quote the URL or a part of it (the text
			// after the first ":" of a password holding a "/" reads as a
			// port): none of their text is kept.
			var ue *url.Error
			if errors.As(err, &ue) {
				err = errors.New("it does not parse as a URL (reserved characters such as / @ : in the user or password must be percent-escaped)")
			}
			return nil, consumer.ConfigErrorf("URL", "%s is not an AMQP URL: %v", redacted, scrub(err, one))
		}
		uris = append(uris, uri)
	}
	if c.meters == nil {
		c.meters = otel.GetMeterProvider()
	}
	pm, err := msgmetrics.NewPublisher(c.meters, MessagingSystem)
	if err != nil {
		return nil, fmt.Errorf("rabbit: metrics: %w", err)
	}
	var p [4]byte
	_, _ = crand.Read(p[:])
	b := &Broker{
		metrics:    pm,
		cfg:        c,
		uris:       uris,
		redacted:   redacted,
		log:        c.logger.With("broker", redacted),
		idPrefix:   hex.EncodeToString(p[:]) + "-",
		drivers:    make(map[*queueDriver]struct{}),
		dropWarned: make(map[string]bool),
		closed:     make(chan struct{}),
		sched:      schedule{turn: make(chan struct{}, 1)},
	}
	b.orphans.every = DefaultOrphanCheck
	b.orphans.count.Store(-1)
	b.life, b.endLife = context.WithCancel(context.Background())
	b.pubConn = newConnMgr(b, "publish")
	b.consConn = newConnMgr(b, "consume")
	b.pub = newPublisher(b)
	if c.lazy {
		return b, nil
	}
	// A dial tries each node for up to the dial timeout.
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(len(uris)+1)*c.dialTimeout)
	defer cancel()
	if _, err := b.pubConn.get(ctx); err != nil {
		b.endLife()
		b.closeConns()
		return nil, err
	}
	return b, nil
}

// scrub removes the URL's password from an error's text, in case a library
// quoted it (amqp091's parse errors quote the whole URL).
func scrub(err error, rawURL string) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	if out := urlsecret.Scrub(msg, urlsecret.Forms(rawURL)); out != msg {
		return &scrubbed{msg: out}
	}
	return err
}

// scrubbed is an error whose text had a password taken out. It does not
// unwrap: the original's text holds the password.
type scrubbed struct{ msg string }

func (e *scrubbed) Error() string { return e.msg }

// warnDrops logs, once per queue in the Broker's life, that RabbitMQ drops
// the messages of q, a queue of the topology that a consumer of the Broker
// opened on conn, past its delivery limit (see dropLimit).
func (b *Broker) warnDrops(q Queue, conn *amqp.Connection) {
	version, _ := conn.Properties["version"].(string)
	limit, byDefault, drops := dropLimit(q, version)
	if !drops {
		return
	}
	b.mu.Lock()
	warned := b.dropWarned[q.Name]
	b.dropWarned[q.Name] = true
	b.mu.Unlock()
	if warned {
		return
	}
	b.log.Warn("rabbit: quorum queue has no dead-letter exchange: a message delivered more than delivery_limit times is dropped (declare a DeadLetterExchange)",
		"queue", q.Name, "delivery_limit", limit, "broker_default_limit", byDefault, "rabbitmq_version", version)
}

func (b *Broker) isClosed() bool {
	select {
	case <-b.closed:
		return true
	default:
		return false
	}
}

// Close stops every Driver of the Broker (their unsettled deliveries go back
// to the queue), fails Publish calls waiting for confirms with [ErrClosed], and
// closes both connections. It returns within about a second whatever the
// broker does (a blocked connection is cut). Calling it again does nothing.
func (b *Broker) Close() error {
	b.closeOnce.Do(func() {
		close(b.closed)
		b.endLife() // a dial under way ends now
		b.stopOrphanGauge()
		b.mu.Lock()
		ds := make([]*queueDriver, 0, len(b.drivers))
		for d := range b.drivers {
			ds = append(ds, d)
		}
		b.mu.Unlock()
		var wg sync.WaitGroup
		for _, d := range ds {
			// Closing the connection closes the channels: the drivers do
			// not wait for the broker.
			wg.Go(func() { d.close(false) })
		}
		wg.Wait()
		b.closeConns()
	})
	return nil
}

func (b *Broker) closeConns() {
	var wg sync.WaitGroup
	wg.Go(b.pubConn.close)
	if b.consConn != nil {
		wg.Go(b.consConn.close)
	}
	wg.Wait()
}

// newID returns a unique message id for a message published without one.
func (b *Broker) newID() string {
	n := b.idSeq.Add(1)
	buf := make([]byte, 0, len(b.idPrefix)+12)
	buf = append(buf, b.idPrefix...)
	return string(strconv.AppendUint(buf, n, 10))
}

// backoff returns the wait before attempt n (0-based): exponential with full
// jitter between the configured bounds.
func (b *Broker) backoff(n int) time.Duration {
	d := b.cfg.backoffMin
	for i := 0; i < n && d < b.cfg.backoffMax; i++ {
		d *= 2
	}
	d = min(d, b.cfg.backoffMax)
	return b.cfg.backoffMin/2 + rand.N(d)
}

// sleep waits d, or until ctx ends or the broker closes; it reports whether
// the wait ran its course.
func (b *Broker) sleep(ctx context.Context, d time.Duration, stop <-chan struct{}) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
	case <-b.closed:
	case <-stop:
	}
	return false
}

// nodeURLs splits a URL naming several nodes,
// amqp://USER:PASSWORD@HOST1[:PORT],HOST2[:PORT]/VHOST, into one URL a
// node, each with the same scheme, credentials, vhost and query. A URL
// naming one node is returned as it is.
func nodeURLs(rawURL string) ([]string, error) {
	scheme, rest, ok := strings.Cut(rawURL, "://")
	if !ok {
		return []string{rawURL}, nil
	}
	end := strings.IndexAny(rest, "/?#")
	if end < 0 {
		end = len(rest)
	}
	authority, tail := rest[:end], rest[end:]
	userinfo, hosts := "", authority
	if at := strings.LastIndex(authority, "@"); at >= 0 {
		userinfo, hosts = authority[:at+1], authority[at+1:]
	}
	if !strings.Contains(hosts, ",") {
		return []string{rawURL}, nil
	}
	var out []string
	for i, h := range strings.Split(hosts, ",") {
		if h = strings.TrimSpace(h); h == "" {
			return nil, fmt.Errorf("node %d of the list %q is empty", i+1, hosts)
		}
		out = append(out, scheme+"://"+userinfo+h+tail)
	}
	return out, nil
}
