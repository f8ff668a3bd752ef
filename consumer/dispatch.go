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

// dispatcher is the state of one Run call, owned by the dispatcher goroutine.
type dispatcher struct {
	l        *Loop
	h        Handler
	log      *slog.Logger
	breakers []*Breaker // the breakers in the handler chain, asked before an at-most-once ack

	handlerCtx    context.Context // parent of every handler's context
	cancelHandler context.CancelFunc

	work chan *delivery
	idle atomic.Int32 // workers waiting for work, or about to
	// Trains of unordered deliveries with workers (see looseTrain), and the
	// next one, made for the delivery offered to the workers now.
	looseTrains []*looseTrain
	nextLoose   *looseTrain
	boxes       []doneBox       // one a worker: what it finished, for the dispatcher to take
	doneSig     chan struct{}   // a box that was empty got a delivery
	taken       []*delivery     // the dispatcher's buffer, swapped with a box's
	ackReq      chan ackRequest // at most once: a worker asks for the ack before it runs
	fetched     chan []*delivery
	back        chan []*delivery
	fatal       chan error
	abandon     chan struct{} // closed when Run stops listening

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

func newDispatcher(ctx context.Context, l *Loop, h Handler, breakers []*Breaker) *dispatcher {
	work := make(chan *delivery, l.cfg.concurrency)
	if l.cfg.mode == AtMostOnce {
		// A message is acked before it runs, so a worker takes one only when
		// it is free to run it at once.
		work = make(chan *delivery)
	}
	dp := &dispatcher{
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
	dp.timer.Stop()
	dp.idle.Store(int32(l.cfg.concurrency))
	dp.head.next, dp.head.prev = &dp.head, &dp.head
	dp.io.init(ctx, l)
	info := &loopInfo{name: l.cfg.name, log: dp.log}
	dp.handlerCtx, dp.cancelHandler = context.WithCancel(context.WithValue(context.WithoutCancel(ctx), nameKey{}, info))
	if l.revoker != nil {
		dp.lanes = make(map[string]*laneState)
	}
	if l.caps.Redelivers {
		dp.ledger = newLedger(max(4*l.cfg.maxInFlight, 1024))
	}
	return dp
}

// dispatch runs until the shutdown is complete (or abandoned) and returns
// the fatal driver error, if any.
func (dp *dispatcher) dispatch(ctx context.Context, stopFetch context.CancelFunc, fetcherDone chan struct{}) error {
	l := dp.l
	var (
		ctxDone     = ctx.Done()
		fetched     = dp.fetched
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
		dp.beginShutdown(&sd)
	}

	for {
		if dp.shutting && fetcherOver && dp.drained() {
			return fatalErr
		}
		var (
			workC   chan *delivery
			next    *delivery
			settleC chan<- settleJob
			extendC chan<- extendJob
		)
		if len(dp.ready) > 0 {
			workC, next = dp.work, dp.ready[0]
			dp.peekTrain(next)
		}
		if dp.io.stage() {
			settleC = dp.io.settleC
		}
		if dp.io.canExtend() {
			extendC = dp.io.extendC
		}

		select {
		case workC <- next:
			dp.ready[0] = nil
			dp.ready = dp.ready[1:]
			dp.started(next)
			dp.sendReady()

		case <-dp.doneSig:
			dp.takeDone()

		case req := <-dp.ackReq:
			dp.ackFirst(req)

		case batch := <-fetched:
			for _, d := range batch {
				dp.admit(d)
			}
			clear(batch)
			dp.back <- batch[:0]

		case <-fetcherDone:
			fetcherOver = true
			fetched = nil
			fetcherDone = nil

		case err := <-dp.fatal:
			fatalErr = err
			dp.log.Error("ferry: broker failed for good; stopping", "err", err)
			begin()

		case settleC <- dp.io.settleJob():
			dp.io.settleSent()

		case job := <-dp.io.settleBack:
			dp.settled(job)

		case extendC <- dp.io.extendJob():
			dp.io.extendSent()

		case job := <-dp.io.extendBack:
			dp.extended(job)

		case <-dp.timer.C:
			dp.wakeDue()

		case <-extendTick:
			dp.extendLeases()

		case rev := <-revoked:
			dp.revoke(rev)

		case <-ctxDone:
			begin()

		case <-sd.graceC:
			dp.endGrace(&sd)

		case <-sd.abandonC:
			dp.log.Warn("ferry: shutdown gave up waiting; leaving what is unsettled to its lease",
				"running", dp.running, "settling", dp.io.outstanding())
			return fatalErr
		}
	}
}

// sendReady hands workers more ready deliveries while the work queue has
// room, and takeDone applies more outcomes while workers have returned
// some: one wake-up of the dispatcher does what it can at once rather than
// going round its select (the loop's main cost per message) for each.
func (dp *dispatcher) sendReady() {
	for len(dp.ready) > 0 {
		d := dp.ready[0]
		dp.peekTrain(d)
		select {
		case dp.work <- d:
		default:
			return
		}
		dp.ready[0] = nil
		dp.ready = dp.ready[1:]
		dp.started(d)
	}
}

// maxTrain bounds how many deliveries queued behind a key go to a worker
// with the one ahead of them.
const maxTrain = 256

// maxLooseTrain bounds a train of unordered deliveries (see peekTrain).
const maxLooseTrain = 64

// peekTrain sets d.train to what waits behind d's key, up to maxTrain, before d
// is offered to the workers: a worker that takes d runs them after it
// without a round trip through the dispatcher for each, which is what
// bounds the rate of an ordered lane. Only the first deliveries of the key
// queue are viewed; started takes them out of it once d was taken. An
// unordered d (the head of dp.ready) takes the unordered deliveries ready
// behind it instead, a share of them for each worker and at most
// maxLooseTrain: one hand-off for many, where each would otherwise cost the
// dispatcher a send; the worker hands the rest back as soon as one is slow
// (see looseTrain). At most once takes no trains: each of its deliveries is
// acked just before it runs.
func (dp *dispatcher) peekTrain(d *delivery) {
	d.train, d.loose = nil, nil
	if dp.l.cfg.mode == AtMostOnce {
		return
	}
	if !d.ordered {
		n := min((len(dp.ready)-1)/dp.l.cfg.concurrency, maxLooseTrain)
		for i := 1; i <= n; i++ {
			if dp.ready[i].ordered {
				n = i - 1
				break
			}
		}
		if n > 0 {
			d.train = dp.ready[1 : 1+n : 1+n]
			if dp.nextLoose == nil {
				dp.nextLoose = new(looseTrain)
			}
			dp.nextLoose.ds = d.train
			d.loose = dp.nextLoose
		}
		return
	}
	q := dp.keys[dp.orderKey(d)]
	n := min(len(q), maxTrain)
	d.train = q[:n:n]
}

// started notes that a worker took d (already out of dp.ready), and with it
// d.train.
func (dp *dispatcher) started(d *delivery) {
	d.state = stateRunning
	dp.running++
	n := len(d.train)
	d.passKey = n > 0 && d.ordered
	if n == 0 {
		return
	}
	if !d.ordered {
		dp.looseTrains = append(dp.looseTrains, d.loose)
		dp.nextLoose = nil
		if len(dp.looseTrains) > 4*dp.l.cfg.concurrency {
			dp.looseTrains = slices.DeleteFunc(dp.looseTrains, (*looseTrain).claimed)
		}
		// The train is what was ready behind d, now at the head of dp.ready.
		// d.train views those slots, and the worker reads it: they are left
		// as they are (dp.ready never writes below its start), as a key
		// queue's are.
		dp.ready = dp.ready[n:]
		dp.running += n
		for _, f := range d.train {
			f.state = stateRunning
		}
		return
	}
	k := dp.orderKey(d)
	dp.keys[k] = dp.keys[k][n:]
	dp.queued -= n
	dp.running += n
	for i, f := range d.train {
		// Not f.train: the worker reads only the train of the delivery it took.
		f.state = stateRunning
		f.passKey = i < n-1
	}
}

// requeueCut puts the deliveries of a train that the worker handed back
// unrun (after d, which did not succeed) at the head of their key's queue,
// in order, before d's outcome is applied: whatever that does with what
// waits behind d's key (wait with it, go back with it), it does with them.
func (dp *dispatcher) requeueCut(d *delivery) {
	cut := d.cut
	d.cut, d.passKey = nil, false
	dp.running -= len(cut)
	if !d.ordered {
		dp.readyAgain(cut)
		return
	}
	var live []*delivery // a new array: cut views the key queue's old one
	for _, c := range cut {
		c.passKey = false
		if c.revoked || d.revoked {
			// Revoked with d's lane, whose key queue is gone.
			c.revoked = true
			dp.drop(c)
			continue
		}
		c.state = stateQueued
		live = append(live, c)
	}
	if len(live) > 0 {
		k := dp.orderKey(d)
		dp.keys[k] = append(live, dp.keys[k]...)
		dp.queued += len(live)
	}
}

// takeDone applies the outcomes in every worker's box, in the order each
// worker finished them, until the boxes are empty.
func (dp *dispatcher) takeDone() {
	defer dp.rebalance()
	for more := true; more; {
		more = false
		for i := range dp.boxes {
			b := &dp.boxes[i]
			b.mu.Lock()
			dp.taken, b.ds = b.ds, dp.taken[:0]
			b.mu.Unlock()
			for _, d := range dp.taken {
				dp.running--
				dp.finish(d)
			}
			more = more || len(dp.taken) > 0
			clear(dp.taken)
		}
	}
}

// admit takes a fetched delivery into the loop: into the in-flight list, and
// either to the ready queue or behind the busy key it is ordered on.
func (dp *dispatcher) admit(d *delivery) {
	l := dp.l
	dp.listPush(d)
	if d.gen != 0 && d.gen < dp.revokedGen[d.msg.Lane] {
		// Fetched before its lane was revoked, and handed over after.
		d.revoked = true
		dp.drop(d)
		return
	}
	dp.countPriorRuns(d)
	if dp.lanes != nil {
		ls := dp.lanes[d.msg.Lane]
		if ls == nil {
			c, cancel := context.WithCancel(dp.handlerCtx)
			ls = &laneState{ctx: c, cancel: cancel}
			dp.lanes[d.msg.Lane] = ls
		}
		d.ctx.Context = ls.ctx
	} else {
		d.ctx.Context = dp.handlerCtx
	}
	if dp.graceOver.Load() {
		dp.settle(d, driver.Return, 0)
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
		k := dp.orderKey(d)
		if dp.closedKeys[k] {
			// An earlier delivery of its key went back as the Run stops:
			// this one follows it back rather than overtake it.
			dp.settle(d, driver.Return, 0)
			return
		}
		if q, busy := dp.keys[k]; busy {
			dp.keys[k] = append(q, d)
			d.state = stateQueued
			dp.queued++
			return
		}
		dp.keys[k] = nil
	}
	d.state = stateReady
	dp.ready = append(dp.ready, d)
}

// countPriorRuns sets what is known of the message's runs before this
// delivery: what the broker carried, or what this loop noted when it
// returned the message, whichever covers more deliveries; each earlier
// delivery that neither covers counts as one run.
func (dp *dispatcher) countPriorRuns(d *delivery) {
	var prior driver.History
	if d.x != nil {
		prior = d.x.known
	}
	if dp.ledger != nil {
		// An entry counts only for a later delivery of the message it
		// recorded: a fresh message that reuses an id inherits nothing.
		if h, ok := dp.ledger.take(ledgerKey{d.msg.Source, d.msg.ID}); ok && h.Deliveries > prior.Deliveries && d.msg.Deliveries > h.Deliveries {
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
func (dp *dispatcher) finish(d *delivery) {
	l := dp.l
	if d.cut != nil {
		dp.requeueCut(d)
	}
	dp.releaseReservations(d)
	if d.revoked {
		dp.drop(d)
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
		dp.holdsBegin(d, held)
		dp.pauseFetching(held.Delay)
	} else if dp.holding && ran && err == nil {
		dp.holdsEnd()
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
			dp.dropped(d, "held after its ack (a retry inside the chain met an open breaker)", err)
		case err != nil:
			dp.countFailure(d, err)
			dp.dropped(d, "its run failed after the ack", err)
		}
		dp.leave(d)
		dp.releaseKey(d)
		return
	}
	switch {
	case err == errAckFailed:
		// At most once: not run, and perhaps acked. Let it go.
		dp.leave(d)
		dp.releaseKey(d)
	case err == errNotStarted:
		dp.settle(d, driver.Return, 0)
	case err == nil && late:
		// It returned after its context was cancelled: it may have stopped
		// short of its work, so let it run again.
		dp.settle(d, driver.Return, 0)
	case err == nil:
		dp.settle(d, driver.Ack, 0)
	case isHeld:
		if dp.shutting {
			dp.settle(d, driver.Return, held.Delay)
			return
		}
		dp.wait(d, time.Now().Add(held.Delay))
	case isDeferred:
		dp.deferRun(d, dp.redeliveryDelay(d, err))
	default:
		dp.fail(d, err)
	}
}

// fail applies a handler's failure: the message goes back to the broker
// with its delay, or, where the broker cannot take it back (a log), runs
// again here after the delay, holding its key so that nothing behind it
// overtakes it.
func (dp *dispatcher) fail(d *delivery, err error) {
	l := dp.l
	dp.countFailure(d, err)
	if d.rec.first.IsZero() {
		d.rec.first = time.Now()
	}
	delay := dp.redeliveryDelay(d, err)
	if l.caps.Redelivers || dp.shutting {
		dp.settle(d, driver.Return, delay)
		return
	}
	l.stats.retried.Add(1)
	d.rec.inPlace = true
	dp.wait(d, time.Now().Add(delay))
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
func (dp *dispatcher) pauseFetching(d time.Duration) {
	until := time.Now().Add(d).UnixNano()
	if until > dp.l.paused.Load() {
		dp.l.paused.Store(until)
	}
}

func (dp *dispatcher) countFailure(d *delivery, err error) {
	l := dp.l
	l.stats.failed.Add(1)
	var p *PanicError
	if errors.As(err, &p) {
		l.stats.panics.Add(1)
		dp.log.Error("ferry: handler panicked", "id", d.msg.ID, "attempt", d.msg.Attempt, "panic", p.Value, "stack", string(p.Stack))
		return
	}
	if IsPermanent(err) {
		dp.log.Error("ferry: permanent failure with no DeadLetter middleware to take it; returning the message for redelivery",
			"id", d.msg.ID, "attempt", d.msg.Attempt, "err", err)
		return
	}
	if ok, left := l.logs.Allow("failed:" + errorType(err)); ok {
		dp.log.Warn("ferry: handler failed; the message will run again", "source", d.msg.Source, "id", d.msg.ID,
			"attempt", d.msg.Attempt, "err", err, "error_type", errorType(err), "unlogged", left)
	}
}

// holdsBegin logs the first hold after a time without holds: the consumer
// pauses, keeping its messages and their attempts, while a breaker is open.
func (dp *dispatcher) holdsBegin(d *delivery, held *HeldError) {
	dp.heldSince++
	if dp.holding {
		return
	}
	dp.holding, dp.holdStart, dp.heldSince = true, time.Now(), 1
	dp.log.Warn("ferry: holding messages while a circuit breaker is open; fetching pauses, no attempt is spent",
		"source", d.msg.Source, "id", d.msg.ID, "hold", held.Delay, "err", held.Err)
}

// holdsEnd logs that a run succeeded after holds: consuming goes on.
func (dp *dispatcher) holdsEnd() {
	dp.log.Info("ferry: holds over; consuming again", "held_for", time.Since(dp.holdStart).Round(time.Millisecond),
		"holds", dp.heldSince)
	dp.holding = false
}

// dropped counts and logs (rate-limited) an at-most-once message lost
// after its ack.
func (dp *dispatcher) dropped(d *delivery, why string, err error) {
	dp.l.stats.dropped.Add(1)
	if ok, left := dp.l.logs.Allow("dropped:" + why); ok {
		dp.log.Warn("ferry: at-most-once message dropped: "+why, "id", d.msg.ID, "source", d.msg.Source,
			"attempt", d.msg.Attempt, "err", err, "dropped_unlogged", left)
	}
}

// redeliveryDelay is the delay an error asks for (RetryAfter, Defer), or the
// loop's backoff for the number of runs made.
func (dp *dispatcher) redeliveryDelay(d *delivery, err error) time.Duration {
	var ra *RetryAfterError
	if errors.As(err, &ra) {
		return ra.Delay
	}
	var de *DeferredError
	if errors.As(err, &de) {
		return de.Delay
	}
	c := dp.l.cfg
	delay := c.backoffMin
	for i := 1; i < d.runs && delay < c.backoffMax; i++ {
		delay *= 2
	}
	return min(delay, c.backoffMax)
}

// orderKey is what an ordered delivery is serialised on: its lane alone
// (OrderByLane) or its lane and key (OrderByKey).
func (dp *dispatcher) orderKey(d *delivery) orderKey {
	if dp.l.cfg.ordering == OrderByKey {
		return orderKey{lane: d.msg.Lane, key: d.msg.Key}
	}
	return orderKey{lane: d.msg.Lane}
}

// releaseKey lets the next delivery queued behind d's key run.
func (dp *dispatcher) releaseKey(d *delivery) {
	if !d.ordered || d.passKey {
		return
	}
	k := dp.orderKey(d)
	q, ok := dp.keys[k]
	if !ok {
		return
	}
	if len(q) == 0 {
		delete(dp.keys, k)
		return
	}
	next := q[0]
	q[0] = nil
	dp.keys[k] = q[1:]
	dp.queued--
	next.state = stateReady
	dp.ready = append(dp.ready, next)
}

// takeFollowers removes and returns what waits behind d's key, freeing the
// key.
func (dp *dispatcher) takeFollowers(d *delivery) []*delivery {
	if !d.ordered || d.passKey {
		return nil
	}
	k := dp.orderKey(d)
	q := dp.keys[k]
	delete(dp.keys, k)
	dp.queued -= len(q)
	return q
}

// looseTrain is a train of unordered deliveries given to one worker with the
// delivery ahead of them (see peekTrain). The worker claims them one at a
// time as it goes; when another worker is idle with nothing ready, the
// dispatcher takes back what is unclaimed (rebalance), so that a slow
// handler at the head of a train keeps no other delivery waiting for it.
type looseTrain struct {
	ds    []*delivery
	taken atomic.Int32 // deliveries of ds claimed (by the worker, or taken back); may pass len(ds)
}

// claim returns the next delivery of the train for the worker to run, or nil
// when none is left to it.
func (lt *looseTrain) claim() *delivery {
	if i := int(lt.taken.Add(1)) - 1; i < len(lt.ds) {
		return lt.ds[i]
	}
	return nil
}

// rest claims every delivery of the train not yet claimed, and returns them.
func (lt *looseTrain) rest() []*delivery {
	if i := int(lt.taken.Swap(int32(len(lt.ds)))); i < len(lt.ds) {
		return lt.ds[i:]
	}
	return nil
}

// claimed reports whether nothing of the train is left to claim.
func (lt *looseTrain) claimed() bool { return int(lt.taken.Load()) >= len(lt.ds) }

// rebalance takes back the unclaimed rest of every train of unordered
// deliveries when a worker waits with nothing ready or queued for it: a
// train that a slow handler holds up goes to the workers that are free.
func (dp *dispatcher) rebalance() {
	if len(dp.looseTrains) == 0 || len(dp.ready) > 0 || int(dp.idle.Load()) <= len(dp.work) {
		return
	}
	dp.takeBackLoose()
}

// takeBackLoose takes back the unclaimed rest of every train of unordered
// deliveries, to the head of the ready queue.
func (dp *dispatcher) takeBackLoose() {
	for _, lt := range dp.looseTrains {
		if rest := lt.rest(); len(rest) > 0 {
			dp.running -= len(rest)
			dp.readyAgain(rest)
		}
	}
	clear(dp.looseTrains)
	dp.looseTrains = dp.looseTrains[:0]
}

// readyAgain puts unordered deliveries taken back from a worker unrun at
// the head of the ready queue, in order, but those whose lane was revoked
// meanwhile, which go.
func (dp *dispatcher) readyAgain(ds []*delivery) {
	live := make([]*delivery, 0, len(ds)+len(dp.ready))
	for _, c := range ds {
		if c.revoked {
			dp.drop(c)
			continue
		}
		c.state = stateReady
		live = append(live, c)
	}
	dp.ready = append(live, dp.ready...)
}
