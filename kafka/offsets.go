package kafka

import (
	"context"
	"log/slog"
	"sort"
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
// transaction markers), so only fetched offsets count.
type partition struct {
	id   int32
	lane string
	gen  uint64 // the assignment it was made for (kafkaDriver.gen): driver.Message.Generation

	ents []entry // fetched records from ents[head] on; before head all finished
	head int

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

func (p *partition) add(r *kgo.Record) {
	if p.outstanding == 0 {
		// Busy from now: a spell with nothing to finish (waiting for a
		// fetch) is not a spell without progress.
		p.progress = time.Now().UnixNano()
	}
	p.ents = append(p.ents, entry{off: r.Offset, ts: r.Timestamp.UnixNano(), epoch: r.LeaderEpoch})
	p.outstanding++
}

// ack marks the record at off finished and moves the commit point over
// every finished record at the head. It reports false for an offset it
// does not hold unfinished. The caller sets progress (one clock reading
// for a settled batch).
func (p *partition) ack(off int64) bool {
	live := p.ents[p.head:]
	i := sort.Search(len(live), func(i int) bool { return live[i].off >= off })
	if i == len(live) || live[i].off != off || live[i].done {
		return false
	}
	live[i].done = true
	p.outstanding--
	p.winAcks++
	for p.head < len(p.ents) && p.ents[p.head].done {
		e := &p.ents[p.head]
		p.next, p.nextEpoch = e.off+1, e.epoch
		p.head++
	}
	switch {
	case p.head == len(p.ents):
		p.ents, p.head = p.ents[:0], 0
	case p.head >= 1024 && p.head*2 >= len(p.ents):
		n := copy(p.ents, p.ents[p.head:])
		p.ents, p.head = p.ents[:n], 0
	}
	return true
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
