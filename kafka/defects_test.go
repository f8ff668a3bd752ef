package kafka_test

// Regression tests for five defects an independent review found in the
// adapter (at-most-once commit timing, one stuck partition stalling the
// member, per-key order of Publish around the batch limit, and two franz-go
// options that broke Publish). Each failed before its fix. The comments
// are the review's; their file:line references are to the code it
// reviewed (commit 12244bc).

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
)

// TestPublishRecordJustUnderBatchLimitKeepsKeyOrder: Publish promises
// (broker.go:483-487) that a record refused before it was sent fails every
// later record of its key in the call, so that a caller who retries what
// failed never puts a key's records out of order. The refusal is decided by
// recordSize (broker.go:613-619), which counts a record as key+value+21
// bytes, while franz-go refuses a record whose batch (a 61-byte v2 batch
// header plus the record's varint-framed encoding, about key+value+72 bytes)
// exceeds ProducerBatchMaxBytes (kgo sink.go tryBuffer). A record in
// between (here a 999,990-byte value under the default 1,000,012-byte
// limit) passes the check at broker.go:541, is refused by franz-go through
// its promise, and its key is never marked dead (broker.go:544-549): the
// next record of the same key in the call is sent and stored. The caller
// sees index 0 failed and index 1 published, and a retry of index 0 lands
// after index 1.
func TestPublishRecordJustUnderBatchLimitKeepsKeyOrder(t *testing.T) {
	b := newBroker(t)
	topic := newTopic(t, b, "defect-bigrec", 1)
	big := make([]byte, 999_990)
	err := b.Publish(testenv.Context(t, 60*time.Second), topic,
		consumer.Message{Key: "k", Body: big},
		consumer.Message{Key: "k", Body: []byte("after-big")},
		consumer.Message{Key: "other", Body: []byte("other")},
	)
	var pe *consumer.PublishError
	if !errors.As(err, &pe) {
		t.Fatalf("Publish = %v, want a *consumer.PublishError for the too-large record", err)
	}
	if !errors.Is(err, kerr.MessageTooLarge) {
		t.Errorf("error %v does not match kerr.MessageTooLarge", err)
	}
	idx := map[int]bool{}
	for _, f := range pe.Failed {
		idx[f.Index] = true
	}
	if !idx[0] || !idx[1] || idx[2] || len(pe.Failed) != 2 {
		t.Errorf("failed indexes %v; want 0 (too large) and 1 (a later record of its key, not sent), and 2 published", pe.Failed)
	}
	for _, r := range consumeRaw(t, topic, 3-len(pe.Failed)) {
		if string(r.Key) == "k" {
			t.Errorf("record %q of key k was stored although an earlier record of key k in the same call failed: a retry of index 0 now lands after it", r.Value)
		}
	}
}

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

// TestPublishClusterRefusalFailsLaterRecordsOfItsKey: a record the cluster
// refuses after it was sent (here larger than the topic's
// max.message.bytes, which the producer cannot know) fails the later
// records of its key in the call too, unsent.
func TestPublishClusterRefusalFailsLaterRecordsOfItsKey(t *testing.T) {
	b := newBroker(t)
	topic := testenv.UniqueName(t, "defect-topiclimit")
	if err := b.CreateTopic(testenv.Context(t, 30*time.Second), topic, kafka.TopicConfig{Partitions: 2, Configs: map[string]string{"max.message.bytes": "2048"}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.DeleteTopic(context.Background(), topic) })
	big := make([]byte, 8000)
	_, _ = rand.Read(big) // incompressible: the batch stays above the limit
	// Many later records of the key, so that some travel in batches of
	// their own unless the call waits for the first one's answer.
	// A good record first, of a key on the other partition (a refused
	// batch fails every record in it): the refused record is reported at
	// its own index, and the good one not at all.
	part := kgo.StickyKeyPartitioner(nil).ForTopic(topic) // murmur2, as Publish and Java
	good := "good"
	for i := 0; part.Partition(&kgo.Record{Key: []byte(good)}, 2) == part.Partition(&kgo.Record{Key: []byte("k")}, 2); i++ {
		good = "good-" + strconv.Itoa(i)
	}
	msgs := []consumer.Message{{Key: good, Body: []byte("good")}, {Key: "k", Body: big}}
	for i := 0; i < 200; i++ {
		msgs = append(msgs, consumer.Message{Key: "k", Body: []byte("after-big-" + strconv.Itoa(i))})
	}
	err := b.Publish(testenv.Context(t, 60*time.Second), topic, msgs...)
	var pe *consumer.PublishError
	if !errors.As(err, &pe) {
		t.Fatalf("Publish = %v, want a *consumer.PublishError", err)
	}
	if len(pe.Failed) != len(msgs)-1 {
		t.Errorf("%d of %d records failed; want all but the first: the big one refused by the cluster, the others later records of its key", len(pe.Failed), len(msgs))
	}
	if len(pe.Failed) > 0 && (pe.Failed[0].Index != 1 || !errors.Is(pe.Failed[0].Err, kerr.MessageTooLarge)) {
		t.Errorf("first failure: index %d, %v; want index 1 refused by the cluster (kerr.MessageTooLarge)", pe.Failed[0].Index, pe.Failed[0].Err)
	}
	if err := b.Publish(testenv.Context(t, 30*time.Second), topic, consumer.Message{Key: "end"}); err != nil {
		t.Fatal(err)
	}
	stored, goodStored := 0, 0
	for _, r := range consumeRaw(t, topic, len(msgs)+1-len(pe.Failed)) {
		switch string(r.Key) {
		case "k":
			stored++
		case good:
			goodStored++
		}
	}
	if goodStored != 1 {
		t.Errorf("the good record of the call was stored %d times, want once", goodStored)
	}
	if stored > 0 {
		t.Errorf("%d records of key k were stored although an earlier record of key k in the same call failed", stored)
	}
}
