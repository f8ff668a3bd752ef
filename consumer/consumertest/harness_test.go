package consumertest_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/consumertest"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/memory"
)

// memHarness runs the suite on the memory broker, with one broker per test,
// optionally broken on purpose (see sabotage_test.go).
type memHarness struct {
	seq atomic.Int64
	// brokers maps each test to its broker; the suite calls the harness from
	// the test's own goroutine, one test at a time.
	brokers map[*testing.T]*memory.Broker

	// wrap, when set, breaks every consumer the harness makes.
	wrap func(consumer.Consumer) consumer.Consumer
	// noExtend hides the driver's lease extension from the loop.
	noExtend bool
	// publishNow drops every message's NotBefore as it is published.
	publishNow bool
	// claimNoDelays reports that Publish cannot delay, though it can.
	claimNoDelays bool
	// giveBack returns every message to the queue as soon as it is fetched.
	giveBack bool
	// ackReturns acks every message the loop gives back.
	ackReturns bool
	// plain hides every optional driver interface (lease extension, As).
	plain bool
	// opts are given to every consumer after the suite's own.
	opts []consumer.Option
}

var _ consumertest.Harness = (*memHarness)(nil)

func (h *memHarness) broker(t *testing.T) *memory.Broker {
	if b, ok := h.brokers[t]; ok {
		return b
	}
	if h.brokers == nil {
		h.brokers = make(map[*testing.T]*memory.Broker)
	}
	b, err := memory.New(memory.WithAutoCreate(false))
	if err != nil {
		t.Fatal(err)
	}
	h.brokers[t] = b
	t.Cleanup(func() {
		delete(h.brokers, t)
		_ = b.Close()
	})
	return b
}

func (h *memHarness) NewSource(t *testing.T, cfg consumertest.SourceConfig) string {
	name := "suite-" + strconv.FormatInt(h.seq.Add(1), 10)
	if err := h.broker(t).CreateQueue(name, memory.QueueConfig{VisibilityTimeout: cfg.Lease, FIFO: cfg.Ordered}); err != nil {
		t.Fatalf("create queue %q: %v", name, err)
	}
	return name
}

func (h *memHarness) Publisher(t *testing.T) consumer.Publisher {
	if h.publishNow {
		return nowPublisher{h.broker(t)}
	}
	return h.broker(t)
}

// nowPublisher publishes every message at once, whatever its NotBefore.
type nowPublisher struct{ next consumer.Publisher }

func (p nowPublisher) Publish(ctx context.Context, dest string, msgs ...consumer.Message) error {
	out := make([]consumer.Message, len(msgs))
	for i, m := range msgs {
		m.NotBefore = time.Time{}
		out[i] = m
	}
	return p.next.Publish(ctx, dest, out...)
}

func (h *memHarness) NewConsumer(t *testing.T, source string, opts ...consumer.Option) consumer.Consumer {
	d, err := h.broker(t).Driver(t.Context(), source, driver.Config{})
	if err != nil {
		t.Fatalf("driver for %q: %v", source, err)
	}
	if h.noExtend || h.plain {
		d = plainDriver{d}
	}
	if h.giveBack {
		d = givingBackDriver{plainDriver{d}}
	}
	if h.ackReturns {
		d = ackingDriver{plainDriver{d}}
	}
	l, err := consumer.New(d, append(opts, h.opts...)...)
	if err != nil {
		t.Fatalf("new consumer of %q: %v", source, err)
	}
	if h.wrap != nil {
		return h.wrap(l)
	}
	return l
}

func (h *memHarness) AsCheck(m *consumer.Message) error {
	return checkMemoryAs(m)
}

// checkMemoryAs checks that m.As gives the memory broker's *memory.Delivery
// for m.
func checkMemoryAs(m *consumer.Message) error {
	var d memory.Delivery
	if !m.As(&d) {
		return errors.New("Message.As(*memory.Delivery) = false")
	}
	if d.Queue != m.Source || d.MessageID != m.ID || d.ReceiveCount != m.Deliveries || !d.Current {
		return fmt.Errorf("Message.As gave %+v for message %s from %s, delivery %d", d, m.ID, m.Source, m.Deliveries)
	}
	return nil
}

func (h *memHarness) Capabilities() consumertest.Capabilities {
	return consumertest.Capabilities{Ordered: true, Lease: time.Second, Redelivers: true, Delays: !h.claimNoDelays}
}

// plainDriver shows the loop only driver.Driver, hiding Extend.
type plainDriver struct{ d driver.Driver }

func (p plainDriver) Fetch(ctx context.Context, dst []driver.Message, max int) ([]driver.Message, error) {
	return p.d.Fetch(ctx, dst, max)
}

func (p plainDriver) Settle(ctx context.Context, batch []driver.Settlement) error {
	return p.d.Settle(ctx, batch)
}

func (p plainDriver) Capabilities() driver.Capabilities { return p.d.Capabilities() }

func (p plainDriver) Close() error { return p.d.Close() }

// givingBackDriver returns each message to the queue the moment it fetched
// it, so that it is handled here and can be fetched again elsewhere.
type givingBackDriver struct{ plainDriver }

func (g givingBackDriver) Fetch(ctx context.Context, dst []driver.Message, max int) ([]driver.Message, error) {
	n := len(dst)
	dst, err := g.d.Fetch(ctx, dst, max)
	var back []driver.Settlement
	for _, m := range dst[n:] {
		back = append(back, driver.Settlement{Handle: m.Handle, Action: driver.Return})
	}
	if len(back) > 0 {
		_ = g.d.Settle(ctx, back)
	}
	return dst, err
}

// ackingDriver acks every message the loop returns: what a consumer that
// "acks on shutdown" does.
type ackingDriver struct{ plainDriver }

func (a ackingDriver) Settle(ctx context.Context, batch []driver.Settlement) error {
	for i := range batch {
		batch[i].Action = driver.Ack
	}
	return a.d.Settle(ctx, batch)
}
