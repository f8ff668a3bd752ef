package kafka_test

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
)

// TestNewRefusesWhatBreaksTheContract: franz-go options that would break
// Ferry's commits, groups or durability are refused at construction with a
// ConfigError naming the field.
func TestNewRefusesWhatBreaksTheContract(t *testing.T) {
	seeds := []string{"127.0.0.1:1"} // never dialled
	cases := map[string]kafka.Option{
		"group":            kafka.WithClientOpts(kgo.ConsumerGroup("other")),
		"topics":           kafka.WithClientOpts(kgo.ConsumeTopics("t")),
		"regex":            kafka.WithClientOpts(kgo.ConsumeRegex()),
		"autocommit marks": kafka.WithClientOpts(kgo.AutoCommitMarks()),
		"greedy":           kafka.WithClientOpts(kgo.GreedyAutoCommit()),
		"interval":         kafka.WithClientOpts(kgo.AutoCommitInterval(time.Second)),
		"block on poll":    kafka.WithClientOpts(kgo.BlockRebalanceOnPoll()),
		"revoked callback": kafka.WithClientOpts(kgo.OnPartitionsRevoked(func(context.Context, *kgo.Client, map[string][]int32) {})),
		"no idempotence":   kafka.WithClientOpts(kgo.DisableIdempotentWrite()),
		"leader acks":      kafka.WithClientOpts(kgo.RequiredAcks(kgo.LeaderAck()), kgo.DisableIdempotentWrite()),
		"transactional id": kafka.WithClientOpts(kgo.TransactionalID("tx")),
		"nil opt":          kafka.WithClientOpts(nil),
		"commit interval":  kafka.WithCommitInterval(0),
		"buffer":           kafka.WithPartitionBuffer(-1),
		"protocol":         kafka.WithGroupProtocol(kafka.GroupProtocol(9)),
		"client id":        kafka.WithClientID(""),
		"logger":           kafka.WithLogger(nil),
	}
	for name, opt := range cases {
		t.Run(name, func(t *testing.T) {
			b, err := kafka.New(seeds, opt)
			if err == nil {
				b.Close()
				t.Fatal("New accepted it")
			}
			var ce *consumer.ConfigError
			if !errors.As(err, &ce) || !errors.Is(err, consumer.ErrInvalidConfig) || ce.Field == "" {
				t.Fatalf("New = %v, want a *consumer.ConfigError naming the field", err)
			}
		})
	}
	if _, err := kafka.New(nil); !errors.Is(err, consumer.ErrInvalidConfig) {
		t.Errorf("New(nil) = %v, want a ConfigError", err)
	}
	// What users of franz-go set is passed through.
	b, err := kafka.New(seeds, kafka.WithClientOpts(kgo.FetchMaxBytes(1<<20), kgo.SessionTimeout(10*time.Second), kgo.ClientID("x")))
	if err != nil {
		t.Fatalf("New with fetch and session options: %v", err)
	}
	b.Close()
}

// javaMurmur2Partition is the Java client's partition for a keyed record,
// written from org.apache.kafka.common.utils.Utils.murmur2 and
// BuiltInPartitioner.partitionForKey.
func javaMurmur2Partition(key []byte, partitions int32) int32 {
	const (
		seed = uint32(0x9747b28c)
		m    = uint32(0x5bd1e995)
		r    = 24
	)
	n := len(key)
	h := seed ^ uint32(n)
	for i := 0; i+4 <= n; i += 4 {
		k := uint32(key[i]) | uint32(key[i+1])<<8 | uint32(key[i+2])<<16 | uint32(key[i+3])<<24
		k *= m
		k ^= k >> r
		k *= m
		h *= m
		h ^= k
	}
	tail := n &^ 3
	switch n % 4 {
	case 3:
		h ^= uint32(key[tail+2]) << 16
		fallthrough
	case 2:
		h ^= uint32(key[tail+1]) << 8
		fallthrough
	case 1:
		h ^= uint32(key[tail])
		h *= m
	}
	h ^= h >> 13
	h *= m
	h ^= h >> 15
	return int32(h&0x7fffffff) % partitions
}

