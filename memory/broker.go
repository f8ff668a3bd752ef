package memory

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/msgmetrics"
)

// Errors returned by the broker. Match them with errors.Is.
var (
	// ErrClosed is returned by every call on a closed Broker or driver. A
	// Fetch wraps it with driver.Fatal, so a consumer.Loop's Run ends.
	ErrClosed = errors.New("memory: broker closed")

	// ErrStaleHandle is returned by Settle and Extend for a delivery whose
	// lease ran out (the message is, or will be, delivered again under a new
	// handle) or that was already settled. The rest of the batch is still
	// applied.
	ErrStaleHandle = errors.New("memory: stale delivery handle")

	// ErrInvalidHandle is returned by Settle and Extend for a handle that did
	// not come from this queue's Fetch.
	ErrInvalidHandle = errors.New("memory: invalid delivery handle")

	// ErrQueueNotFound is returned for a queue that does not exist when the
	// broker does not create queues on first use (see WithAutoCreate).
	ErrQueueNotFound = errors.New("memory: queue not found")

	// ErrQueueExists is returned by CreateQueue for a name already taken by a
	// queue with a different configuration.
	ErrQueueExists = errors.New("memory: queue exists with a different configuration")

	// ErrInvalidMessage is the reason, inside a *consumer.PublishError, for a
	// message a queue cannot take (a FIFO message without a Key).
	ErrInvalidMessage = errors.New("memory: invalid message")
)

// Headers the broker sets on a message it moves to a dead-letter queue.
const (
	// HeaderSourceQueue names the queue the message was dead-lettered from.
	HeaderSourceQueue = "ferry-source-queue"
	// HeaderReceiveCount is how many times the message had been received
	// from the source queue, in decimal.
	HeaderReceiveCount = "ferry-receive-count"
)

// DefaultVisibilityTimeout is a queue's visibility timeout when its
// QueueConfig leaves it zero, as on SQS.
const DefaultVisibilityTimeout = 30 * time.Second

// DefaultDedupWindow is how long a FIFO queue remembers message IDs to drop
// duplicates, as on SQS.
const DefaultDedupWindow = 5 * time.Minute

// Delivery is what consumer.Message.As gives a handler on the memory broker:
// one delivery as its queue sees it.
type Delivery struct {
	// Queue is the queue the message was fetched from.
	Queue string
	// MessageID is the message's id.
	MessageID string
	// ReceiveCount is how many times the message has been fetched,
	// including this time (SQS's ApproximateReceiveCount).
	ReceiveCount int
	// Group is the FIFO message group, "" on a standard queue.
	Group string
	// Current is true while this delivery still holds the message: not
	// settled, and its lease not run out and given to another fetch.
	Current bool
}

// QueueConfig configures one queue. The zero value is a standard queue with a
// 30s visibility timeout and no dead-letter queue.
type QueueConfig struct {
	// VisibilityTimeout is how long a fetched message stays hidden from other
	// fetches before it is delivered again, unless it is settled or its lease
	// is extended first. Default 30s (DefaultVisibilityTimeout).
	VisibilityTimeout time.Duration

	// FIFO makes the queue keep order per message group, like an SQS FIFO
	// queue: the group is Message.Key (which must not be empty), messages of a
	// group are delivered one at a time in publish order, and a message ID
	// published again within DefaultDedupWindow is dropped. Default false: a
	// standard queue, delivering in roughly publish order with no ordering
	// guarantee after redeliveries.
	FIFO bool

	// MaxReceiveCount moves a message to DeadLetterQueue instead of
	// delivering it for the (MaxReceiveCount+1)-th time, as SQS redrive
	// does. Default 0: messages are delivered again for ever.
	MaxReceiveCount int

	// DeadLetterQueue names the queue that takes messages past
	// MaxReceiveCount. Required when MaxReceiveCount > 0, and only then. It
	// must already exist, must differ from the queue itself, and must be
	// FIFO exactly when the queue is.
	DeadLetterQueue string
}

// Option configures a Broker. New applies the options in order and fails
// with a *consumer.ConfigError on the first that is invalid.
type Option func(*config) error

type config struct {
	autoCreate    bool
	dedupWindow   time.Duration
	meterProvider metric.MeterProvider
}

// WithMeterProvider sets where Publish reports its calls, as the
// OpenTelemetry messaging conventions name them
// (messaging.client.operation.duration and messaging.client.sent.messages,
// with messaging.system "ferry_memory"). Default the global provider, a
// no-op until one is installed.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(c *config) error {
		if mp == nil {
			return consumer.ConfigErrorf("MeterProvider", "must not be nil")
		}
		c.meterProvider = mp
		return nil
	}
}

