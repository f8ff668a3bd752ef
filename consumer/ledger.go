package consumer

import "github.com/ferrymq/ferry/consumer/driver"

// ledger remembers, for the messages a Loop handed back to a broker that
// redelivers, how many times their handler ran, so that when one comes back
// to the same Loop its Attempt is exact even where the broker only counts
// deliveries (SQS). It is bounded: the oldest entries are forgotten first,
// and a message that comes back to another process is counted from the
// broker's delivery count instead.
type ledger struct {
	m    map[ledgerKey]ledgerEntry
	ring []ledgerSlot // the entries in the order they were put, oldest at next
	next int
	seq  uint64
}

type ledgerKey struct {
	source, id string
}

type ledgerEntry struct {
	h   driver.History
	seq uint64
}

type ledgerSlot struct {
	k   ledgerKey
	seq uint64
}

func newLedger(size int) *ledger {
	return &ledger{m: make(map[ledgerKey]ledgerEntry), ring: make([]ledgerSlot, size)}
}

// put remembers h for k, forgetting the oldest entry when full.
func (g *ledger) put(k ledgerKey, h driver.History) {
	if k.id == "" {
		return
	}
	old := g.ring[g.next]
	if e, ok := g.m[old.k]; ok && e.seq == old.seq {
		delete(g.m, old.k)
	}
	g.seq++
	g.ring[g.next] = ledgerSlot{k, g.seq}
	g.next = (g.next + 1) % len(g.ring)
	g.m[k] = ledgerEntry{h, g.seq}
}

// take returns and forgets what is known of k.
func (g *ledger) take(k ledgerKey) (driver.History, bool) {
	e, ok := g.m[k]
	if ok {
		delete(g.m, k)
	}
	return e.h, ok
}
