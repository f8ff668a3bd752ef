package consumer

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"sync/atomic"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
)

// This file is the dispatcher: the one goroutine of a Run that owns every
// delivery's state. It admits fetched deliveries, hands them to workers and
// applies their outcomes. Its other concerns have files of their own:
// waiting.go (retries, holds and deferrals that run again later), settle.go
// (the settle and extend goroutines and what they are given), revoke.go
// (lanes the broker takes away), shutdown.go (draining), and workers.go (the
// fetcher and the workers around it).

// errNotStarted is the outcome of a delivery that a worker picked up after
// the shutdown grace ended, or after its lane was revoked, and so never ran.
var errNotStarted = errors.New("not started: consumer stopping")

// errAckFailed is the outcome of an at-most-once delivery whose ack failed:
// it did not run, and it is not known whether the broker still has it.
var errAckFailed = errors.New("not started: at-most-once ack failed")

type laneState struct {
	ctx    context.Context
	cancel context.CancelFunc
}

// run is the state of one Run call, owned by the dispatcher goroutine.
type run struct {
	l        *Loop
	h        Handler
	log      *slog.Logger
	breakers []*Breaker // the breakers in the handler chain, asked before an at-most-once ack

	handlerCtx    context.Context // parent of every handler's context
	cancelHandler context.CancelFunc

	work chan *delivery
	idle atomic.Int32 // workers waiting for work, or about to
	// Runs of unordered deliveries with workers (see looseRun), and the
	// next one, made for the delivery offered to the workers now.
	looseRuns []*looseRun
	nextLoose *looseRun
	boxes     []doneBox       // one a worker: what it finished, for the dispatcher to take
	doneSig   chan struct{}   // a box that was empty got a delivery
	taken     []*delivery     // the dispatcher's buffer, swapped with a box's
	ackReq    chan ackRequest // at most once: a worker asks for the ack before it runs
	fetched   chan []*delivery
	back      chan []*delivery
	fatal     chan error
	abandon   chan struct{} // closed when Run stops listening

	io ioQueue

	head     delivery // sentinel of the in-flight list
	ready    []*delivery
	keys     map[orderKey][]*delivery // busy keys and the deliveries queued behind them
	queued   int                      // deliveries queued behind busy keys
	waiting  dueHeap
	timer    *time.Timer
	lanes    map[string]*laneState
	ledger   *ledger
	running  int // deliveries with workers
	deferred int // deliveries waiting after Defer

	revocations []*revocationWait
	shutting    bool
	holding     bool              // a hold was logged, and no run has succeeded since
	holdStart   time.Time         // when holding began
	heldSince   int64             // holds since holding began
	closedKeys  map[orderKey]bool // keys a delivery went back on during the shutdown
	revokedGen  map[string]uint64 // per lane, Revocation.Before: older generations are stale
	graceOver   atomic.Bool       // read by workers: start nothing more
}

func newRun(ctx context.Context, l *Loop, h Handler, breakers []*Breaker) *run {
	work := make(chan *delivery, l.cfg.concurrency)
	if l.cfg.mode == AtMostOnce {
		// A message is acked before it runs, so a worker takes one only when
		// it is free to run it at once.
		work = make(chan *delivery)
	}
	r := &run{
		l:        l,
		h:        h,
		log:      l.cfg.logger.With("consumer", l.cfg.name),
		breakers: breakers,
		work:     work,
		boxes:    make([]doneBox, l.cfg.concurrency),
		doneSig:  make(chan struct{}, 1),
		ackReq:   make(chan ackRequest),
		fetched:  make(chan []*delivery),
		back:     make(chan []*delivery, 2), // the fetcher's two batches (see fetchLoop)
		fatal:    make(chan error, 1),
		abandon:  make(chan struct{}),
		keys:     make(map[orderKey][]*delivery),
		timer:    time.NewTimer(time.Hour),
	}
	r.timer.Stop()
	r.idle.Store(int32(l.cfg.concurrency))
	r.head.next, r.head.prev = &r.head, &r.head
	r.io.init(ctx, l)
	info := &loopInfo{name: l.cfg.name, log: r.log}
	r.handlerCtx, r.cancelHandler = context.WithCancel(context.WithValue(context.WithoutCancel(ctx), nameKey{}, info))
	if l.revoker != nil {
		r.lanes = make(map[string]*laneState)
	}
	if l.caps.Redelivers {
		r.ledger = newLedger(max(4*l.cfg.maxInFlight, 1024))
	}
	return r
}