// WithAutoCreate chooses what happens on Publish, Driver or NewConsumer for a
// queue that does not exist. When true (the default), such a queue is
// created with the zero QueueConfig, which is what a test double wants. When
// false, those calls fail with ErrQueueNotFound, as SQS does.
func WithAutoCreate(enabled bool) Option {
	return func(c *config) error {
		c.autoCreate = enabled
		return nil
	}
}

// WithDedupWindow sets how long FIFO queues remember published message IDs
// to drop duplicates. Default 5m (DefaultDedupWindow); zero turns
// deduplication off. A negative window is refused.
func WithDedupWindow(d time.Duration) Option {
	return func(c *config) error {
		if d < 0 {
			return consumer.ConfigErrorf("DedupWindow", "must be >= 0 (0 turns deduplication off), got %v", d)
		}
		c.dedupWindow = d
		return nil
	}
}

// Broker is an in-process message broker with named queues. It is safe for
// concurrent use. See the package documentation for its semantics.
type Broker struct {
	epoch       time.Time
	autoCreate  bool
	dedupWindow time.Duration
	idPrefix    string
	idSeq       atomic.Uint64

	mu     sync.RWMutex
	queues map[string]*queue

	closeOnce sync.Once
	closed    chan struct{}

	metrics *msgmetrics.Publisher
}

var (
	_ consumer.Broker      = (*Broker)(nil)
	_ consumer.SystemNamer = (*Broker)(nil)
	_ driver.Opener        = (*Broker)(nil)
)

// System names the broker as OpenTelemetry's messaging.system does: "ferry_memory".
func (b *Broker) System() string { return system }

// system is the memory broker's messaging.system in traces and metrics.
const system = "ferry_memory"

// New returns an empty broker, or a *consumer.ConfigError when an option is
// invalid.
func New(opts ...Option) (*Broker, error) {
	c := config{autoCreate: true, dedupWindow: DefaultDedupWindow}
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o(&c); err != nil {
			return nil, err
		}
	}
	if c.meterProvider == nil {
		c.meterProvider = otel.GetMeterProvider()
	}
	pm, err := msgmetrics.NewPublisher(c.meterProvider, system)
	if err != nil {
		return nil, fmt.Errorf("memory: metrics: %w", err)
	}
	var p [4]byte
	_, _ = rand.Read(p[:])
	return &Broker{
		metrics:     pm,
		epoch:       time.Now(),
		autoCreate:  c.autoCreate,
		dedupWindow: c.dedupWindow,
		idPrefix:    hex.EncodeToString(p[:]) + "-",
		queues:      make(map[string]*queue),
		closed:      make(chan struct{}),
	}, nil
}

// now reads the broker's monotonic clock in nanoseconds.
func (b *Broker) now() int64 { return int64(time.Since(b.epoch)) }

func (b *Broker) isClosed() bool {
	select {
	case <-b.closed:
		return true
	default:
		return false
	}
}

// Close stops the broker: fetches waiting for messages return at once with
// an error wrapping ErrClosed (marked driver.Fatal), and later Publish,
// Fetch, Settle and Extend calls fail the same way. Stats and Messages keep
// working, so a test can inspect the broker after closing it. Close starts no
// goroutines and leaves none behind; calling it again does nothing.
func (b *Broker) Close() error {
	b.closeOnce.Do(func() { close(b.closed) })
	return nil
}

