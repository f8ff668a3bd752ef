package memory_test

import (
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/consumertest"
	"github.com/ferrymq/ferry/memory"
)

// TestConformance runs the conformance suite that every broker adapter
// passes against the memory broker.
func TestConformance(t *testing.T) {
	consumertest.Run(t, &conformanceHarness{})
}

// conformanceHarness gives each test its own broker, so that nothing one
// test leaves behind reaches another.
type conformanceHarness struct {
	seq atomic.Int64
	// brokers maps a test to its broker; the suite calls the harness from the
	// test's own goroutine, one test at a time.
	brokers map[*testing.T]*memory.Broker
}

var (
	_ consumertest.Harness         = (*conformanceHarness)(nil)
	_ consumertest.InFlightCounter = (*conformanceHarness)(nil)
)

// conformanceLease is the short visibility timeout the lease tests ask for.
const conformanceLease = time.Second

func (h *conformanceHarness) broker(t *testing.T) *memory.Broker {
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
		if err := b.Close(); err != nil {
			t.Errorf("close broker: %v", err)
		}
	})
	return b
}

func (h *conformanceHarness) NewSource(t *testing.T, cfg consumertest.SourceConfig) string {
	name := "conformance-" + strconv.FormatInt(h.seq.Add(1), 10)
	if cfg.Ordered {
		name += ".fifo"
	}
	qc := memory.QueueConfig{VisibilityTimeout: cfg.Lease, FIFO: cfg.Ordered}
	if err := h.broker(t).CreateQueue(name, qc); err != nil {
		t.Fatalf("create queue %q: %v", name, err)
	}
	return name
}

func (h *conformanceHarness) Publisher(t *testing.T) consumer.Publisher { return h.broker(t) }

func (h *conformanceHarness) NewConsumer(t *testing.T, source string, opts ...consumer.Option) consumer.Consumer {
	c, err := h.broker(t).NewConsumer(t.Context(), source, opts...)
	if err != nil {
		t.Fatalf("new consumer of %q: %v", source, err)
	}
	return c
}

func (h *conformanceHarness) AsCheck(m *consumer.Message) error {
	var d memory.Delivery
	if !m.As(&d) {
		return errors.New("Message.As(*memory.Delivery) = false")
	}
	if d.Queue != m.Source || d.MessageID != m.ID || d.ReceiveCount != m.Deliveries || !d.Current {
		return fmt.Errorf("Message.As gave %+v for message %s from %s, delivery %d", d, m.ID, m.Source, m.Deliveries)
	}
	return nil
}

func (h *conformanceHarness) InFlight(t *testing.T, source string) int {
	return int(h.broker(t).Stats(source).InFlight)
}

func (h *conformanceHarness) Capabilities() consumertest.Capabilities {
	return consumertest.Capabilities{
		Ordered:    true,
		Lease:      conformanceLease,
		Redelivers: true,
		Delays:     true,
	}
}
