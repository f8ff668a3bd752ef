package kafka_test

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/kafka"
)

// audit is one ordered log of what every member of a test's group did:
// commits the broker accepted, partitions assigned, revoked and lost, and
// handler runs started and finished. The checks read it afterwards.
type audit struct {
	mu     sync.Mutex
	events []event
}

type event struct {
	kind   string // commit, assigned, revoked, lost, start, done
	member string
	offs   map[int32]int64 // commit
	parts  []int32         // assigned, revoked, lost
	p      int32           // start, done
	off    int64           // start, done
	who    string          // start, done: the consumer's name
}

func (a *audit) add(e event) {
	if debugAudit && e.kind != "start" && e.kind != "done" {
		fmt.Printf("%s audit: %+v\n", time.Now().Format("15:04:05.000"), e)
	}
	a.mu.Lock()
	a.events = append(a.events, e)
	a.mu.Unlock()
}

// options hooks the audit into a Broker.
func (a *audit) options() []kafka.Option {
	return []kafka.Option{
		kafka.WithCommitHook(func(ev kafka.CommitEvent) {
			a.add(event{kind: "commit", member: ev.Member, offs: ev.Offset})
		}),
		kafka.WithRebalanceHook(func(ev kafka.RebalanceEvent) {
			switch {
			case len(ev.Assigned) > 0:
				a.add(event{kind: "assigned", member: ev.Member, parts: ev.Assigned})
			case len(ev.Revoked) > 0:
				a.add(event{kind: "revoked", member: ev.Member, parts: ev.Revoked})
			case len(ev.Lost) > 0:
				a.add(event{kind: "lost", member: ev.Member, parts: ev.Lost})
			}
		}),
	}
}

// handler records each run's start and successful end around h (nil: no
// work).
func (a *audit) handler(who string, h consumer.HandlerFunc) consumer.HandlerFunc {
	return func(ctx context.Context, m *consumer.Message) error {
		p, _ := strconv.Atoi(m.Lane)
		a.add(event{kind: "start", p: int32(p), off: m.Offset, who: who})
		var err error
		if h != nil {
			err = h(ctx, m)
		}
		if err == nil {
			a.add(event{kind: "done", p: int32(p), off: m.Offset, who: who})
		}
		return err
	}
}

func (a *audit) snapshot() []event {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]event(nil), a.events...)
}

// count returns how many events of kind there are.
func (a *audit) count(kind string) int {
	n := 0
	for _, e := range a.snapshot() {
		if e.kind == kind {
			n++
		}
	}
	return n
}

// doneSet is every (partition, offset) whose handler succeeded.
func (a *audit) doneSet() map[[2]int64]int {
	out := make(map[[2]int64]int)
	for _, e := range a.snapshot() {
		if e.kind == "done" {
			out[[2]int64{int64(e.p), e.off}]++
		}
	}
	return out
}

// check verifies the log: every commit came from the partition's owner at
// the time (by that member's own assignments), no partition's committed
// offset ever went down, and no record ran after a commit had passed it
// (so a record ran twice only while it was in flight, never committed).
func (a *audit) check(t *testing.T) {
	t.Helper()
	owns := make(map[string]map[int32]bool)
	committed := make(map[int32]int64)
	var errs []string
	fail := func(format string, args ...any) {
		if len(errs) < 10 {
			errs = append(errs, fmt.Sprintf(format, args...))
		}
	}
	for i, e := range a.snapshot() {
		switch e.kind {
		case "assigned":
			if owns[e.member] == nil {
				owns[e.member] = make(map[int32]bool)
			}
			for _, p := range e.parts {
				owns[e.member][p] = true
			}
		case "revoked", "lost":
			for _, p := range e.parts {
				delete(owns[e.member], p)
			}
		case "commit":
			for p, off := range e.offs {
				if !owns[e.member][p] {
					fail("event %d: member %s committed partition %d at %d while not owning it", i, e.member, p, off)
				}
				if prev, ok := committed[p]; ok && off < prev {
					fail("event %d: partition %d committed offset went down from %d to %d (member %s)", i, p, prev, off, e.member)
				}
				committed[p] = max(committed[p], off)
			}
		case "start":
			if c, ok := committed[e.p]; ok && e.off < c {
				fail("event %d: %s started partition %d offset %d after offset %d was committed", i, e.who, e.p, e.off, c)
			}
		}
	}
	for _, s := range errs {
		t.Error(s)
	}
}

const debugAudit = false