// TestPublishPartitionsLikeJava: a keyed record lands on the partition the
// Java client's murmur2 picks for its key.
func TestPublishPartitionsLikeJava(t *testing.T) {
	b := newBroker(t)
	topic := newTopic(t, b, "murmur", 7)
	var msgs []consumer.Message
	for i := 0; i < 200; i++ {
		msgs = append(msgs, consumer.Message{Key: "order-" + strconv.Itoa(i*7919), Body: []byte(strconv.Itoa(i))})
	}
	if err := b.Publish(testenv.Context(t, 30*time.Second), topic, msgs...); err != nil {
		t.Fatal(err)
	}
	for _, r := range consumeRaw(t, topic, len(msgs)) {
		if want := javaMurmur2Partition(r.Key, 7); r.Partition != want {
			t.Errorf("key %q landed on partition %d; the Java client puts it on %d", r.Key, r.Partition, want)
		}
	}
}

// TestPublishKeepsKeyOrderAcrossCalls: records of one key, published from
// several calls one after another, are stored in the order given.
func TestPublishKeepsKeyOrderAcrossCalls(t *testing.T) {
	b := newBroker(t)
	topic := newTopic(t, b, "order", 3)
	const calls, per = 20, 50
	ctx := testenv.Context(t, 60*time.Second)
	for c := 0; c < calls; c++ {
		var msgs []consumer.Message
		for i := 0; i < per; i++ {
			seq := c*per + i
			msgs = append(msgs, consumer.Message{Key: "k" + strconv.Itoa(seq%5), Body: []byte(strconv.Itoa(seq))})
		}
		if err := b.Publish(ctx, topic, msgs...); err != nil {
			t.Fatal(err)
		}
	}
	last := map[string]int{}
	for _, r := range consumeRaw(t, topic, calls*per) {
		seq, _ := strconv.Atoi(string(r.Value))
		if prev, ok := last[string(r.Key)]; ok && seq < prev {
			t.Fatalf("key %s: %d stored after %d", r.Key, seq, prev)
		}
		last[string(r.Key)] = seq
	}
}

// TestPublishReportsFailedRecords: a record the cluster cannot take fails
// alone (with every later record of its key in the call), by index, in a
// *consumer.PublishError; the others are published.
func TestPublishReportsFailedRecords(t *testing.T) {
	b := newBroker(t)
	topic := newTopic(t, b, "fail", 1)
	big := make([]byte, 2<<20)
	err := b.Publish(testenv.Context(t, 30*time.Second), topic,
		consumer.Message{Key: "a", Body: []byte("a1")},
		consumer.Message{Key: "b", Body: big},
		consumer.Message{Key: "a", Body: []byte("a2")},
		consumer.Message{Key: "b", Body: []byte("b2")},
	)
	var pe *consumer.PublishError
	if !errors.As(err, &pe) {
		t.Fatalf("Publish = %v, want a *consumer.PublishError", err)
	}
	if len(pe.Failed) != 2 || pe.Failed[0].Index != 1 || pe.Failed[1].Index != 3 {
		t.Fatalf("failed %+v, want indexes 1 and 3", pe.Failed)
	}
	if !errors.Is(err, kerr.MessageTooLarge) {
		t.Errorf("error %v does not match kerr.MessageTooLarge", err)
	}
	recs := consumeRaw(t, topic, 2)
	if string(recs[0].Value) != "a1" || string(recs[1].Value) != "a2" {
		t.Errorf("stored %q, %q; want a1, a2", recs[0].Value, recs[1].Value)
	}

}