// dispatch runs until the shutdown is complete (or abandoned) and returns
// the fatal driver error, if any.
func (r *run) dispatch(ctx context.Context, stopFetch context.CancelFunc, fetcherDone chan struct{}) error {
	l := r.l
	var (
		ctxDone     = ctx.Done()
		fetched     = r.fetched
		revoked     <-chan driver.Revocation
		extendTick  <-chan time.Time
		fatalErr    error
		fetcherOver bool
		sd          shutdown
	)
	defer sd.stop()
	if l.revoker != nil {
		revoked = l.revoker.Revoked()
	}
	if l.extender != nil {
		t := time.NewTicker(max(l.extender.Lease()/6, 10*time.Millisecond))
		defer t.Stop()
		extendTick = t.C
	}
	begin := func() {
		ctxDone = nil
		stopFetch()
		r.beginShutdown(&sd)
	}

	for {
		if r.shutting && fetcherOver && r.drained() {
			return fatalErr
		}
		var (
			workC   chan *delivery
			next    *delivery
			settleC chan<- settleJob
			extendC chan<- extendJob
		)
		if len(r.ready) > 0 {
			workC, next = r.work, r.ready[0]
			r.peekRun(next)
		}
		if r.io.stage() {
			settleC = r.io.settleC
		}
		if r.io.canExtend() {
			extendC = r.io.extendC
		}

		select {
		case workC <- next:
			r.ready[0] = nil
			r.ready = r.ready[1:]
			r.started(next)
			r.sendReady()

		case <-r.doneSig:
			r.takeDone()

		case req := <-r.ackReq:
			r.ackFirst(req)

		case batch := <-fetched:
			for _, d := range batch {
				r.admit(d)
			}
			clear(batch)
			r.back <- batch[:0]

		case <-fetcherDone:
			fetcherOver = true
			fetched = nil
			fetcherDone = nil

		case err := <-r.fatal:
			fatalErr = err
			r.log.Error("ferry: broker failed for good; stopping", "err", err)
			begin()

		case settleC <- r.io.settleJob():
			r.io.settleSent()

		case job := <-r.io.settleBack:
			r.settled(job)

		case extendC <- r.io.extendJob():
			r.io.extendSent()

		case job := <-r.io.extendBack:
			r.extended(job)

		case <-r.timer.C:
			r.wakeDue()

		case <-extendTick:
			r.extendLeases()

		case rev := <-revoked:
			r.revoke(rev)

		case <-ctxDone:
			begin()

		case <-sd.graceC:
			r.endGrace(&sd)

		case <-sd.abandonC:
			r.log.Warn("ferry: shutdown gave up waiting; leaving what is unsettled to its lease",
				"running", r.running, "settling", r.io.outstanding())
			return fatalErr
		}
	}
}

// sendReady hands workers more ready deliveries while the work queue has
// room, and takeDone applies more outcomes while workers have returned
// some: one wake-up of the dispatcher does what it can at once rather than
// going round its select (the loop's main cost per message) for each.
func (r *run) sendReady() {
	for len(r.ready) > 0 {
		d := r.ready[0]
		r.peekRun(d)
		select {
		case r.work <- d:
		default:
			return
		}
		r.ready[0] = nil
		r.ready = r.ready[1:]
		r.started(d)
	}
}

// maxRun bounds how many deliveries queued behind a key go to a worker
// with the one ahead of them.
const maxRun = 256

// maxLooseRun bounds a run of unordered deliveries (see peekRun).
const maxLooseRun = 64

