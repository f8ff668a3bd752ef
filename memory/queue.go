package memory

import (
	"maps"
	"math"
	"strconv"
	"sync"

	"github.com/ferrymq/ferry/consumer/driver"
)

// entry states.
const (
	stVisible  uint8 = iota // waiting to be fetched (in FIFO: possibly behind its group's head)
	stDelayed               // returned with a delay, or published with a NotBefore ahead; in the heap until it is due
	stInflight              // fetched; in the heap until its lease runs out
	stGone                  // acked or moved to the dead-letter queue
)

// entry is one message in one queue.
type entry struct {
	q        *queue
	g        *group // FIFO only
	id       string
	key      string
	body     []byte
	headers  map[string]string
	pub      int64 // when it was published, Unix nanoseconds
	enq      int64 // when this queue took it, broker clock
	due      int64 // heap deadline, broker clock
	cur      *receipt
	known    *driver.History // the runs the consumer reported when it last returned the message
	hidx     int32
	receives int32
	state    uint8
}

// receipt is the handle of one delivery, like an SQS receipt handle: a new one
// is made every time the message is fetched, and only the newest, while its
// lease lasts, may settle or extend the message.
type receipt struct{ e *entry }

// group is one FIFO message group. Its entries are in publish order; only the
// head can be in flight or delayed, the rest wait behind it.
type group struct {
	key     string
	entries ring[*entry]
}

// queue is one named queue. Every field below mu is guarded by it.
type queue struct {
	b    *Broker
	name string
	cfg  QueueConfig
	vis  int64 // visibility timeout in nanoseconds
	dlq  *queue

	mu       sync.Mutex
	ready    ring[*entry] // standard queues: visible entries in order
	groups   map[string]*group
	readyG   ring[*group] // FIFO: groups whose head is visible
	freeG    []*group
	heap     []*entry // delayed and in-flight entries by due
	order    ring[*entry]
	receipts []receipt // slab the next receipts come from
	dedup    map[string]int64
	dedupLog ring[dedupRec]

	visible, delayed, inflight int64
	acked, deadLettered        int64

	waiting    int
	wake       chan struct{}
	sleepUntil int64
}

type dedupRec struct {
	id string
	at int64
}

const never = math.MaxInt64

func newQueue(b *Broker, name string, cfg QueueConfig, dlq *queue) *queue {
	q := &queue{
		b:          b,
		name:       name,
		cfg:        cfg,
		vis:        int64(cfg.VisibilityTimeout),
		dlq:        dlq,
		wake:       make(chan struct{}),
		sleepUntil: never,
	}
	if cfg.FIFO {
		q.groups = make(map[string]*group)
		q.dedup = make(map[string]int64)
	}
	return q
}

// ---- the heap of deadlines ----

func (q *queue) heapLess(i, j int) bool { return q.heap[i].due < q.heap[j].due }

func (q *queue) heapSwap(i, j int) {
	h := q.heap
	h[i], h[j] = h[j], h[i]
	h[i].hidx = int32(i)
	h[j].hidx = int32(j)
}

func (q *queue) heapUp(j int) {
	for j > 0 {
		i := (j - 1) / 2
		if !q.heapLess(j, i) {
			break
		}
		q.heapSwap(i, j)
		j = i
	}
}

func (q *queue) heapDown(i int) bool {
	i0, n := i, len(q.heap)
	for {
		l := 2*i + 1
		if l >= n {
			break
		}
		j := l
		if r := l + 1; r < n && q.heapLess(r, l) {
			j = r
		}
		if !q.heapLess(j, i) {
			break
		}
		q.heapSwap(i, j)
		i = j
	}
	return i > i0
}

func (q *queue) heapPush(e *entry) {
	e.hidx = int32(len(q.heap))
	q.heap = append(q.heap, e)
	q.heapUp(int(e.hidx))
}