// TestLagMatchesKadm: the consumer's lag per partition is what kadm
// reports for the group, and grows with what is published while it is
// stopped.
func TestLagMatchesKadm(t *testing.T) {
	b := newBroker(t)
	topic := newTopic(t, b, "lag", 3)
	group := "lag-" + topic
	publishKeyed(t, b, topic, 0, 90, 9)
	var mu sync.Mutex
	n := 0
	c, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group))
	if err != nil {
		t.Fatal(err)
	}
	r := runConsumer(t, c, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		n++
		mu.Unlock()
		return nil
	}))
	testenv.WaitFor(t, 60*time.Second, "90 records handled", func() bool { mu.Lock(); defer mu.Unlock(); return n == 90 })
	publishKeyed(t, b, topic, 90, 30, 9)
	time.Sleep(100 * time.Millisecond)
	r.stop(t) // commits what it handled
	publishKeyed(t, b, topic, 120, 60, 9)

	d, err := b.Driver(t.Context(), topic, driver.Config{Name: group})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	lag, err := d.(interface {
		Lag(context.Context) (consumer.Lag, error)
	}).Lag(testenv.Context(t, 10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	kl, err := b.Admin().Lag(testenv.Context(t, 10*time.Second), group)
	if err != nil {
		t.Fatal(err)
	}
	var total int64
	for _, l := range kl[group].Lag[topic] {
		if got := lag.Lanes[strconv.Itoa(int(l.Partition))]; got != l.Lag {
			t.Errorf("partition %d: lag %d, kadm says %d", l.Partition, got, l.Lag)
		}
		if got, ok := lag.Positions[strconv.Itoa(int(l.Partition))]; ok != (l.Commit.At >= 0) || (ok && got != l.Commit.At) {
			t.Errorf("partition %d: position %d (reported %v), the group committed %d", l.Partition, got, ok, l.Commit.At)
		}
		total += l.Lag
	}
	if sys := d.Capabilities().System; sys != "kafka" {
		t.Errorf("Capabilities().System = %q, want kafka", sys)
	}
	if lag.Messages != total || total < 60 {
		t.Errorf("lag %d, kadm total %d; want equal and at least the 60 published while stopped", lag.Messages, total)
	}
}

// TestConsumedIDIsNotAHeader: a record's HeaderMessageID becomes the
// message's ID and is not among its Headers (as no other broker's message
// id is); the other headers come as produced, a record with none has nil
// Headers, and one without the id header gets topic/partition/offset.
func TestConsumedIDIsNotAHeader(t *testing.T) {
	b := newBroker(t)
	topic := newTopic(t, b, "headers", 1)
	ctx := testenv.Context(t, 60*time.Second)
	if err := b.Publish(ctx, topic,
		consumer.Message{ID: "with-headers", Body: []byte("0"), Headers: map[string]string{"h": "v", "e": ""}},
		consumer.Message{ID: "id-only", Body: []byte("1")},
	); err != nil {
		t.Fatal(err)
	}
	produceRaw(t,
		&kgo.Record{Topic: topic, Value: []byte("2")},
		// A producer that wrote the id header twice: the last one counts.
		&kgo.Record{Topic: topic, Value: []byte("3"), Headers: []kgo.RecordHeader{
			{Key: kafka.HeaderMessageID, Value: []byte("first")}, {Key: "x", Value: []byte("y")}, {Key: kafka.HeaderMessageID, Value: []byte("last")}}},
	)
	var mu sync.Mutex
	got := map[string]consumer.Message{}
	c, err := b.NewConsumer(ctx, topic, consumer.WithName(topic+"-g"))
	if err != nil {
		t.Fatal(err)
	}
	r := runConsumer(t, c, consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
		mu.Lock()
		got[string(m.Body)] = *m
		mu.Unlock()
		return nil
	}))
	testenv.WaitFor(t, 30*time.Second, "the four records", func() bool { mu.Lock(); defer mu.Unlock(); return len(got) == 4 })
	r.stop(t)

	check := func(body, id string, headers map[string]string) {
		t.Helper()
		m := got[body]
		if m.ID != id || len(m.Headers) != len(headers) || (headers == nil) != (m.Headers == nil) {
			t.Errorf("record %s: ID %q, Headers %v; want ID %q, Headers %v", body, m.ID, m.Headers, id, headers)
			return
		}
		for k, v := range headers {
			if w, ok := m.Headers[k]; !ok || w != v {
				t.Errorf("record %s: Headers %v, want %v", body, m.Headers, headers)
			}
		}
	}
	check("0", "with-headers", map[string]string{"h": "v", "e": ""})
	check("1", "id-only", nil)
	check("2", topic+"/0/2", nil)
	check("3", "last", map[string]string{"x": "y"})
}
