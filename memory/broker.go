package memory

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/msgmetrics"
)

// Headers the broker sets on a message it moves to a dead-letter queue.
const (
	// HeaderSourceQueue names the queue the message was dead-lettered from.
	HeaderSourceQueue = "ferry-source-queue"
	// HeaderReceiveCount is how many times the message had been received
	// from the source queue, in decimal.
	HeaderReceiveCount = "ferry-receive-count"
)

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

// System names the broker as OpenTelemetry's messaging.system does:
// [MessagingSystem].
func (b *Broker) System() string { return MessagingSystem }

// MessagingSystem is the memory broker's messaging.system in traces and
// metrics (Broker.System).
const MessagingSystem = "ferry_memory"

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
	pm, err := msgmetrics.NewPublisher(c.meterProvider, MessagingSystem)
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
	Delayed      int64 // returned with a delay, or published with a NotBefore, not yet due
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