func (q *queue) heapRemove(e *entry) {
	i := int(e.hidx)
	n := len(q.heap) - 1
	if i != n {
		q.heapSwap(i, n)
	}
	q.heap[n] = nil
	q.heap = q.heap[:n]
	if i != n {
		if !q.heapDown(i) {
			q.heapUp(i)
		}
	}
	e.hidx = -1
}

func (q *queue) heapFix(e *entry) {
	i := int(e.hidx)
	if !q.heapDown(i) {
		q.heapUp(i)
	}
}

// ---- state changes; all with mu held ----

// enqueue appends a new visible entry.
func (q *queue) enqueue(e *entry, now int64) {
	e.q = q
	e.enq = now
	e.hidx = -1
	e.state = stVisible
	q.visible++
	q.order.pushBack(e)
	if !q.cfg.FIFO {
		q.ready.pushBack(e)
		return
	}
	g := q.groups[e.key]
	if g == nil {
		if n := len(q.freeG); n > 0 {
			g = q.freeG[n-1]
			q.freeG = q.freeG[:n-1]
		} else {
			g = new(group)
		}
		g.key = e.key
		q.groups[e.key] = g
	}
	e.g = g
	g.entries.pushBack(e)
	if g.entries.len() == 1 {
		q.readyG.pushBack(g)
	}
}

// later is now+delay on the broker's clock, at most the end of time: a
// delay centuries long (a NotBefore of year 9999) must not wrap around to
// the past and make the message due at once.
func later(now, delay int64) int64 {
	if delay > math.MaxInt64-now {
		return math.MaxInt64
	}
	return now + delay
}

// enqueueDelayed appends a new entry that becomes visible after delay (a
// publish with NotBefore; standard queues only).
func (q *queue) enqueueDelayed(e *entry, now, delay int64) {
	e.q = q
	e.enq = now
	e.hidx = -1
	e.state = stDelayed
	e.due = later(now, delay)
	q.delayed++
	q.order.pushBack(e)
	q.heapPush(e)
}

// makeVisible puts an entry that left the heap (or was returned with no
// delay) back where the next Fetch finds it: at the back of a standard queue,
// at the head of its FIFO group.
func (q *queue) makeVisible(e *entry) {
	e.state = stVisible
	q.visible++
	if q.cfg.FIFO {
		q.readyG.pushBack(e.g)
	} else {
		q.ready.pushBack(e)
	}
}

// advance makes visible every entry whose deadline has passed: leases that
// ran out lose their receipt, delays that ended are over.
func (q *queue) advance(now int64) {
	for len(q.heap) > 0 && q.heap[0].due <= now {
		e := q.heap[0]
		q.heapRemove(e)
		if e.state == stInflight {
			q.inflight--
			e.cur = nil
		} else {
			q.delayed--
		}
		q.makeVisible(e)
	}
}

// popVisible takes the next entry that may be delivered, or nil.
func (q *queue) popVisible() *entry {
	if !q.cfg.FIFO {
		if q.ready.len() == 0 {
			return nil
		}
		return q.ready.popFront()
	}
	if q.readyG.len() == 0 {
		return nil
	}
	return q.readyG.popFront().entries.front()
}

func (q *queue) hasVisible() bool {
	if q.cfg.FIFO {
		return q.readyG.len() > 0
	}
	return q.ready.len() > 0
}

// deliver leases e to a new receipt.
func (q *queue) deliver(e *entry, now int64) *receipt {
	if len(q.receipts) == cap(q.receipts) {
		q.receipts = make([]receipt, 0, 256)
	}
	q.receipts = q.receipts[:len(q.receipts)+1]
	r := &q.receipts[len(q.receipts)-1]
	r.e = e
	e.cur = r
	e.receives++
	e.state = stInflight
	e.due = now + q.vis
	q.visible--
	q.inflight++
	q.heapPush(e)
	return r
}