// peekRun sets d.run to what waits behind d's key, up to maxRun, before d
// is offered to the workers: a worker that takes d runs them after it
// without a round trip through the dispatcher for each, which is what
// bounds the rate of an ordered lane. Only the first deliveries of the key
// queue are viewed; started takes them out of it once d was taken. An
// unordered d (the head of r.ready) takes the unordered deliveries ready
// behind it instead, a share of them for each worker and at most
// maxLooseRun: one hand-off for many, where each would otherwise cost the
// dispatcher a send; the worker hands the rest back as soon as one is slow
// (see looseRun). At most once takes no runs: each of its deliveries is
// acked just before it runs.
func (r *run) peekRun(d *delivery) {
	d.run, d.loose = nil, nil
	if r.l.cfg.mode == AtMostOnce {
		return
	}
	if !d.ordered {
		n := min((len(r.ready)-1)/r.l.cfg.concurrency, maxLooseRun)
		for i := 1; i <= n; i++ {
			if r.ready[i].ordered {
				n = i - 1
				break
			}
		}
		if n > 0 {
			d.run = r.ready[1 : 1+n : 1+n]
			if r.nextLoose == nil {
				r.nextLoose = new(looseRun)
			}
			r.nextLoose.run = d.run
			d.loose = r.nextLoose
		}
		return
	}
	q := r.keys[r.orderKey(d)]
	n := min(len(q), maxRun)
	d.run = q[:n:n]
}

// started notes that a worker took d (already out of r.ready), and with it
// d.run.
func (r *run) started(d *delivery) {
	d.state = stateRunning
	r.running++
	n := len(d.run)
	d.passKey = n > 0 && d.ordered
	if n == 0 {
		return
	}
	if !d.ordered {
		r.looseRuns = append(r.looseRuns, d.loose)
		r.nextLoose = nil
		if len(r.looseRuns) > 4*r.l.cfg.concurrency {
			r.looseRuns = slices.DeleteFunc(r.looseRuns, (*looseRun).claimed)
		}
		// The run is what was ready behind d, now at the head of r.ready.
		// d.run views those slots, and the worker reads it: they are left
		// as they are (r.ready never writes below its start), as a key
		// queue's are.
		r.ready = r.ready[n:]
		r.running += n
		for _, f := range d.run {
			f.state = stateRunning
		}
		return
	}
	k := r.orderKey(d)
	r.keys[k] = r.keys[k][n:]
	r.queued -= n
	r.running += n
	for i, f := range d.run {
		// Not f.run: the worker reads only the run of the delivery it took.
		f.state = stateRunning
		f.passKey = i < n-1
	}
}

// requeueCut puts the deliveries of a run that the worker handed back
// unrun (after d, which did not succeed) at the head of their key's queue,
// in order, before d's outcome is applied: whatever that does with what
// waits behind d's key (wait with it, go back with it), it does with them.
func (r *run) requeueCut(d *delivery) {
	cut := d.cut
	d.cut, d.passKey = nil, false
	r.running -= len(cut)
	if !d.ordered {
		r.readyAgain(cut)
		return
	}
	var live []*delivery // a new array: cut views the key queue's old one
	for _, c := range cut {
		c.passKey = false
		if c.revoked || d.revoked {
			// Revoked with d's lane, whose key queue is gone.
			c.revoked = true
			r.drop(c)
			continue
		}
		c.state = stateQueued
		live = append(live, c)
	}
	if len(live) > 0 {
		k := r.orderKey(d)
		r.keys[k] = append(live, r.keys[k]...)
		r.queued += len(live)
	}
}

// takeDone applies the outcomes in every worker's box, in the order each
// worker finished them, until the boxes are empty.
func (r *run) takeDone() {
	defer r.rebalance()
	for more := true; more; {
		more = false
		for i := range r.boxes {
			b := &r.boxes[i]
			b.mu.Lock()
			r.taken, b.ds = b.ds, r.taken[:0]
			b.mu.Unlock()
			for _, d := range r.taken {
				r.running--
				r.finish(d)
			}
			more = more || len(r.taken) > 0
			clear(r.taken)
		}
	}
}