// CreateQueue creates the queue name. Creating a queue that exists with the
// same configuration does nothing; with a different one it fails with
// ErrQueueExists. An invalid configuration fails with a *consumer.ConfigError
// naming the field.
func (b *Broker) CreateQueue(name string, cfg QueueConfig) error {
	if name == "" {
		return consumer.ConfigErrorf("queue", "name must not be empty")
	}
	if cfg.VisibilityTimeout < 0 {
		return consumer.ConfigErrorf("QueueConfig.VisibilityTimeout", "must be >= 0, got %s", cfg.VisibilityTimeout)
	}
	if cfg.VisibilityTimeout == 0 {
		cfg.VisibilityTimeout = DefaultVisibilityTimeout
	}
	if cfg.MaxReceiveCount < 0 {
		return consumer.ConfigErrorf("QueueConfig.MaxReceiveCount", "must be >= 0, got %d", cfg.MaxReceiveCount)
	}
	if cfg.MaxReceiveCount > 0 && cfg.DeadLetterQueue == "" {
		return consumer.ConfigErrorf("QueueConfig.DeadLetterQueue", "is required when MaxReceiveCount > 0")
	}
	if cfg.MaxReceiveCount == 0 && cfg.DeadLetterQueue != "" {
		return consumer.ConfigErrorf("QueueConfig.MaxReceiveCount", "must be > 0 when DeadLetterQueue is set")
	}
	if cfg.DeadLetterQueue == name {
		return consumer.ConfigErrorf("QueueConfig.DeadLetterQueue", "must not be the queue itself")
	}
	if b.isClosed() {
		return fmt.Errorf("memory: create queue %q: %w", name, ErrClosed)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	var dlq *queue
	if cfg.DeadLetterQueue != "" {
		dlq = b.queues[cfg.DeadLetterQueue]
		if dlq == nil {
			return consumer.ConfigErrorf("QueueConfig.DeadLetterQueue", "names queue %q, which does not exist", cfg.DeadLetterQueue)
		}
		if dlq.cfg.FIFO != cfg.FIFO {
			return consumer.ConfigErrorf("QueueConfig.DeadLetterQueue", "queue %q must be FIFO exactly when %q is", cfg.DeadLetterQueue, name)
		}
	}
	if q := b.queues[name]; q != nil {
		if q.cfg != cfg {
			return fmt.Errorf("memory: create queue %q: %w", name, ErrQueueExists)
		}
		return nil
	}
	b.queues[name] = newQueue(b, name, cfg, dlq)
	return nil
}

// queue finds a queue, creating it when the broker auto-creates.
func (b *Broker) queue(name string) (*queue, error) {
	if name == "" {
		return nil, consumer.ConfigErrorf("queue", "name must not be empty")
	}
	b.mu.RLock()
	q := b.queues[name]
	b.mu.RUnlock()
	if q != nil {
		return q, nil
	}
	if !b.autoCreate {
		return nil, fmt.Errorf("memory: queue %q: %w", name, ErrQueueNotFound)
	}
	if err := b.CreateQueue(name, QueueConfig{}); err != nil && !errors.Is(err, ErrQueueExists) {
		return nil, err
	}
	b.mu.RLock()
	q = b.queues[name]
	b.mu.RUnlock()
	return q, nil
}

// lookup finds a queue without creating it.
func (b *Broker) lookup(name string) *queue {
	b.mu.RLock()
	defer b.mu.RUnlock()
	return b.queues[name]
}

// Publish adds msgs to the queue named destination, in order. It copies Body
// and Headers, so the caller may reuse them; gives each message with an
// empty ID a unique one; and sets the time it was published. Once it returns
// nil the messages can be fetched.
//
// On a FIFO queue, Key is the message group and must not be empty, and a
// message whose ID the queue took within the deduplication window is
// dropped (Publish still succeeds, as on SQS). Messages the queue cannot take
// are reported in a *consumer.PublishError wrapping ErrInvalidMessage; the
// others are published.
func (b *Broker) Publish(ctx context.Context, destination string, msgs ...consumer.Message) error {
	start := time.Now()
	err := b.publish(ctx, destination, msgs)
	b.metrics.Record(ctx, destination, len(msgs), start, err)
	return err
}

func (b *Broker) publish(ctx context.Context, destination string, msgs []consumer.Message) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if b.isClosed() {
		return fmt.Errorf("memory: publish to %q: %w", destination, ErrClosed)
	}
	q, err := b.queue(destination)
	if err != nil {
		return err
	}
	if len(msgs) == 0 {
		return nil
	}

	// Build the entries outside the lock: one slice of entries, one buffer
	// for all bodies and one string for all new IDs per call.
	var perr *consumer.PublishError
	bodies, newIDs := 0, 0
	for i := range msgs {
		bodies += len(msgs[i].Body)
		if msgs[i].ID == "" {
			newIDs++
		}
		if q.cfg.FIFO && msgs[i].Key == "" {
			if perr == nil {
				perr = &consumer.PublishError{}
			}
			perr.Failed = append(perr.Failed, consumer.FailedMessage{Index: i,
				Err: fmt.Errorf("%w: Key (the message group) must not be empty on FIFO queue %q", ErrInvalidMessage, destination)})
		}
	}
	var ids string
	var idEnds []int
	if newIDs > 0 {
		last := b.idSeq.Add(uint64(newIDs))
		buf := make([]byte, 0, newIDs*(len(b.idPrefix)+8))
		idEnds = make([]int, 0, newIDs)
		for n := last - uint64(newIDs) + 1; n <= last; n++ {
			buf = append(buf, b.idPrefix...)
			buf = strconv.AppendUint(buf, n, 10)
			idEnds = append(idEnds, len(buf))
		}
		ids = string(buf)
	}
	ents := make([]entry, len(msgs))
	var arena []byte
	if bodies > 0 {
		arena = make([]byte, bodies)
	}
	pub := time.Now().UnixNano()
	idStart, idn := 0, 0
	for i := range msgs {
		m, e := &msgs[i], &ents[i]
		e.id, e.key, e.pub = m.ID, m.Key, pub
		if e.id == "" {
			e.id = ids[idStart:idEnds[idn]]
			idStart = idEnds[idn]
			idn++
		}
		if m.Body != nil {
			n := copy(arena, m.Body)
			e.body = arena[:n:n]
			arena = arena[n:]
		}
		if m.Headers != nil {
			e.headers = maps.Clone(m.Headers)
		}
	}

	q.mu.Lock()
	now := b.now()
	dedup := q.cfg.FIFO && b.dedupWindow > 0
	f := 0
	for i := range ents {
		if perr != nil && f < len(perr.Failed) && perr.Failed[f].Index == i {
			f++
			continue
		}
		if dedup && msgs[i].ID != "" && q.isDuplicate(msgs[i].ID, now) {
			continue
		}
		q.enqueue(&ents[i], now)
	}
	q.notify()
	q.mu.Unlock()
	if perr != nil {
		return perr
	}
	return nil
}

