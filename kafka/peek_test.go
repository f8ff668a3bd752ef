package kafka_test

import (
	"context"
	"errors"
	"strings"
	"sync"
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
	ctx := testenv.Context(t, 60*time.Second)
	var msgs []consumer.Message
	for i, k := range []string{"a", "b", "c", "d", "e", "f"} {
		msgs = append(msgs, consumer.Message{ID: "id-" + k, Key: k, Body: []byte{byte('0' + i)}, Headers: map[string]string{"h": k}})
	}
	if err := b.Publish(ctx, topic, msgs...); err != nil {
		t.Fatal(err)
	}
	all, err := b.PeekGroup(ctx, topic, "", 0)
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
	rest, err := b.PeekGroup(ctx, topic, group, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(rest) != len(msgs)-1 {
		t.Errorf("Peek from the group's offsets read %d records, want %d (one of partition 0 committed)", len(rest), len(msgs)-1)
	}
	one, err := b.PeekGroup(ctx, topic, group, 1)
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
// partition and how far it got, instead of returning part of the topic,
// even while another partition keeps bringing records. Records past an
// open transaction are such a case for a client that reads committed
// records only. On a compacted topic, whose last offsets may hold no record
// any more, what came is the answer. Once the transaction commits, the
// read goes to the end through its marker, which takes the last offset.
func TestPeekFailsShortOfAnOpenTransaction(t *testing.T) {
	for _, policy := range []string{"delete", "compact"} {
		t.Run(policy, func(t *testing.T) {
			b := newBroker(t)
			topic := testenv.UniqueName(t, "peek-txn")
			ctx := testenv.Context(t, 60*time.Second)
			if err := b.CreateTopic(ctx, topic, kafka.TopicConfig{Partitions: 2, Configs: map[string]string{"cleanup.policy": policy}}); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = b.DeleteTopic(context.Background(), topic) })
			produceRaw(t, &kgo.Record{Topic: topic, Partition: 0, Key: []byte("a"), Value: []byte("a")},
				&kgo.Record{Topic: topic, Partition: 0, Key: []byte("b"), Value: []byte("b")})
			txn, err := kgo.NewClient(kgo.SeedBrokers(testenv.KafkaBrokers()...), kgo.TransactionalID(topic+"-txn"),
				kgo.RecordPartitioner(kgo.ManualPartitioner()))
			if err != nil {
				t.Fatal(err)
			}
			defer txn.Close()
			if err := txn.BeginTransaction(); err != nil {
				t.Fatal(err)
			}
			if err := txn.ProduceSync(ctx, &kgo.Record{Topic: topic, Partition: 1, Key: []byte("c"), Value: []byte("c")}).FirstErr(); err != nil {
				t.Fatal(err)
			}

			// Partition 0 keeps getting records (past the end Peek lists)
			// while partition 1 stands still.
			busy, stopBusy := context.WithCancel(ctx)
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				for busy.Err() == nil {
					if err := b.Publish(busy, topic, consumer.Message{Key: "a", Body: []byte("later")}); err != nil && busy.Err() == nil {
						t.Errorf("publish: %v", err)
						return
					}
					time.Sleep(100 * time.Millisecond)
				}
			}()
			committedOnly := newBroker(t, kafka.WithClientOpts(kgo.FetchIsolationLevel(kgo.ReadCommitted())))
			got, err := committedOnly.PeekGroup(ctx, topic, "", 0)
			stopBusy()
			wg.Wait()
			if policy == "compact" {
				// a, b, and any later record that came before Peek listed
				// the end offsets: partition 0's, none of partition 1.
				if err != nil || len(got) < 2 || string(got[0].Body) != "a" || string(got[1].Body) != "b" || got[len(got)-1].Lane != "0" {
					t.Fatalf("Peek of a compacted topic past an open transaction = %v, %v; want a, b (and later ones) of partition 0", got, err)
				}
			} else if !errors.Is(err, kafka.ErrPeekShort) || !strings.Contains(err.Error(), "partition 1 at offset 0, end 1;") {
				t.Fatalf("Peek past an open transaction = %d records, %v; want ErrPeekShort naming partition 1 at offset 0, end 1", len(got), err)
			}

			if err := txn.EndTransaction(ctx, kgo.TryCommit); err != nil {
				t.Fatal(err)
			}
			for _, br := range []*kafka.Broker{committedOnly, b} {
				got, err = br.PeekGroup(ctx, topic, "", 0)
				if err != nil || len(got) < 3 || string(got[len(got)-1].Body) != "c" || got[len(got)-1].Lane != "1" {
					t.Fatalf("Peek after the commit = %d records, %v; want a, b, the later ones and c", len(got), err)
				}
			}
		})
	}
}

// TestPeekCountsMessagesNotMarkers: perPartition counts messages, not the
// offsets transaction markers take, so a group committed at a marker still
// gets the record after it; and a client option that makes a fetch wait
// for more bytes than there are (as long as Peek waits for a partition to
// move) does not make Peek's read stop short.
func TestPeekCountsMessagesNotMarkers(t *testing.T) {
	b := newBroker(t, kafka.WithClientOpts(kgo.FetchMinBytes(1<<20)))
	topic := newTopic(t, b, "peek-markers", 1)
	ctx := testenv.Context(t, 60*time.Second)
	txn, err := kgo.NewClient(kgo.SeedBrokers(testenv.KafkaBrokers()...), kgo.TransactionalID(topic+"-txn"), kgo.DefaultProduceTopic(topic))
	if err != nil {
		t.Fatal(err)
	}
	defer txn.Close()
	for _, v := range []string{"a", "b"} { // a at 0, its marker at 1, b at 2, its marker at 3
		if err := txn.BeginTransaction(); err != nil {
			t.Fatal(err)
		}
		if err := txn.ProduceSync(ctx, &kgo.Record{Value: []byte(v)}).FirstErr(); err != nil {
			t.Fatal(err)
		}
		if err := txn.EndTransaction(ctx, kgo.TryCommit); err != nil {
			t.Fatal(err)
		}
	}
	group := topic + "-g"
	var off kadm.Offsets
	off.AddOffset(topic, 0, 1, -1) // a handled: committed at its marker
	if _, err := b.Admin().CommitOffsets(ctx, group, off); err != nil {
		t.Fatal(err)
	}
	got, err := b.PeekGroup(ctx, topic, group, 1)
	if err != nil || len(got) != 1 || string(got[0].Body) != "b" || got[0].Offset != 2 {
		t.Fatalf("Peek of one message past the group's offset = %v, %v; want b at offset 2", got, err)
	}
	all, err := b.PeekGroup(ctx, topic, "", 0)
	if err != nil || len(all) != 2 {
		t.Fatalf("Peek of the whole topic = %d messages, %v; want a and b", len(all), err)
	}
}