// admit takes a fetched delivery into the loop: into the in-flight list, and
// either to the ready queue or behind the busy key it is ordered on.
func (r *run) admit(d *delivery) {
	l := r.l
	r.listPush(d)
	if d.gen != 0 && d.gen < r.revokedGen[d.msg.Lane] {
		// Fetched before its lane was revoked, and handed over after.
		d.revoked = true
		r.drop(d)
		return
	}
	r.countPriorRuns(d)
	if r.lanes != nil {
		ls := r.lanes[d.msg.Lane]
		if ls == nil {
			c, cancel := context.WithCancel(r.handlerCtx)
			ls = &laneState{ctx: c, cancel: cancel}
			r.lanes[d.msg.Lane] = ls
		}
		d.ctx.Context = ls.ctx
	} else {
		d.ctx.Context = r.handlerCtx
	}
	if r.graceOver.Load() {
		r.settle(d, driver.Return, 0)
		return
	}
	switch l.cfg.ordering {
	case OrderByLane:
		d.ordered = d.msg.Lane != ""
	case OrderByKey:
		// A message without a key asks for no order.
		d.ordered = d.msg.Key != ""
	}
	if d.ordered {
		k := r.orderKey(d)
		if r.closedKeys[k] {
			// An earlier delivery of its key went back as the Run stops:
			// this one follows it back rather than overtake it.
			r.settle(d, driver.Return, 0)
			return
		}
		if q, busy := r.keys[k]; busy {
			r.keys[k] = append(q, d)
			d.state = stateQueued
			r.queued++
			return
		}
		r.keys[k] = nil
	}
	d.state = stateReady
	r.ready = append(r.ready, d)
}

// countPriorRuns sets what is known of the message's runs before this
// delivery: what the broker carried, or what this loop noted when it
// returned the message, whichever covers more deliveries; each earlier
// delivery that neither covers counts as one run.
func (r *run) countPriorRuns(d *delivery) {
	var prior driver.History
	if d.x != nil {
		prior = d.x.known
	}
	if r.ledger != nil {
		// An entry counts only for a later delivery of the message it
		// recorded: a fresh message that reuses an id inherits nothing.
		if h, ok := r.ledger.take(ledgerKey{d.msg.Source, d.msg.ID}); ok && h.Deliveries > prior.Deliveries && d.msg.Deliveries > h.Deliveries {
			prior = h
		}
	}
	unseen := max(d.msg.Deliveries-1-prior.Deliveries, 0)
	d.prior = prior.Runs + unseen
	d.runs = d.prior
	d.msg.unseen = prior.Unseen + unseen
	d.rec.first = prior.FirstFailure
}

// finish applies a handler's outcome.
func (r *run) finish(d *delivery) {
	l := r.l
	if d.cut != nil {
		r.requeueCut(d)
	}
	r.releaseReservations(d)
	if d.revoked {
		r.drop(d)
		return
	}
	err, late := d.err, d.late
	d.err, d.late = nil, false
	held, isHeld := asHeld(err)
	isDeferred := !isHeld && err != nil && IsDeferred(err)
	ran := d.called
	if d.called {
		// A hold or a deferral is not a run: the run it would have been
		// was not made.
		d.called = false
		d.runs = d.msg.Attempt
		if isHeld || isDeferred {
			d.runs--
		}
	}
	if isHeld {
		if !d.acked {
			l.stats.held.Add(1)
		}
		r.holdsBegin(d, held)
		r.pauseFetching(held.Delay)
	} else if r.holding && ran && err == nil {
		r.holdsEnd()
	}
	if d.acked {
		// At most once: acked before it ran, so whatever happened is final.
		// A run that failed, or a retry inside the chain that met an open
		// breaker, loses the message: the mode allows it, but it is counted
		// and logged as dropped, never hidden among the holds.
		switch {
		case err == errAckFailed:
			// Not run, and perhaps not acked: neither a success nor a
			// handler failure (the settle error is counted).
		case isHeld:
			r.dropped(d, "held after its ack (a retry inside the chain met an open breaker)", err)
		case err != nil:
			r.countFailure(d, err)
			r.dropped(d, "its run failed after the ack", err)
		}
		r.leave(d)
		r.releaseKey(d)
		return
	}
	switch {
	case err == errAckFailed:
		// At most once: not run, and perhaps acked. Let it go.
		r.leave(d)
		r.releaseKey(d)
	case err == errNotStarted:
		r.settle(d, driver.Return, 0)
	case err == nil && late:
		// It returned after its context was cancelled: it may have stopped
		// short of its work, so let it run again.
		r.settle(d, driver.Return, 0)
	case err == nil:
		r.settle(d, driver.Ack, 0)
	case isHeld:
		if r.shutting {
			r.settle(d, driver.Return, held.Delay)
			return
		}
		r.wait(d, time.Now().Add(held.Delay))
	case isDeferred:
		r.deferRun(d, r.redeliveryDelay(d, err))
	default:
		r.fail(d, err)
	}
}