// remove forgets e, which is in flight (ack) or was just popped as visible
// (dead-lettering), and unblocks its FIFO group.
func (q *queue) remove(e *entry) {
	if e.hidx >= 0 {
		q.heapRemove(e)
	}
	switch e.state {
	case stInflight:
		q.inflight--
	case stDelayed:
		q.delayed--
	case stVisible:
		q.visible--
	}
	e.state = stGone
	e.cur = nil
	e.body = nil
	e.headers = nil
	if g := e.g; g != nil {
		g.entries.popFront() // e is the head
		e.g = nil
		if g.entries.len() > 0 {
			q.readyG.pushBack(g)
		} else {
			delete(q.groups, g.key)
			g.key = ""
			q.freeG = append(q.freeG, g)
		}
	}
	q.trimOrder()
}

// trimOrder drops settled entries from the front of the order ring, and
// compacts it when a long-lived entry at the front keeps many settled ones
// behind it, so its size stays proportional to the live messages.
func (q *queue) trimOrder() {
	for q.order.len() > 0 && q.order.front().state == stGone {
		q.order.popFront()
	}
	if live := q.visible + q.delayed + q.inflight; int64(q.order.len()) > 2*live+1024 {
		q.order.filter(func(e *entry) bool { return e.state != stGone })
	}
}

// ret returns an in-flight entry, visible again after delay.
func (q *queue) ret(e *entry, delay, now int64) {
	e.cur = nil
	q.inflight--
	if delay <= 0 {
		q.heapRemove(e)
		q.makeVisible(e)
		return
	}
	e.state = stDelayed
	e.due = later(now, delay)
	q.delayed++
	q.heapFix(e)
}

// valid reports whether r is e's current delivery and its lease still runs.
func (q *queue) valid(r *receipt, now int64) bool {
	e := r.e
	return e.q == q && e.cur == r && e.state == stInflight && e.due > now
}

// notify wakes the fetches waiting on q when there is something for them:
// a visible message, or a deadline earlier than the one they sleep until.
func (q *queue) notify() {
	if q.waiting == 0 {
		return
	}
	if q.hasVisible() || (len(q.heap) > 0 && q.heap[0].due < q.sleepUntil) {
		close(q.wake)
		q.wake = make(chan struct{})
		q.sleepUntil = never
	}
}

// leave unregisters a waiting fetch. sleepUntil is the earliest deadline a
// waiter sleeps until; a waiter that leaves other than by a wake-up may take
// that deadline with it, so the others are woken to register theirs again (a
// spurious wake-up costs a look at the queue; a missed one, a stuck fetch).
func (q *queue) leave(woken bool) {
	q.waiting--
	if q.waiting == 0 {
		q.sleepUntil = never
		return
	}
	if !woken {
		close(q.wake)
		q.wake = make(chan struct{})
		q.sleepUntil = never
	}
}

// isDuplicate reports whether a FIFO queue took a message with this ID within
// the deduplication window, and records it otherwise.
func (q *queue) isDuplicate(id string, now int64) bool {
	w := int64(q.b.dedupWindow)
	for q.dedupLog.len() > 0 && now-q.dedupLog.front().at >= w {
		old := q.dedupLog.popFront()
		if q.dedup[old.id] == old.at {
			delete(q.dedup, old.id)
		}
	}
	if at, ok := q.dedup[id]; ok && now-at < w {
		return true
	}
	q.dedup[id] = now
	q.dedupLog.pushBack(dedupRec{id: id, at: now})
	return false
}

// deadLetter makes the copy of e that goes to the dead-letter queue: the same
// ID, key, body and publish time, and headers saying where it came from.
func (q *queue) deadLetter(e *entry) *entry {
	h := make(map[string]string, len(e.headers)+2)
	maps.Copy(h, e.headers)
	h[HeaderSourceQueue] = q.name
	h[HeaderReceiveCount] = strconv.Itoa(int(e.receives))
	return &entry{id: e.id, key: e.key, body: e.body, headers: h, pub: e.pub}
}
