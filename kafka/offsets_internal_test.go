package kafka

import (
	"log/slog"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

func fetched(p *partition, offs ...int64) {
	for _, o := range offs {
		p.add(&kgo.Record{Offset: o, LeaderEpoch: 3})
	}
}

// ack finishes p's record at off, as Settle does through its handle, and
// moves the commit point; false for an offset p does not hold unfinished.
func ack(p *partition, off int64) bool {
	for i := p.head; i < len(p.ents); i++ {
		if p.ents[i].off == off {
			ok := p.finish(p.base + int64(i))
			p.advance()
			return ok
		}
	}
	return false
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
		if !ack(p, step.ack) {
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
	ack(p, 9)
	if p.next != -1 {
		t.Fatalf("commit point %d with offset 5 unfinished", p.next)
	}
	ack(p, 5)
	if p.next != 10 {
		t.Fatalf("commit point %d, want 10 (20 unfinished)", p.next)
	}
	ack(p, 20)
	if p.next != 21 {
		t.Fatalf("commit point %d, want 21", p.next)
	}
}

// TestAckTwiceOrUnknownIsRefused: an offset acked twice, or never fetched
// under this assignment, changes nothing.
func TestAckTwiceOrUnknownIsRefused(t *testing.T) {
	p := newPartition(2)
	fetched(p, 1, 2)
	if !ack(p, 2) || ack(p, 2) || ack(p, 7) {
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
		ack(p, o)
	}
	if p.next != -1 {
		t.Fatalf("commit point %d before offset 0 finished", p.next)
	}
	ack(p, 0)
	if p.next != n || len(p.ents) != 0 {
		t.Fatalf("commit point %d with %d entries kept, want %d and none", p.next, len(p.ents), n)
	}
	for o := int64(n); o < 3*n; o++ {
		fetched(p, o)
		ack(p, o)
		if p.next != o+1 {
			t.Fatalf("commit point %d, want %d", p.next, o+1)
		}
	}
}

// TestRecordSizeCountsAsFranzGo: a record is counted as franz-go counts a
// batch holding it alone (61-byte batch header, varint-framed record), so
// that one franz-go would refuse is refused before anything is sent. The
// review's case: a 999,990-byte value under the default 1,000,012-byte
// batch limit, which the old estimate (key+value+21) let through.
func TestRecordSizeCountsAsFranzGo(t *testing.T) {
	r := &kgo.Record{Key: []byte("k"), Value: make([]byte, 999_990)}
	// attributes, ts delta, offset delta: 3; key: 1+1; value: 3+999,990;
	// headers count: 1 -> 999,999, framed with a 3-byte varint, +61.
	if got, min := recordSize(r), 61+3+999_999; got < min {
		t.Errorf("recordSize = %d, want at least %d (franz-go's count)", got, min)
	}
	if recordSize(r) <= 1_000_012 {
		t.Errorf("recordSize = %d: passes the default batch limit franz-go refuses it for", recordSize(r))
	}
}

// TestStashKeepsAPartitionToItsShare: records polled beyond a partition's
// limit wait, in order, and go out only as its records finish.
func TestStashKeepsAPartitionToItsShare(t *testing.T) {
	b := &Broker{log: slog.New(slog.DiscardHandler)}
	d := &kafkaDriver{membership: membership{b: b, topic: "t", log: b.log}, parts: map[int32]*partition{0: newPartition(0)}}
	p := d.parts[0]
	fetched(p, 0, 1)
	for o := int64(2); o < 6; o++ {
		p.stash = append(p.stash, &kgo.Record{Topic: "t", Offset: o})
	}
	if got := d.drainStashes(nil, 10, 2); len(got) != 0 {
		t.Fatalf("drained %d records of a partition at its limit", len(got))
	}
	ack(p, 0)
	got := d.drainStashes(nil, 10, 2)
	if len(got) != 1 || got[0].Offset != 2 {
		t.Fatalf("after one finished: drained %v, want offset 2 only", got)
	}
	// A fetch batch of 1: the 3 waiting are more than two batches, so
	// Fetch stops polling; the partition progresses, so it is not paused
	// (a resume can wait for a fetch in flight).
	d.maxAsked = 1
	d.adjustPauses(nil, 2, false)
	if p.paused {
		t.Error("a partition that makes progress was paused for its full stash")
	}
	if w := d.waitingUnpaused(); w < 2*d.maxAsked {
		t.Errorf("waitingUnpaused = %d with 3 records stashed: Fetch would poll for more", w)
	}
	p.progress = time.Now().Add(-2 * StuckAfter).UnixNano()
	d.adjustPauses(nil, 2, false)
	if !p.paused {
		t.Error("a partition at its limit with no progress for StuckAfter is not paused")
	}
	if w := d.waitingUnpaused(); w != 0 {
		t.Errorf("waitingUnpaused = %d: a paused partition's stash keeps Fetch from polling the others", w)
	}
	ack(p, 1)
	ack(p, 2)
	got = d.drainStashes(nil, 10, 2)
	if len(got) != 2 || got[0].Offset != 3 || got[1].Offset != 4 {
		t.Fatalf("drained %v, want offsets 3 and 4", got)
	}
}

// TestIdlePartitionHandedAFullShareIsNotPaused: a partition whose records
// all finished long ago (it waited for a fetch since) and that is now
// handed its whole share at once is busy, not stuck: it is not paused. It
// was, when the time without progress counted from its last finished
// record: each such pause cost a fetch round trip (FetchMaxWait), which
// made an unordered consumer 5 times slower than an ordered one.
func TestIdlePartitionHandedAFullShareIsNotPaused(t *testing.T) {
	b := &Broker{log: slog.New(slog.DiscardHandler)}
	d := &kafkaDriver{membership: membership{b: b, topic: "t", log: b.log}, parts: map[int32]*partition{0: newPartition(0)}}
	p := d.parts[0]
	fetched(p, 0)
	ack(p, 0)
	p.progress = time.Now().Add(-2 * StuckAfter).UnixNano() // the last record finished long ago
	fetched(p, 1, 2)
	d.adjustPauses(nil, 2, false)
	if p.paused {
		t.Error("a partition just handed its share after an idle spell was paused as stuck")
	}
	// Still stuck once it holds them StuckAfter with none finished.
	p.progress = time.Now().Add(-2 * StuckAfter).UnixNano()
	d.adjustPauses(nil, 2, false)
	if !p.paused {
		t.Error("a partition at its limit with no progress for StuckAfter is not paused")
	}
}
