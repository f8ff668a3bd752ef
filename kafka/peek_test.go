package kafka_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
)

// Peek reads a topic from the log start, or from a group's committed
// offsets, without joining the group and without committing: the group's
// offsets are the same afterwards and no member ever joined it.
func TestPeekReadsWithoutJoiningOrCommitting(t *testing.T) {
	b := newBroker(t)
	topic := newTopic(t, b, "peek", 2)
	ctx := ctxFor(t, 60*time.Second)
	var msgs []consumer.Message
	for i, k := range []string{"a", "b", "c", "d", "e", "f"} {
		msgs = append(msgs, consumer.Message{ID: "id-" + k, Key: k, Body: []byte{byte('0' + i)}, Headers: map[string]string{"h": k}})
	}
	if err := b.Publish(ctx, topic, msgs...); err != nil {
		t.Fatal(err)
	}
	all, err := b.Peek(ctx, topic, "", 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != len(msgs) {
		t.Fatalf("Peek from the start read %d records, want %d", len(all), len(msgs))
	}
	for _, m := range all {
		if m.ID != "id-"+m.Key || m.Headers["h"] != m.Key || len(m.Headers) != 1 || m.Offset < 0 || m.Lane == "" {
			t.Errorf("peeked record %+v lost its id, header, lane or offset", m)
		}
	}

	group := topic + "-g"
	var off kadm.Offsets
	off.AddOffset(topic, 0, 1, -1)
	if _, err := b.Admin().CommitOffsets(ctx, group, off); err != nil {
		t.Fatal(err)
	}
	before := committed(t, b.Admin(), group, topic)
	rest, err := b.Peek(ctx, topic, group, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(rest) != len(msgs)-1 {
		t.Errorf("Peek from the group's offsets read %d records, want %d (one of partition 0 committed)", len(rest), len(msgs)-1)
	}
	one, err := b.Peek(ctx, topic, group, 1)
	if err != nil {
		t.Fatal(err)
	}
	if len(one) > 2 {
		t.Errorf("Peek with one per partition read %d records", len(one))
	}
	after := committed(t, b.Admin(), group, topic)
	if len(after) != len(before) || after[0] != before[0] {
		t.Errorf("the group's offsets moved: %v, then %v", before, after)
	}
	if _, ok := after[1]; ok {
		t.Errorf("Peek committed partition 1: %v", after)
	}
	groups, err := b.Admin().DescribeGroups(ctx, group)
	if err != nil {
		t.Fatal(err)
	}
	if g, ok := groups[group]; ok && len(g.Members) > 0 {
		t.Errorf("the group has members after Peek: %v", g.Members)
	}
}

// TestPeekFailsShortOfAnOpenTransaction: a partition Peek cannot read to
// the end offset it listed fails the call with ErrPeekShort, naming the
// partition and how far it got, instead of returning part of the topic.
// Records past an open transaction are such a case for a client that reads
// committed records only. On a compacted topic, whose last offsets may hold
// no record any more, what came is the answer. Once the transaction
// commits, the read goes to the end through its marker, which takes the
// last offset.
func TestPeekFailsShortOfAnOpenTransaction(t *testing.T) {
	for _, policy := range []string{"delete", "compact"} {
		t.Run(policy, func(t *testing.T) {
			b := newBroker(t)
			topic := testenv.UniqueName(t, "peek-txn")
			ctx := ctxFor(t, 60*time.Second)
			if err := b.CreateTopic(ctx, topic, kafka.TopicConfig{Configs: map[string]string{"cleanup.policy": policy}}); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = b.DeleteTopic(context.Background(), topic) })
			if err := b.Publish(ctx, topic, consumer.Message{Key: "a", Body: []byte("a")}, consumer.Message{Key: "b", Body: []byte("b")}); err != nil {
				t.Fatal(err)
			}
			txn, err := kgo.NewClient(kgo.SeedBrokers(testenv.KafkaBrokers()...), kgo.TransactionalID(topic+"-txn"), kgo.DefaultProduceTopic(topic))
			if err != nil {
				t.Fatal(err)
			}
			defer txn.Close()
			if err := txn.BeginTransaction(); err != nil {
				t.Fatal(err)
			}
			if err := txn.ProduceSync(ctx, &kgo.Record{Key: []byte("c"), Value: []byte("c")}).FirstErr(); err != nil {
				t.Fatal(err)
			}

			committedOnly := newBroker(t, kafka.WithClientOpts(kgo.FetchIsolationLevel(kgo.ReadCommitted())))
			got, err := committedOnly.Peek(ctx, topic, "", 0)
			if policy == "compact" {
				if err != nil || len(got) != 2 {
					t.Fatalf("Peek of a compacted topic past an open transaction = %d records, %v; want a and b", len(got), err)
				}
			} else if !errors.Is(err, kafka.ErrPeekShort) || !strings.Contains(err.Error(), "partition 0 at offset 2 of 3") {
				t.Fatalf("Peek past an open transaction = %d records, %v; want ErrPeekShort naming partition 0 at offset 2 of 3", len(got), err)
			}

			if err := txn.EndTransaction(ctx, kgo.TryCommit); err != nil {
				t.Fatal(err)
			}
			for _, br := range []*kafka.Broker{committedOnly, b} {
				got, err = br.Peek(ctx, topic, "", 0)
				if err != nil || len(got) != 3 || string(got[2].Body) != "c" {
					t.Fatalf("Peek after the commit = %d records, %v; want a, b and c", len(got), err)
				}
			}
		})
	}
}
