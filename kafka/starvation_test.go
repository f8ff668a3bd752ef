package kafka_test

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
)

// TestSlowPartitionDoesNotStarveOthers: partition 0 is slow but makes
// progress (100 ms a record, well under StuckAfter). Fetch stops polling
// while two fetch batches of its records wait in its stash, and franz-go's
// buffered fetch holds hundreds more of them: unless the slow partition is
// paused, records published to partition 1 afterwards wait behind them
// (found by review of the change that stopped pausing partitions that make
// progress).
func TestSlowPartitionDoesNotStarveOthers(t *testing.T) {
	b := newBroker(t)
	topic := newTopic(t, b, "review-slow", 2)
	var recs []*kgo.Record
	for i := 0; i < 1000; i++ {
		recs = append(recs, &kgo.Record{Topic: topic, Partition: 0, Value: []byte(strconv.Itoa(i))})
	}
	produceRaw(t, recs...)
	c, err := b.NewConsumer(t.Context(), topic, consumer.WithName("review-slow-"+topic))
	if err != nil {
		t.Fatal(err)
	}
	var p0, p1 atomic.Int64
	var mu sync.Mutex
	var last time.Time
	runConsumer(t, c, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if m.Lane == "0" {
			time.Sleep(100 * time.Millisecond)
			p0.Add(1)
			return nil
		}
		p1.Add(1)
		mu.Lock()
		last = time.Now()
		mu.Unlock()
		return nil
	}))
	testenv.WaitFor(t, 30*time.Second, "partition 0 to make progress", func() bool { return p0.Load() >= 5 })
	var more []*kgo.Record
	for i := 0; i < 20; i++ {
		more = append(more, &kgo.Record{Topic: topic, Partition: 1, Value: []byte(strconv.Itoa(i))})
	}
	start := time.Now()
	produceRaw(t, more...)
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) && p1.Load() < 20 {
		time.Sleep(20 * time.Millisecond)
	}
	if n := p1.Load(); n < 20 {
		t.Fatalf("partition 1: %d of 20 records handled in 15s while partition 0 progressed slowly (%d handled): a slow partition starves the others", n, p0.Load())
	}
	mu.Lock()
	t.Logf("partition 1 done %s after publish; partition 0 handled %d", last.Sub(start), p0.Load())
	mu.Unlock()
}
