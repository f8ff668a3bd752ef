package kafka

import (
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"
)

func fetched(p *partition, offs ...int64) {
	for _, o := range offs {
		p.add(&kgo.Record{Offset: o, LeaderEpoch: 3})
	}
}

// TestCommitPointNeverPassesAGap: records finished out of order (as under
// OrderByKey) move the commit point only over a finished prefix.
func TestCommitPointNeverPassesAGap(t *testing.T) {
	p := newPartition(0)
	fetched(p, 10, 11, 12, 13, 14)
	for _, step := range []struct {
		ack  int64
		want int64
	}{
		{12, -1}, // 10 and 11 still run
		{14, -1},
		{10, 11}, // 11 still runs: commit 11, the next record to read
		{11, 13}, // 10, 11, 12 done; 13 not
		{13, 15}, // all done
	} {
		if !p.ack(step.ack) {
			t.Fatalf("ack(%d) = false", step.ack)
		}
		if p.next != step.want {
			t.Fatalf("after ack(%d): commit point %d, want %d", step.ack, p.next, step.want)
		}
	}
	if p.outstanding != 0 || p.nextEpoch != 3 {
		t.Errorf("outstanding %d epoch %d, want 0 and 3", p.outstanding, p.nextEpoch)
	}
}

// TestCommitPointSkipsOffsetsNeverFetched: offsets need not be contiguous
// (compaction, transaction markers); only fetched records hold the point.
func TestCommitPointSkipsOffsetsNeverFetched(t *testing.T) {
	p := newPartition(1)
	fetched(p, 5, 9, 20)
	p.ack(9)
	if p.next != -1 {
		t.Fatalf("commit point %d with offset 5 unfinished", p.next)
	}
	p.ack(5)
	if p.next != 10 {
		t.Fatalf("commit point %d, want 10 (20 unfinished)", p.next)
	}
	p.ack(20)
	if p.next != 21 {
		t.Fatalf("commit point %d, want 21", p.next)
	}
}

// TestAckTwiceOrUnknownIsRefused: an offset acked twice, or never fetched
// under this assignment, changes nothing.
func TestAckTwiceOrUnknownIsRefused(t *testing.T) {
	p := newPartition(2)
	fetched(p, 1, 2)
	if !p.ack(2) || p.ack(2) || p.ack(7) {
		t.Fatal("ack accepted a finished or unknown offset")
	}
	if p.outstanding != 1 || p.next != -1 {
		t.Fatalf("outstanding %d, point %d; want 1 and -1", p.outstanding, p.next)
	}
}

// TestCommitPointOverManyRecords: a long run finished in reverse order
// commits nothing until the first finishes, then everything; the table
// compacts as it goes.
func TestCommitPointOverManyRecords(t *testing.T) {
	p := newPartition(3)
	const n = 5000
	for o := int64(0); o < n; o++ {
		fetched(p, o)
	}
	for o := int64(n - 1); o >= 1; o-- {
		p.ack(o)
	}
	if p.next != -1 {
		t.Fatalf("commit point %d before offset 0 finished", p.next)
	}
	p.ack(0)
	if p.next != n || len(p.ents) != 0 {
		t.Fatalf("commit point %d with %d entries kept, want %d and none", p.next, len(p.ents), n)
	}
	for o := int64(n); o < 3*n; o++ {
		fetched(p, o)
		p.ack(o)
		if p.next != o+1 {
			t.Fatalf("commit point %d, want %d", p.next, o+1)
		}
	}
}
