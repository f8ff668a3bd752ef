package kafka

import (
	"context"
	"log/slog"
	"strconv"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

// partition tracks the records of one partition fetched under one
// assignment: which are finished, and so which offset may be committed.
// Records arrive in offset order (a partition is fetched in order), and may
// finish in any order (OrderByKey runs keys of one partition at once). The
// commit point is the offset of the first unfinished record, or the offset
// after the last record when all are finished: never past a gap, whatever
// finished after it. Offsets need not be contiguous (compaction,
// transaction markers), so only fetched records count.
//
// Each fetched record gets a sequence number, its place in the
// partition's table for good (base counts what the table dropped from its
// front), which its handle keeps: a record is found in its table without
// a search, and a run of records finished in order is marked and then
// passed by the commit point in one sweep (see finish and advance).
type partition struct {
	id   int32
	lane string
	gen  uint64 // the assignment it was made for (kafkaDriver.gen): driver.Message.Generation
	// gone is set once the partition is revoked or lost: its records are
	// not ours to commit. A new assignment gets a new *partition. d.mu.
	gone bool

	ents []entry // fetched records from ents[head] on; before head all finished
	head int
	base int64 // the sequence number of ents[0]

	next      int64 // the commit point: every fetched record below it is finished; -1 none yet
	nextEpoch int32 // leader epoch of the last finished record before next
	committed int64 // the last offset this assignment committed; -1 none

	stash       []*kgo.Record // polled beyond the partition's share of the loop, not yet handed out
	fetchedTo   int64         // the offset after the last record polled; 0 none
	outstanding int           // handed out and unfinished
	paused      bool          // fetching paused because outstanding reached the buffer
	progress    int64         // when a record last finished, or the partition was last handed a record with none unfinished (or was assigned), unix nanos

	// The rate the partition finishes records at: finished in the window
	// from winStart on, and in the last whole window (-1: unknown, when the
	// loop did not hold records of it all through the window: then it
	// measured no rate). See adjustPauses.
	winStart    int64
	winAcks     int
	winBusy     bool // it had records in the loop when the window began
	lastWinAcks int
}

type entry struct {
	off   int64
	ts    int64 // record timestamp, unix nanos
	epoch int32
	done  bool
}

func newPartition(id int32) *partition {
	now := time.Now().UnixNano()
	return &partition{id: id, lane: strconv.Itoa(int(id)), next: -1, committed: -1, progress: now, winStart: now, lastWinAcks: -1}
}

// add enters r, fetched and about to be handed out, and returns its
// sequence number.
func (p *partition) add(r *kgo.Record) (seq int64) {
	if p.outstanding == 0 {
		// Busy from now: a spell with nothing to finish (waiting for a
		// fetch) is not a spell without progress.
		p.progress = time.Now().UnixNano()
	}
	seq = p.base + int64(len(p.ents))
	p.ents = append(p.ents, entry{off: r.Offset, ts: r.Timestamp.UnixNano(), epoch: r.LeaderEpoch})
	p.outstanding++
	return seq
}

// finish marks the record of sequence number seq finished. It reports
// false for one it does not hold unfinished. The commit point moves only
// on advance, once for a run of records finished together; the caller sets
// progress (one clock reading for a settled batch).
func (p *partition) finish(seq int64) bool {
	i := seq - p.base
	if i < int64(p.head) || i >= int64(len(p.ents)) || p.ents[i].done {
		return false // before head, or compacted away: finished already
	}
	p.ents[i].done = true
	p.outstanding--
	p.winAcks++
	return true
}

// advance moves the commit point over every finished record at the head,
// and drops them from the table when it is cheap to.
func (p *partition) advance() {
	h := p.head
	for h < len(p.ents) && p.ents[h].done {
		h++
	}
	if h == p.head {
		return
	}
	e := &p.ents[h-1]
	p.next, p.nextEpoch = e.off+1, e.epoch
	p.head = h
	switch {
	case p.head == len(p.ents):
		p.base += int64(len(p.ents))
		p.ents, p.head = p.ents[:0], 0
	case p.head >= 1024 && p.head*2 >= len(p.ents):
		n := copy(p.ents, p.ents[p.head:])
		p.base += int64(p.head)
		p.ents, p.head = p.ents[:n], 0
	}
}

// oldest is the timestamp of the oldest unfinished record, 0 for none.
func (p *partition) oldest() int64 {
	if p.head < len(p.ents) {
		return p.ents[p.head].ts
	}
	return 0
}

// kgoLogger sends franz-go's warnings and errors to slog.
type kgoLogger struct{ l *slog.Logger }

func (k kgoLogger) Level() kgo.LogLevel { return kgo.LogLevelWarn }

func (k kgoLogger) Log(level kgo.LogLevel, msg string, keyvals ...any) {
	lv := slog.LevelInfo
	switch level {
	case kgo.LogLevelError:
		lv = slog.LevelError
	case kgo.LogLevelWarn:
		lv = slog.LevelWarn
	case kgo.LogLevelDebug:
		lv = slog.LevelDebug
	}
	k.l.Log(context.Background(), lv, "franz-go: "+msg, keyvals...)
}
