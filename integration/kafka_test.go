package integration_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/ferrytest"
	"github.com/ferrymq/ferry/internal/testenv"
)

// createTopic makes a topic of its own for t with the test kit, which
// deletes it when t ends.
func createTopic(t *testing.T, partitions int) string {
	t.Helper()
	return ferrytest.Open(t, ferrytest.Kafka).Queue(t, t.Name(), ferrytest.Partitions(partitions)).Name
}

func produce(t *testing.T, ctx context.Context, brokers []string, topic string, n int) {
	t.Helper()
	p, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.DefaultProduceTopic(topic),
		kgo.RequiredAcks(kgo.AllISRAcks()))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	recs := make([]*kgo.Record, n)
	for i := range recs {
		recs[i] = &kgo.Record{Key: []byte("k"), Value: []byte(fmt.Sprintf("v%d", i))}
	}
	if err := p.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		t.Fatalf("produce: %v", err)
	}
}

// consume polls a group member until it has n records.
func consume(t *testing.T, ctx context.Context, cl *kgo.Client, n int) []*kgo.Record {
	t.Helper()
	var got []*kgo.Record
	for len(got) < n {
		fs := cl.PollRecords(ctx, n-len(got))
		if ctx.Err() != nil {
			t.Fatalf("got %d of %d records before the deadline", len(got), n)
		}
		fs.EachError(func(topic string, p int32, err error) { t.Fatalf("fetch %s/%d: %v", topic, p, err) })
		got = append(got, fs.Records()...)
	}
	return got
}

// TestKafkaRoundTrip produces records with acks from all in-sync replicas and
// reads them back in order.
func TestKafkaRoundTrip(t *testing.T) {
	t.Parallel()
	brokers := testenv.RequireKafka(t)
	ctx := testenv.Context(t, 60*time.Second)
	topic := createTopic(t, 1)
	produce(t, ctx, brokers, topic, 3)

	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	for i, r := range consume(t, ctx, cl, 3) {
		if want := fmt.Sprintf("v%d", i); string(r.Value) != want || r.Offset != int64(i) {
			t.Errorf("record %d: value %q offset %d, want %q offset %d", i, r.Value, r.Offset, want, i)
		}
	}
}

// TestKafkaGroupCommitAndReread commits part of what a group member read,
// and checks that the next member of the same group starts right after the
// commit: committed records are not read again, uncommitted ones are.
func TestKafkaGroupCommitAndReread(t *testing.T) {
	t.Parallel()
	brokers := testenv.RequireKafka(t)
	ctx := testenv.Context(t, 90*time.Second)
	topic := createTopic(t, 1)
	group := testenv.UniqueName(t, "group")
	produce(t, ctx, brokers, topic, 10)

	member := func() *kgo.Client {
		cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumerGroup(group),
			kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
			kgo.DisableAutoCommit())
		if err != nil {
			t.Fatal(err)
		}
		return cl
	}

	first := member()
	recs := consume(t, ctx, first, 10)
	if err := first.CommitRecords(ctx, recs[:4]...); err != nil { // commits offset 4
		t.Fatalf("commit: %v", err)
	}
	first.LeaveGroup()
	first.Close()

	admCl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		t.Fatal(err)
	}
	defer admCl.Close()
	offs, err := kadm.NewClient(admCl).FetchOffsets(ctx, group)
	if err != nil {
		t.Fatalf("fetch offsets: %v", err)
	}
	if o, ok := offs.Lookup(topic, 0); !ok || o.At != 4 {
		t.Fatalf("committed offset of %s/0 = %+v (found %v), want 4", topic, o, ok)
	}

	second := member()
	defer second.Close()
	again := consume(t, ctx, second, 6)
	if again[0].Offset != 4 || string(again[0].Value) != "v4" {
		t.Fatalf("the next member started at offset %d (%q), want 4 (v4)", again[0].Offset, again[0].Value)
	}
	for i, r := range again {
		if r.Offset != int64(4+i) {
			t.Errorf("re-read record %d at offset %d, want %d", i, r.Offset, 4+i)
		}
	}
}
