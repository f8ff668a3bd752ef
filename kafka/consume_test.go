package kafka_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
)

// TestAtMostOnceCommitsBeforeTheHandlerRuns: in at-most-once mode the
// loop has the record acked, waits for Settle to return, and only then runs
// the handler (consumer/workers.go:51-67), so that "a crash then loses the
// message instead of running it twice" (consumer/doc.go:79-82; kafka's own
// doc.go:14-15 says the record is committed "before it ran"). But the Kafka
// driver's Settle (driver.go:267-299) only marks the record finished in
// memory; the offset is committed by commitLoop up to WithCommitInterval
// later (driver.go:428-450). The handler therefore runs while the group's
// committed offset is still before the record: a crash (SIGKILL, OOM) in
// that window, which with the default 1 s interval is the whole of most
// handlers' runs, delivers the record again to the next owner: a duplicate
// in the mode whose one promise is never to duplicate.
func TestAtMostOnceCommitsBeforeTheHandlerRuns(t *testing.T) {
	b := newBroker(t)
	topic := newTopic(t, b, "defect-amo", 1)
	group := "defect-amo-" + topic
	var msgs []consumer.Message
	for i := 0; i < 3; i++ {
		msgs = append(msgs, consumer.Message{Key: "k", Body: []byte(strconv.Itoa(i))})
	}
	if err := b.Publish(testenv.Context(t, 30*time.Second), topic, msgs...); err != nil {
		t.Fatal(err)
	}
	c, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group), consumer.WithDeliveryMode(consumer.AtMostOnce))
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu     sync.Mutex
		ran    int
		before []string
	)
	r := runConsumer(t, c, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		// What the coordinator holds as the handler starts: what a
		// member taking over after a crash right now would start from.
		at := int64(-1)
		if got, ok := committed(t, b.Admin(), group, topic)[0]; ok {
			at = got
		}
		mu.Lock()
		defer mu.Unlock()
		ran++
		if at <= m.Offset {
			before = append(before, fmt.Sprintf("offset %d ran with the group's committed offset at %d", m.Offset, at))
		}
		return nil
	}))
	testenv.WaitFor(t, 30*time.Second, "3 records handled", func() bool { mu.Lock(); defer mu.Unlock(); return ran == 3 })
	r.stop(t)
	if len(before) > 0 {
		t.Errorf("at-most-once ran handlers before their record was committed (a crash now would run them again): %v", before)
	}
}

// TestOneStuckPartitionDoesNotStallTheOthers: a record that keeps
// failing is retried in place and holds its partition (DESIGN: "Kafka holds
// its partition"); the package doc (doc.go:47-50) promises that "one stuck
// partition does not fill the loop": a partition with WithPartitionBuffer
// records fetched and unfinished is paused (driver.go:215-221). But the
// buffer defaults to 1000 (DefaultPartitionBuffer, broker.go:72) while the
// loop holds at most 4 x Concurrency = 32 records by default
// (consumer/options.go:256-258), so with the defaults the pause never
// happens. Nor does a smaller buffer help (checked with
// WithPartitionBuffer(16): same result): Fetch adds every polled record
// and pauses only afterwards (driver.go:208-221), and one poll takes up to
// the loop's fetch batch, min(MaxInFlight, 256) = all 32 places, from one
// partition. The stuck partition's later records fill the loop, the
// fetcher waits for room that never comes (consumer/workers.go:113-121),
// and every other partition of the member stops for as long as the one
// record fails (for ever without a dead-letter stage, for the whole retry
// budget with one). Here partition 0's first record fails; records
// published to partition 1 afterwards are never handled.
func TestOneStuckPartitionDoesNotStallTheOthers(t *testing.T) {
	b := newBroker(t)
	topic := newTopic(t, b, "defect-stuck", 2)
	var recs []*kgo.Record
	for i := 0; i < 100; i++ {
		recs = append(recs, &kgo.Record{Topic: topic, Partition: 0, Value: []byte(strconv.Itoa(i))})
	}
	produceRaw(t, recs...)
	c, err := b.NewConsumer(t.Context(), topic, consumer.WithName("defect-stuck-"+topic))
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu       sync.Mutex
		failures int
		p1       int
	)
	runConsumer(t, c, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		defer mu.Unlock()
		switch {
		case m.Lane == "0" && m.Offset == 0:
			failures++
			return errors.New("dependency of partition 0's first record is down")
		case m.Lane == "1":
			p1++
		}
		return nil
	}))
	testenv.WaitFor(t, 30*time.Second, "partition 0's first record to fail a few times", func() bool { mu.Lock(); defer mu.Unlock(); return failures >= 3 })
	var more []*kgo.Record
	for i := 0; i < 20; i++ {
		more = append(more, &kgo.Record{Topic: topic, Partition: 1, Value: []byte(strconv.Itoa(i))})
	}
	produceRaw(t, more...)
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		mu.Lock()
		n := p1
		mu.Unlock()
		if n == 20 {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	mu.Lock()
	defer mu.Unlock()
	t.Errorf("partition 1: %d of 20 records handled in 20s while partition 0 held one failing record (%d failures): one stuck partition stalls the member", p1, failures)
}