// fail applies a handler's failure: the message goes back to the broker
// with its delay, or, where the broker cannot take it back (a log), runs
// again here after the delay, holding its key so that nothing behind it
// overtakes it.
func (r *run) fail(d *delivery, err error) {
	l := r.l
	r.countFailure(d, err)
	if d.rec.first.IsZero() {
		d.rec.first = time.Now()
	}
	delay := r.redeliveryDelay(d, err)
	if l.caps.Redelivers || r.shutting {
		r.settle(d, driver.Return, delay)
		return
	}
	l.stats.retried.Add(1)
	d.rec.inPlace = true
	r.wait(d, time.Now().Add(delay))
}

// asHeld returns the HeldError in err, if any. It is a function of its own
// because the variable errors.As fills escapes to the heap: declared in
// finish, it would cost an allocation for every message, failed or not.
func asHeld(err error) (*HeldError, bool) {
	if err == nil {
		return nil, false
	}
	var held *HeldError
	ok := errors.As(err, &held)
	return held, ok
}

// pauseFetching stops the fetcher until d from now (a breaker is open).
func (r *run) pauseFetching(d time.Duration) {
	until := time.Now().Add(d).UnixNano()
	if until > r.l.paused.Load() {
		r.l.paused.Store(until)
	}
}

func (r *run) countFailure(d *delivery, err error) {
	l := r.l
	l.stats.failed.Add(1)
	var p *PanicError
	if errors.As(err, &p) {
		l.stats.panics.Add(1)
		r.log.Error("ferry: handler panicked", "id", d.msg.ID, "attempt", d.msg.Attempt, "panic", p.Value, "stack", string(p.Stack))
		return
	}
	if IsPermanent(err) {
		r.log.Error("ferry: permanent failure with no DeadLetter middleware to take it; returning the message for redelivery",
			"id", d.msg.ID, "attempt", d.msg.Attempt, "err", err)
		return
	}
	if ok, left := l.logs.Allow("failed:" + errorType(err)); ok {
		r.log.Warn("ferry: handler failed; the message will run again", "source", d.msg.Source, "id", d.msg.ID,
			"attempt", d.msg.Attempt, "err", err, "error_type", errorType(err), "unlogged", left)
	}
}

// holdsBegin logs the first hold after a time without holds: the consumer
// pauses, keeping its messages and their attempts, while a breaker is open.
func (r *run) holdsBegin(d *delivery, held *HeldError) {
	r.heldSince++
	if r.holding {
		return
	}
	r.holding, r.holdStart, r.heldSince = true, time.Now(), 1
	r.log.Warn("ferry: holding messages while a circuit breaker is open; fetching pauses, no attempt is spent",
		"source", d.msg.Source, "id", d.msg.ID, "hold", held.Delay, "err", held.Err)
}

// holdsEnd logs that a run succeeded after holds: consuming goes on.
func (r *run) holdsEnd() {
	r.log.Info("ferry: holds over; consuming again", "held_for", time.Since(r.holdStart).Round(time.Millisecond),
		"holds", r.heldSince)
	r.holding = false
}

// dropped counts and logs (rate-limited) an at-most-once message lost
// after its ack.
func (r *run) dropped(d *delivery, why string, err error) {
	r.l.stats.dropped.Add(1)
	if ok, left := r.l.logs.Allow("dropped:" + why); ok {
		r.log.Warn("ferry: at-most-once message dropped: "+why, "id", d.msg.ID, "source", d.msg.Source,
			"attempt", d.msg.Attempt, "err", err, "dropped_unlogged", left)
	}
}

