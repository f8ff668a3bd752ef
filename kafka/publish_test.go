package kafka_test

import (
	"context"
	"crypto/rand"
	"errors"
	"strconv"
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
