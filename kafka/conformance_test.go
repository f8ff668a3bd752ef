package kafka_test

import (
	"errors"
	"fmt"
	"strconv"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/consumertest"
	"github.com/ferrymq/ferry/kafka"
)

// TestConformance runs the conformance suite against the real Kafka, with
// every consumer of a source in one group, under both group protocols. Its
// consumers are made the way a user makes them, kafka.New then
// Broker.NewConsumer with consumer.WithName(group); the driver alone, as
// Broker.Driver returns it, is what TestDriverConformance runs.
func TestConformance(t *testing.T) {
	for _, p := range []kafka.GroupProtocol{kafka.Classic, kafka.NextGen} {
		t.Run(p.String(), func(t *testing.T) {
			consumertest.Run(t, &harness{b: newBroker(t, kafka.WithGroupProtocol(p))})
		})
	}
}

// harness makes a topic of four partitions per test; the key picks the
// partition, so every topic is an ordered source.
type harness struct {
	b *kafka.Broker
}

var _ consumertest.Harness = (*harness)(nil)

func (h *harness) NewSource(t *testing.T, cfg consumertest.SourceConfig) string {
	return newTopic(t, h.b, "conformance", 4)
}

func (h *harness) Publisher(t *testing.T) consumer.Publisher { return h.b }

// NewConsumer makes the consumer as a user does, with Broker.NewConsumer
// and the group as its name: every consumer of a source joins the group
// source+"-group", whatever name the suite gives it (the last WithName
// wins), so that two consumers of one source share its partitions.
func (h *harness) NewConsumer(t *testing.T, source string, opts ...consumer.Option) consumer.Consumer {
	opts = append(opts[:len(opts):len(opts)], consumer.WithName(source+"-group"))
	c, err := h.b.NewConsumer(t.Context(), source, opts...)
	if err != nil {
		t.Fatalf("new consumer of %q: %v", source, err)
	}
	return c
}

func (h *harness) AsCheck(m *consumer.Message) error {
	var r *kgo.Record
	if !m.As(&r) {
		return errors.New("Message.As(**kgo.Record) = false")
	}
	if r.Topic != m.Source || r.Offset != m.Offset || strconv.Itoa(int(r.Partition)) != m.Lane || string(r.Value) != string(m.Body) {
		return fmt.Errorf("Message.As gave %s/%d/%d for message at %s/%s/%d", r.Topic, r.Partition, r.Offset, m.Source, m.Lane, m.Offset)
	}
	var cp kgo.Record
	if !m.As(&cp) || cp.Offset != r.Offset {
		return errors.New("Message.As(*kgo.Record) did not copy the record")
	}
	return nil
}

func (h *harness) Capabilities() consumertest.Capabilities {
	// A log: no lease, no redelivery by the broker, ordered partitions; a
	// record batch is at most 1 MB by default (message.max.bytes).
	return consumertest.Capabilities{Ordered: true, MaxBody: 900 << 10}
}
