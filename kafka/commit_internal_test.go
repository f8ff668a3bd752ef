package kafka

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
)

// TestNoCommitOfOffsetsReadBeforeALoss: franz-go waits for a rejoin before
// it sends a commit, and then sends it under the new membership, which the
// broker accepts. A commit that read its offsets before franz-go reported
// the partitions lost must therefore not be sent at all: another member
// may own them and have committed further. (The fault test
// TestLostPartitionsCommitNothing freezes a real member past its session;
// this one puts the loss exactly between the read and the send.)
func TestNoCommitOfOffsetsReadBeforeALoss(t *testing.T) {
	seeds := testenv.RequireKafka(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	b, err := New(seeds, WithCommitInterval(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	topic := testenv.UniqueName(t, "read-then-lost")
	group := topic + "-group"
	if err := b.CreateTopic(ctx, topic, TopicConfig{Partitions: 1}); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = b.DeleteTopic(context.Background(), topic) }()
	const n = 5
	for i := 0; i < n; i++ {
		if err := b.Publish(ctx, topic, consumer.Message{Body: []byte("x")}); err != nil {
			t.Fatal(err)
		}
	}

	d := startGroupDriver(t, b, topic, group)
	defer d.Close()
	// Fetch and finish all n, as the loop would (a partition holds only
	// so many unfinished records).
	for done := 0; done < n; {
		got, err := d.Fetch(ctx, nil, n)
		if err != nil {
			t.Fatal(err)
		}
		acks := make([]driver.Settlement, len(got))
		for i, m := range got {
			acks[i] = driver.Settlement{Handle: m.Handle, Action: driver.Ack}
		}
		if err := d.Settle(ctx, acks); err != nil {
			t.Fatal(err)
		}
		done += len(got)
	}

	cl, err := d.client()
	if err != nil {
		t.Fatal(err)
	}
	d.afterCommitRead = func() { d.onLost(ctx, cl, map[string][]int32{topic: {0}}) }
	if err := d.commit(ctx, nil, false); !errors.Is(err, errPartitionsLost) {
		t.Errorf("commit = %v, want it refused with errPartitionsLost", err)
	}
	offs, err := b.Admin().FetchOffsets(ctx, group)
	if err != nil {
		t.Fatal(err)
	}
	if o, ok := offs.Lookup(topic, 0); ok && o.At >= 0 {
		t.Errorf("the group committed partition 0 at %d with offsets read before the partition was lost", o.At)
	}
}

// startGroupDriver starts a driver of topic in group, as a Loop would,
// and plays the loop's part of a revocation: letting go at once. The
// caller closes it.
func startGroupDriver(tb testing.TB, b *Broker, topic, group string) *kafkaDriver {
	tb.Helper()
	d, err := b.newDriver(topic, group)
	if err != nil {
		tb.Fatal(err)
	}
	go func() {
		for {
			select {
			case rev := <-d.Revoked():
				close(rev.Done)
			case <-d.stop:
				return
			}
		}
	}()
	return d
}
