package consumer

import (
	"context"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
)

// This file is one delivery as the loop holds it: its state, the context its
// handler gets, the key it is ordered on, and the list of everything in
// flight.

// state is where a delivery is in the loop. The dispatcher goroutine moves
// it from one state to the next; nothing else writes it.
type state uint8

const (
	stateReady    state = iota // in dispatcher.ready, waiting for a free worker
	stateQueued                // behind a busy key, in dispatcher.keys
	stateRunning               // with a worker (in at-most-once mode, perhaps waiting for its ack)
	stateWaiting               // in dispatcher.waiting until its time comes: an in-place retry, a hold, a deferral
	stateSettling              // its settlement is decided; it leaves when the settlement is made
)

// orderKey is what a delivery is serialised on: its lane alone (OrderByLane)
// or its lane and key (OrderByKey). A struct, not a joined string, so that
// any bytes in a lane or key stay apart.
type orderKey struct {
	lane, key string
}

// delivery is one message while the loop holds it. The dispatcher goroutine
// owns every field except err, called, late and cut, which the worker
// running it writes before it hands it back, and msg and rec, which belong
// to the handler while it runs.
type delivery struct {
	msg Message     // msg.handle is the driver's handle
	ctx deliveryCtx // the handler's context
	rec record      // what the middleware layers share about its runs

	state    state
	ordered  bool // serialised on its orderKey
	revoked  bool // its lane was taken away: nothing of it is settled
	acked    bool // at most once: acked before it ran
	deferred bool // waiting after Defer: counted apart from the in-flight bound
	called   bool // the worker called the handler this time (set by the worker)
	late     bool // the handler returned after the shutdown grace ended (set by the worker)

	// A train: an ordered delivery goes to its worker with the deliveries
	// queued behind its key (train), which the worker runs after it, in
	// order, for as long as each succeeds; where one does not, the worker
	// hands the rest back unrun in cut. passKey marks a delivery of a train
	// that is not the last: its key passes on to the next one, so its ack
	// releases nothing.
	train   []*delivery
	cut     []*delivery // set by the worker
	passKey bool
	loose   *looseTrain // d.train as a train of unordered deliveries, which idle workers may take over

	gen   uint64 // the lane generation it was fetched under (driver.Message.Generation)
	prior int    // handler runs known before this delivery
	runs  int    // handler runs known, this delivery's included
	err   error  // the handler's result, written by the worker

	leaseAt   time.Time // when its lease runs out (drivers with leases)
	extending bool      // in an extension that is being made now

	settleSent bool          // the settlement is with the driver now
	ackWait    chan error    // at most once: the worker waiting for this delivery's ack
	reserved   []reservation // at most once: breaker calls taken before the ack

	x *deliveryRare // what few deliveries need; nil until one does

	prev, next *delivery // the in-flight list
}

// deliveryRare is the part of a delivery that few need: a history the broker
// carried, a time to wait until, revocations waiting for it. Kept apart, so
// that the deliveries that need none of it (most) are that much smaller;
// only their owner (the fetcher while it builds them, then the dispatcher)
// makes or touches it, never a worker.
type deliveryRare struct {
	known   driver.History    // what the broker carried of the runs before this delivery
	due     time.Time         // when a waiting delivery runs again
	heapIdx int               // its index in dispatcher.waiting, or -1
	awaited []*revocationWait // revocations waiting for this delivery
}

// rare returns d's rare part, making it on first use.
func (d *delivery) rare() *deliveryRare {
	if d.x == nil {
		d.x = &deliveryRare{heapIdx: -1}
	}
	return d.x
}

// waitingIdx is d's index in dispatcher.waiting, or -1 if it is not there.
func (d *delivery) waitingIdx() int {
	if d.x == nil {
		return -1
	}
	return d.x.heapIdx
}

// newDelivery makes m a delivery, taken from slab.
func newDelivery(slab *deliverySlab, m *driver.Message, aser driver.Aser) *delivery {
	d := slab.next()
	d.gen = m.Generation
	if m.Known != (driver.History{}) {
		d.rare().known = m.Known
	}
	d.msg = Message{
		ID: m.ID, Key: m.Key, Body: m.Body, Headers: m.Headers, Source: m.Source,
		Lane: m.Lane, Offset: m.Offset, Deliveries: max(m.Deliveries, 1), PublishedAt: m.PublishedAt,
		aser: aser, handle: m.Handle,
	}
	d.ctx.d = d
	return d
}

// slabSize is how many deliveries one allocation makes. Fetched together,
// they mostly leave together; a slab lives while any of its deliveries is
// referenced, which is why a delivery lets go of its body, headers and
// handle as it leaves (see forget): a delivery held for long, such as a
// poison message retried in place, keeps only its neighbours' small parts.
const slabSize = 16

// deliverySlab hands out deliveries slabSize to an allocation. Only the
// fetcher uses one.
type deliverySlab []delivery

func (s *deliverySlab) next() *delivery {
	if len(*s) == 0 {
		*s = make([]delivery, slabSize)
	}
	d := &(*s)[0]
	*s = (*s)[1:]
	return d
}

// forget drops d's references to what may be large (the body, the headers,
// the driver's handle) once d has left the loop, so that its slab does not
// keep them alive. The handler has returned: it must not keep the Message.
// Its train goes too, loose or not: a train views a ready queue's array, whose
// deliveries' trains view later arrays, so one delivery held for long (and its
// slab's neighbours) would otherwise keep every later delivery reachable.
func (d *delivery) forget() {
	d.msg.Body, d.msg.Headers, d.msg.handle = nil, nil, nil
	d.train, d.cut, d.reserved, d.loose = nil, nil, nil, nil
}

// ackRequest is a worker asking for an at-most-once delivery's ack before
// it runs it. The dispatcher answers on reply: nil once the ack is made,
// errNotStarted when the delivery must not run (its lane was revoked, the
// grace ended), errAckFailed when the ack failed.
type ackRequest struct {
	d     *delivery
	reply chan error
}

// history is what the loop knows of the message's runs, this delivery's
// included, for a driver that carries it with a returned message.
func (d *delivery) history() driver.History {
	return driver.History{Runs: d.runs, Deliveries: d.msg.Deliveries, Unseen: d.msg.unseen, FirstFailure: d.rec.first}
}

// deliveryCtx is the context a handler gets: its lane's context (or the
// loop's), which also answers for the delivery's record and, in at-most-once
// mode, its breaker reservations. It is a field of the delivery, so giving a
// handler its context costs no allocation.
type deliveryCtx struct {
	context.Context
	d *delivery
}

type reservationKey struct{}

func (c *deliveryCtx) Value(key any) any {
	switch key.(type) {
	case recordKey:
		return &c.d.rec
	case reservationKey:
		return c.d
	}
	return c.Context.Value(key)
}

// listPush adds d to the list of everything in flight, which lease
// extension and revocation walk.
func (dp *dispatcher) listPush(d *delivery) {
	if dp.l.extender != nil {
		d.leaseAt = time.Now().Add(dp.l.extender.Lease())
	}
	d.prev = dp.head.prev
	d.next = &dp.head
	dp.head.prev.next = d
	dp.head.prev = d
}

func (dp *dispatcher) listRemove(d *delivery) {
	if d.next == nil {
		return
	}
	d.prev.next = d.next
	d.next.prev = d.prev
	d.prev, d.next = nil, nil
}
