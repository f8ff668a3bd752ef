package kafka_test

import (
	"context"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
)

// newBroker connects to the test Kafka (skipping or failing, per
// FERRY_REQUIRE_BROKERS, when it is not there) and closes the Broker when
// the test ends.
func newBroker(t testing.TB, opts ...kafka.Option) *kafka.Broker {
	t.Helper()
	seeds := testenv.RequireKafka(t)
	opts = append([]kafka.Option{kafka.WithLogger(testLogger(t))}, opts...)
	b, err := kafka.New(seeds, opts...)
	if err != nil {
		t.Fatalf("kafka.New: %v", err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return b
}

func testLogger(t testing.TB) *slog.Logger {
	if tt, ok := t.(*testing.T); ok {
		return slog.New(slog.NewTextHandler(tt.Output(), &slog.HandlerOptions{Level: slog.LevelInfo}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// newTopic creates a topic with a unique name and n partitions, deleted
// when the test ends.
func newTopic(t testing.TB, b *kafka.Broker, prefix string, partitions int32) string {
	t.Helper()
	topic := testenv.UniqueName(t, prefix)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := b.CreateSource(ctx, topic, consumer.SourceConfig{Partitions: int(partitions)}); err != nil {
		t.Fatalf("create topic: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = b.DeleteSource(ctx, topic)
	})
	return topic
}

// running is one consumer's Run in a goroutine (testenv.Start), which
// stop ends, failing the test when Run did not return nil.
type running struct {
	*testenv.Running
	reported sync.Once
}

func runConsumer(t testing.TB, c consumer.Consumer, h consumer.Handler) *running {
	t.Helper()
	r := &running{Running: testenv.Start(t, func(ctx context.Context) error { return c.Run(ctx, h) })}
	t.Cleanup(func() { r.stop(t) })
	return r
}

// stop cancels the run and waits for Run to return (nil expected).
func (r *running) stop(t testing.TB) {
	t.Helper()
	if err := r.Stop(); err != nil {
		r.reported.Do(func() { t.Errorf("Run: %v", err) })
	}
}

// committed reads the group's committed offsets of topic through kadm.
func committed(t testing.TB, adm *kadm.Client, group, topic string) map[int32]int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	os, err := adm.FetchOffsets(ctx, group)
	if err != nil {
		t.Fatalf("fetch offsets of %s: %v", group, err)
	}
	out := make(map[int32]int64)
	os.Each(func(o kadm.OffsetResponse) {
		if o.Topic == topic && o.Err == nil {
			out[o.Partition] = o.At
		}
	})
	return out
}

// produceRaw writes records with franz-go directly, each to the partition
// it names.
func produceRaw(t testing.TB, recs ...*kgo.Record) {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(testenv.KafkaBrokers()...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		t.Fatalf("produce: %v", err)
	}
}