// Driver returns a driver over the queue, for consumer.NewOn or a custom
// loop (driver.Opener; the memory broker needs nothing of cfg, nor of
// ctx). It implements driver.Extender (the lease is the queue's
// visibility timeout) and driver.LagReporter. Each consumer should have
// its own; several drivers over one queue compete for its messages.
func (b *Broker) Driver(_ context.Context, queue string, _ driver.Config) (driver.Driver, error) {
	if b.isClosed() {
		return nil, fmt.Errorf("memory: driver for %q: %w", queue, ErrClosed)
	}
	q, err := b.queue(queue)
	if err != nil {
		return nil, err
	}
	return &memDriver{q: q, done: make(chan struct{})}, nil
}

// NewConsumer returns a delivery loop over the queue: consumer.NewOn over
// the Broker, with opts.
func (b *Broker) NewConsumer(ctx context.Context, queue string, opts ...consumer.Option) (*consumer.Loop, error) {
	return consumer.NewOn(ctx, b, queue, opts...)
}

// QueueStats is a snapshot of one queue.
type QueueStats struct {
	Visible      int64 // waiting to be fetched (in FIFO, also those behind their group's head)
	Delayed      int64 // returned with a delay that has not yet passed
	InFlight     int64 // fetched, lease running, not yet settled
	Acked        int64 // acknowledged, in total
	DeadLettered int64 // moved to the dead-letter queue, in total
}

// Stats returns a snapshot of the queue's counters, or the zero QueueStats
// for a queue that does not exist. Leases and delays that ran out are
// accounted for first.
func (b *Broker) Stats(queue string) QueueStats {
	q := b.lookup(queue)
	if q == nil {
		return QueueStats{}
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	q.advance(b.now())
	q.notify()
	return QueueStats{
		Visible:      q.visible,
		Delayed:      q.delayed,
		InFlight:     q.inflight,
		Acked:        q.acked,
		DeadLettered: q.deadLettered,
	}
}

// Messages returns a copy of every message the queue holds, not yet acked
// or dead-lettered, whether visible, delayed or in flight, in the order the
// queue took them. Deliveries is how many times each was received so far (0
// for none). It is meant for tests, for example to assert on the contents
// and headers of a dead-letter queue; it returns nil for a queue that does
// not exist.
func (b *Broker) Messages(queue string) []consumer.Message {
	q := b.lookup(queue)
	if q == nil {
		return nil
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	q.trimOrder()
	out := make([]consumer.Message, 0, q.order.len())
	for i := 0; i < q.order.len(); i++ {
		e := q.order.at(i)
		if e.state == stGone {
			continue
		}
		m := consumer.Message{
			ID:          e.id,
			Key:         e.key,
			Headers:     maps.Clone(e.headers),
			Source:      q.name,
			Offset:      -1,
			Deliveries:  int(e.receives),
			PublishedAt: time.Unix(0, e.pub),
		}
		if e.body != nil {
			m.Body = append([]byte{}, e.body...)
		}
		if q.cfg.FIFO {
			m.Lane = e.key
		}
		out = append(out, m)
	}
	return out
}
