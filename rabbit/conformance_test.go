package rabbit_test

import (
	"errors"
	"fmt"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/consumertest"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/rabbit"
)

// TestConformance runs the conformance suite every broker adapter passes
// against the real RabbitMQ.
func TestConformance(t *testing.T) {
	amqpURL(t)
	consumertest.Run(t, &harness{brokers: map[string]*rabbit.Broker{}})
}

// harness gives each source its own queue, declared through the topology
// of a Broker of its own; Publish(ctx, source, …) reaches it, as on every
// broker, through the default exchange. An ordered source is a
// single-active-consumer queue, whose deliveries have their Key as Lane.
type harness struct {
	brokers map[string]*rabbit.Broker // by source
}

var (
	_ consumertest.Harness         = (*harness)(nil)
	_ consumertest.InFlightCounter = (*harness)(nil)
)

func (h *harness) NewSource(t *testing.T, cfg consumertest.SourceConfig) string {
	name := testenv.UniqueName(t, "conf")
	topo := rabbit.Topology{
		Queues: []rabbit.Queue{{Name: name, SingleActiveConsumer: cfg.Ordered, DeadLetterExchange: name + ".dlx"}},
	}
	deleteLater(t, []string{name}, nil)
	h.brokers[name] = dial(t, rabbit.WithTopology(topo))
	t.Cleanup(func() { delete(h.brokers, name) })
	return name
}

func (h *harness) Publisher(t *testing.T) consumer.Publisher { return dial(t) }

func (h *harness) NewConsumer(t *testing.T, source string, opts ...consumer.Option) consumer.Consumer {
	b := h.brokers[source]
	if b == nil {
		t.Fatalf("no broker for source %q", source)
	}
	c, err := b.NewConsumer(t.Context(), source, opts...)
	if err != nil {
		t.Fatalf("new consumer of %q: %v", source, err)
	}
	return c
}

func (h *harness) AsCheck(m *consumer.Message) error {
	var d amqp.Delivery
	if !m.As(&d) {
		return errors.New("Message.As(*amqp091.Delivery) = false")
	}
	if d.MessageId != m.ID || string(d.Body) != string(m.Body) || d.DeliveryTag == 0 {
		return fmt.Errorf("Message.As gave message id %q, body %q, tag %d for message %s", d.MessageId, d.Body, d.DeliveryTag, m.ID)
	}
	return nil
}

func (h *harness) InFlight(t *testing.T, source string) int { return unacked(t, source) }

func (h *harness) Capabilities() consumertest.Capabilities {
	return consumertest.Capabilities{Ordered: true, Redelivers: true, Delays: true}
}
