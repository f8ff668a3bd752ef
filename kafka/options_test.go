package kafka_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
)

// TestNewRefusesManualFlushing: WithClientOpts passes every franz-go
// option to the producer, and checkClientOpts (broker.go:378-425) refuses
// only the consumer-group, autocommit, callback, acks and idempotence ones.
// kgo.ManualFlushing is accepted, yet Publish (broker.go:553-560) produces
// and then waits for every promise without ever calling Flush: with it, no
// record is ever sent, and Publish never returns nil (it waits until its
// context ends, or for ever with a context that does not). It breaks the
// Publisher contract and should be a *consumer.ConfigError at New.
func TestNewRefusesManualFlushing(t *testing.T) {
	topic := newTopic(t, newBroker(t), "defect-manual", 1)
	b, err := kafka.New([]string{"127.0.0.1:9092"}, kafka.WithClientOpts(kgo.ManualFlushing()), kafka.WithLogger(testLogger(t)))
	if err == nil {
		defer b.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		done := make(chan error, 1)
		go func() { done <- b.Publish(ctx, topic, consumer.Message{Key: "k", Body: []byte("x")}) }()
		select {
		case perr := <-done:
			t.Errorf("New accepted kgo.ManualFlushing; Publish then returned %v (never sends)", perr)
		case <-time.After(20 * time.Second):
			t.Errorf("New accepted kgo.ManualFlushing; Publish then hangs past its 5s context")
		}
		return
	}
	var ce *consumer.ConfigError
	if !errors.As(err, &ce) {
		t.Fatalf("New = %v, want a *consumer.ConfigError", err)
	}
}

// TestNewRefusesDefaultProduceTopicAlways: kgo.DefaultProduceTopic
// with kgo.DefaultProduceTopicAlways makes franz-go overwrite every record's
// topic (kgo producer.go produce: r.Topic = defaultProduceTopic). It is
// accepted by checkClientOpts (broker.go:378-425), and then Publish(ctx,
// topic, ...) (broker.go:488) returns nil having written to another topic:
// the records, and anything DeadLetter publishes, silently go elsewhere.
func TestNewRefusesDefaultProduceTopicAlways(t *testing.T) {
	probe := newBroker(t)
	elsewhere := newTopic(t, probe, "defect-elsewhere", 1)
	wanted := newTopic(t, probe, "defect-wanted", 1)
	b, err := kafka.New([]string{"127.0.0.1:9092"}, kafka.WithLogger(testLogger(t)),
		kafka.WithClientOpts(kgo.DefaultProduceTopic(elsewhere), kgo.DefaultProduceTopicAlways()))
	if err == nil {
		defer b.Close()
		perr := b.Publish(testenv.Context(t, 30*time.Second), wanted, consumer.Message{Key: "k", Body: []byte("x")})
		ends := endOffsets(t, probe.Admin(), wanted)
		other := endOffsets(t, probe.Admin(), elsewhere)
		t.Errorf("New accepted kgo.DefaultProduceTopicAlways; Publish to %s returned %v, and %d record(s) are in it, %d in %s",
			wanted, perr, ends[0], other[0], elsewhere)
		return
	}
	var ce *consumer.ConfigError
	if !errors.As(err, &ce) {
		t.Fatalf("New = %v, want a *consumer.ConfigError", err)
	}
}

// TestNewRefusesAShareGroupOfItsOwn: a share group is chosen with
// WithGroupProtocol(Share) and named by each consumer's name; one set
// through WithClientOpts would make every client of the Broker a member of
// that group, the producer included. New refuses it (franz-go does, beside
// the probe's consumer group), naming the option.
func TestNewRefusesAShareGroupOfItsOwn(t *testing.T) {
	_, err := kafka.New([]string{"127.0.0.1:9092"}, kafka.WithClientOpts(kgo.ShareGroup("mine")))
	var ce *consumer.ConfigError
	if !errors.As(err, &ce) || ce.Field != "ClientOpts" {
		t.Fatalf("New = %v, want a *consumer.ConfigError for ClientOpts", err)
	}
	if !strings.Contains(err.Error(), "ShareGroup") {
		t.Errorf("the error %q does not name kgo.ShareGroup", err)
	}
}