// redeliveryDelay is the delay an error asks for (RetryAfter, Defer), or the
// loop's backoff for the number of runs made.
func (r *run) redeliveryDelay(d *delivery, err error) time.Duration {
	var ra *RetryAfterError
	if errors.As(err, &ra) {
		return ra.Delay
	}
	var de *DeferredError
	if errors.As(err, &de) {
		return de.Delay
	}
	c := r.l.cfg
	delay := c.backoffMin
	for i := 1; i < d.runs && delay < c.backoffMax; i++ {
		delay *= 2
	}
	return min(delay, c.backoffMax)
}

// orderKey is what an ordered delivery is serialised on: its lane alone
// (OrderByLane) or its lane and key (OrderByKey).
func (r *run) orderKey(d *delivery) orderKey {
	if r.l.cfg.ordering == OrderByKey {
		return orderKey{lane: d.msg.Lane, key: d.msg.Key}
	}
	return orderKey{lane: d.msg.Lane}
}

// releaseKey lets the next delivery queued behind d's key run.
func (r *run) releaseKey(d *delivery) {
	if !d.ordered || d.passKey {
		return
	}
	k := r.orderKey(d)
	q, ok := r.keys[k]
	if !ok {
		return
	}
	if len(q) == 0 {
		delete(r.keys, k)
		return
	}
	next := q[0]
	q[0] = nil
	r.keys[k] = q[1:]
	r.queued--
	next.state = stateReady
	r.ready = append(r.ready, next)
}

// takeFollowers removes and returns what waits behind d's key, freeing the
// key.
func (r *run) takeFollowers(d *delivery) []*delivery {
	if !d.ordered || d.passKey {
		return nil
	}
	k := r.orderKey(d)
	q := r.keys[k]
	delete(r.keys, k)
	r.queued -= len(q)
	return q
}

// looseRun is a run of unordered deliveries given to one worker with the
// delivery ahead of them (see peekRun). The worker claims them one at a
// time as it goes; when another worker is idle with nothing ready, the
// dispatcher takes back what is unclaimed (rebalance), so that a slow
// handler at the head of a run keeps no other delivery waiting for it.
type looseRun struct {
	run   []*delivery
	taken atomic.Int32 // deliveries of run claimed (by the worker, or taken back); may pass len(run)
}

// claim returns the next delivery of the run for the worker to run, or nil
// when none is left to it.
func (lr *looseRun) claim() *delivery {
	if i := int(lr.taken.Add(1)) - 1; i < len(lr.run) {
		return lr.run[i]
	}
	return nil
}

// rest claims every delivery of the run not yet claimed, and returns them.
func (lr *looseRun) rest() []*delivery {
	if i := int(lr.taken.Swap(int32(len(lr.run)))); i < len(lr.run) {
		return lr.run[i:]
	}
	return nil
}

// claimed reports whether nothing of the run is left to claim.
func (lr *looseRun) claimed() bool { return int(lr.taken.Load()) >= len(lr.run) }

// rebalance takes back the unclaimed rest of every run of unordered
// deliveries when a worker waits with nothing ready or queued for it: a
// run that a slow handler holds up goes to the workers that are free.
func (r *run) rebalance() {
	if len(r.looseRuns) == 0 || len(r.ready) > 0 || int(r.idle.Load()) <= len(r.work) {
		return
	}
	r.takeBackLoose()
}

// takeBackLoose takes back the unclaimed rest of every run of unordered
// deliveries, to the head of the ready queue.
func (r *run) takeBackLoose() {
	for _, lr := range r.looseRuns {
		if rest := lr.rest(); len(rest) > 0 {
			r.running -= len(rest)
			r.readyAgain(rest)
		}
	}
	clear(r.looseRuns)
	r.looseRuns = r.looseRuns[:0]
}

// readyAgain puts unordered deliveries taken back from a worker unrun at
// the head of the ready queue, in order, but those whose lane was revoked
// meanwhile, which go.
func (r *run) readyAgain(ds []*delivery) {
	live := make([]*delivery, 0, len(ds)+len(r.ready))
	for _, c := range ds {
		if c.revoked {
			r.drop(c)
			continue
		}
		c.state = stateReady
		live = append(live, c)
	}
	r.ready = append(live, r.ready...)
}
