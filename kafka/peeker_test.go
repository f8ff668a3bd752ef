package kafka_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
)

// The portable Peek reads every partition from its earliest record and
// returns the oldest max records by timestamp across partitions, leaving
// the topic as it was: a second Peek reads the same.
func TestPeekerReadsOldestFirstAcrossPartitions(t *testing.T) {
	b := newBroker(t)
	var p consumer.Peeker = b
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	topic := testenv.UniqueName(t, "peeker")
	if err := b.CreateSource(ctx, topic, consumer.SourceConfig{Partitions: 2}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.DeleteSource(context.Background(), topic) })
	// Partition 1 holds the oldest record: a read partition by partition
	// would put partition 0's first.
	t0 := time.Now().Add(-time.Hour).Truncate(time.Millisecond)
	rec := func(part int32, v string, ms int) *kgo.Record {
		return &kgo.Record{Topic: topic, Partition: part, Value: []byte(v), Timestamp: t0.Add(time.Duration(ms) * time.Millisecond)}
	}
	produceRaw(t, rec(1, "a", 1), rec(1, "c", 3), rec(0, "b", 2), rec(0, "d", 4))
	for range 2 {
		got, err := p.Peek(ctx, topic, 3)
		if err != nil {
			t.Fatal(err)
		}
		if peekedBodies(got) != "abc" {
			t.Fatalf("Peek(3) = %q, want abc: the three oldest, oldest first", peekedBodies(got))
		}
	}
	all, err := p.Peek(ctx, topic, 10)
	if err != nil || peekedBodies(all) != "abcd" {
		t.Fatalf("Peek(10) = %q, %v; want abcd", peekedBodies(all), err)
	}
	var ce *consumer.ConfigError
	if _, err := p.Peek(ctx, topic, 0); !errors.As(err, &ce) {
		t.Fatalf("Peek(0) = %v, want a *consumer.ConfigError", err)
	}
}

// peekedBodies is the messages' bodies, one after the other.
func peekedBodies(ms []consumer.Message) string {
	var s string
	for _, m := range ms {
		s += string(m.Body)
	}
	return s
}
