package consumer

import (
	"container/heap"
	"context"
	"errors"
	"log/slog"
	"slices"
	"sync/atomic"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
)

// This file is the dispatcher: the one goroutine of a Run that owns every
// delivery's state. It admits fetched deliveries, hands them to workers,
// applies their outcomes, parks retries and held messages, renews leases,
// handles revocations and drains on shutdown. The goroutines around it
// (fetcher, workers, the I/O goroutine) are in workers.go.

// delivery is one message while the loop holds it. The dispatcher goroutine
// owns every field except err, which the worker running it writes before it
// hands the delivery back.
type delivery struct {
	msg    Message
	handle any
	ctx    context.Context // the handler's context: the lane's, or the loop's

	orderKey string // the key it is serialised on, when ordered
	ordered  bool

	err     error     // the handler's result, written by the worker
	leaseAt time.Time // when its lease runs out (drivers with leases)
	due     time.Time // when a waiting delivery runs again
	heapIdx int
	acked   bool // at most once: acked when it was handed to a worker
	revoked bool
	awaited []*revocationWait // revocations waiting for this running handler

	prev, next *delivery // the list of everything in flight, for lease extension and revocation
}

type laneState struct {
	ctx    context.Context
	cancel context.CancelFunc
}

// ioJob is one round of broker calls for the I/O goroutine: lease
// extensions first, then settlements, so an extension never lands after the
// return of the same message (SQS would otherwise undo the return's delay).
type ioJob struct {
	extend  []any
	settle  []driver.Settlement
	release int // in-flight slots freed once the settlements are done
}

// revocationWait is a revocation whose Done waits for the running handlers
// of its lanes to return and for the outcomes decided before it to reach the
// driver.
type revocationWait struct {
	done    chan struct{}
	pending int    // running handlers of the revoked lanes
	ioJobs  uint64 // I/O jobs that must be done first
}

// dueHeap orders waiting deliveries (in-place retries and held messages)
// by when they run again.
type dueHeap []*delivery

func (h dueHeap) Len() int           { return len(h) }
func (h dueHeap) Less(i, j int) bool { return h[i].due.Before(h[j].due) }
func (h dueHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i]; h[i].heapIdx = i; h[j].heapIdx = j }
func (h *dueHeap) Push(x any)        { d := x.(*delivery); d.heapIdx = len(*h); *h = append(*h, d) }
func (h *dueHeap) Pop() any {
	old := *h
	d := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	d.heapIdx = -1
	return d
}

// errNotStarted is the outcome of a delivery that a worker picked up after
// shutdown began and so never ran.
var errNotStarted = errors.New("not started: consumer stopping")

// run is the state of one Run call, owned by the dispatcher goroutine.
type run struct {
	l   *Loop
	h   Handler
	log *slog.Logger

	handlerCtx    context.Context // parent of every handler's context
	cancelHandler context.CancelFunc
	ioCtx         context.Context // of settle and extend calls: outlives Run's context

	work    chan *delivery
	done    chan *delivery
	fetched chan []*delivery
	back    chan []*delivery
	fatal   chan error
	abandon chan struct{} // closed when Run stops listening

	ioCh          chan ioJob
	ioBack        chan ioJob
	pending       ioJob // the next job, being filled
	spare         ioJob // buffers of the last job, for reuse
	ioBusy        bool
	ioSent, ioRet uint64

	ready   []*delivery
	keys    map[string][]*delivery // busy keys and the deliveries queued behind them
	waiting dueHeap
	timer   *time.Timer
	head    delivery // sentinel of the in-flight list
	lanes   map[string]*laneState
	running int

	revocations []*revocationWait
	shutting    bool
	graceOver   bool
	stopping    atomic.Bool // shutting, for the workers
}

func newRun(l *Loop, h Handler, ctx context.Context) *run {
	work := make(chan *delivery, l.cfg.concurrency)
	if l.cfg.mode == AtMostOnce {
		// A message is acked when a worker takes it, so a worker must
		// take it only when it is free to run it at once.
		work = make(chan *delivery)
	}
	r := &run{
		l:       l,
		h:       h,
		log:     l.cfg.logger.With("consumer", l.cfg.name),
		work:    work,
		done:    make(chan *delivery, l.cfg.concurrency),
		fetched: make(chan []*delivery),
		back:    make(chan []*delivery),
		fatal:   make(chan error, 1),
		abandon: make(chan struct{}),
		ioCh:    make(chan ioJob),
		ioBack:  make(chan ioJob),
		keys:    make(map[string][]*delivery),
		timer:   time.NewTimer(time.Hour),
	}
	r.timer.Stop()
	r.head.next, r.head.prev = &r.head, &r.head
	r.ioCtx = context.WithoutCancel(ctx)
	r.handlerCtx, r.cancelHandler = context.WithCancel(context.WithValue(r.ioCtx, nameKey{}, l.cfg.name))
	if l.revoker != nil {
		r.lanes = make(map[string]*laneState)
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
		graceC      <-chan time.Time
		abandonC    <-chan time.Time
		fatalErr    error
		fetcherOver bool
		graceTimer  *time.Timer
	)
	defer func() {
		if graceTimer != nil {
			graceTimer.Stop()
		}
	}()
	if l.revoker != nil {
		revoked = l.revoker.Revoked()
	}
	if l.extender != nil {
		t := time.NewTicker(max(l.extender.Lease()/6, 10*time.Millisecond))
		defer t.Stop()
		extendTick = t.C
	}
	beginShutdown := func() {
		if r.shutting {
			return
		}
		r.shutting = true
		r.stopping.Store(true)
		ctxDone = nil
		stopFetch()
		r.returnNotStarted()
		graceTimer = time.NewTimer(l.cfg.grace)
		graceC = graceTimer.C
	}

	for {
		if r.shutting && fetcherOver && r.running == 0 {
			return fatalErr
		}
		var (
			workC chan *delivery
			next  *delivery
			ioC   chan ioJob
		)
		if len(r.ready) > 0 {
			workC, next = r.work, r.ready[0]
		}
		if !r.ioBusy && r.pending.hasWork() {
			ioC = r.ioCh
		}

		select {
		case workC <- next:
			r.ready[0] = nil
			r.ready = r.ready[1:]
			r.running++
			if l.cfg.mode == AtMostOnce {
				r.settle(next, driver.Ack, 0, false)
				next.acked = true
			}

		case d := <-r.done:
			r.running--
			r.finish(d)

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
			beginShutdown()

		case ioC <- r.pending:
			r.ioBusy = true
			r.ioSent++
			r.pending = ioJob{extend: r.spare.extend[:0], settle: r.spare.settle[:0]}
			r.spare = ioJob{}

		case job := <-r.ioBack:
			r.ioBusy = false
			r.ioRet++
			r.spare = job
			r.checkRevocations()

		case <-r.timer.C:
			r.wakeDue()

		case <-extendTick:
			r.extendLeases()

		case rev := <-revoked:
			r.revoke(rev)

		case <-ctxDone:
			beginShutdown()

		case <-graceC:
			graceC = nil
			r.graceOver = true
			if r.running > 0 {
				r.log.Warn("ferry: shutdown grace over; cancelling running handlers", "running", r.running)
			}
			r.cancelHandler()
			abandonC = time.After(time.Second)

		case <-abandonC:
			r.log.Warn("ferry: handlers ignored cancellation; leaving their messages for redelivery", "running", r.running)
			return fatalErr
		}
	}
}

func (j *ioJob) hasWork() bool { return len(j.settle) > 0 || len(j.extend) > 0 || j.release > 0 }

// flushIO waits for the I/O goroutine to finish its job, then hands it the
// last one and waits for that too. Run calls it after dispatch returned.
func (r *run) flushIO() {
	if r.ioBusy {
		r.spare = <-r.ioBack
		r.ioBusy = false
		r.ioRet++
	}
	if r.pending.hasWork() {
		r.ioCh <- r.pending
		r.ioSent++
		<-r.ioBack
		r.ioRet++
	}
	r.checkRevocations()
}

// admit takes a fetched delivery into the loop: into the in-flight list, and
// either to the ready queue or behind the busy key it is ordered on.
func (r *run) admit(d *delivery) {
	l := r.l
	r.listPush(d)
	if r.lanes != nil {
		ls := r.lanes[d.msg.Lane]
		if ls == nil {
			c, cancel := context.WithCancel(r.handlerCtx)
			ls = &laneState{ctx: c, cancel: cancel}
			r.lanes[d.msg.Lane] = ls
		}
		d.ctx = ls.ctx
	} else {
		d.ctx = r.handlerCtx
	}
	if r.shutting {
		r.settle(d, driver.Return, 0, true)
		return
	}
	switch l.cfg.ordering {
	case OrderByLane:
		if d.msg.Lane != "" {
			d.ordered, d.orderKey = true, d.msg.Lane
		}
	case OrderByKey:
		d.ordered = true
		if d.msg.Lane == "" {
			d.orderKey = d.msg.Key
		} else {
			d.orderKey = d.msg.Lane + "\x00" + d.msg.Key
		}
	}
	if d.ordered {
		if q, busy := r.keys[d.orderKey]; busy {
			r.keys[d.orderKey] = append(q, d)
			return
		}
		r.keys[d.orderKey] = nil
	}
	r.ready = append(r.ready, d)
}

// finish applies a handler's outcome.
func (r *run) finish(d *delivery) {
	l := r.l
	if d.revoked {
		r.dropRevoked(d)
		return
	}
	err := d.err
	d.err = nil
	held, isHeld := asHeld(err)
	if isHeld {
		l.stats.held.Add(1)
		r.pauseFetching(held.Delay)
	}
	if d.acked {
		// At most once: acked before it ran, so whatever happened is final.
		switch {
		case isHeld:
			r.log.Warn("ferry: at-most-once message held by an open breaker is dropped", "id", d.msg.ID)
		case err != nil && err != errNotStarted:
			r.countFailure(d, err)
		}
		r.listRemove(d)
		r.releaseKey(d)
		r.pending.release++
		return
	}
	switch {
	case err == errNotStarted:
		r.settle(d, driver.Return, 0, true)
		return
	case err == nil && r.graceOver:
		// It returned after its context was cancelled: it may have stopped
		// short of its work, so let it run again.
		r.settle(d, driver.Return, 0, true)
		return
	case err == nil:
		r.settle(d, driver.Ack, 0, true)
		return
	case isHeld:
		if r.shutting {
			r.settle(d, driver.Return, 0, true)
			return
		}
		r.wait(d, time.Now().Add(held.Delay))
		return
	}
	delay := r.redeliveryDelay(d, err)
	if IsDeferred(err) {
		// Deferred: keep it and run it again here after the delay. Returning
		// it would make a broker that counts deliveries (SQS, quorum queues)
		// count an attempt the handler never made.
		if r.shutting {
			r.settle(d, driver.Return, delay, true)
			return
		}
		l.stats.deferred.Add(1)
		r.wait(d, time.Now().Add(delay))
		return
	}
	r.countFailure(d, err)
	if l.caps.Redelivers || r.shutting {
		r.settle(d, driver.Return, delay, true)
		return
	}
	// A log cannot take the message back: run it again here after the
	// delay, holding its key so that nothing behind it overtakes it.
	l.stats.retried.Add(1)
	d.msg.Attempt++
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
	r.log.Debug("ferry: handler failed", "id", d.msg.ID, "attempt", d.msg.Attempt, "err", err)
}

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
	for i := 1; i < d.msg.Attempt && delay < c.backoffMax; i++ {
		delay *= 2
	}
	return min(delay, c.backoffMax)
}

// settle queues an outcome for the I/O goroutine. release says whether the
// delivery leaves the loop once it is settled.
func (r *run) settle(d *delivery, a driver.Action, delay time.Duration, release bool) {
	r.pending.settle = append(r.pending.settle, driver.Settlement{Handle: d.handle, Action: a, Delay: delay})
	if a == driver.Ack {
		r.l.stats.acked.Add(1)
	} else {
		r.l.stats.returned.Add(1)
	}
	if !release {
		return
	}
	r.pending.release++
	r.listRemove(d)
	if a == driver.Return && d.ordered && !r.shutting {
		// Whatever waits behind a returned message must not overtake it:
		// return it too, with the same delay.
		for _, f := range r.keys[d.orderKey] {
			r.pending.settle = append(r.pending.settle, driver.Settlement{Handle: f.handle, Action: driver.Return, Delay: delay})
			r.l.stats.returned.Add(1)
			r.pending.release++
			r.listRemove(f)
		}
		delete(r.keys, d.orderKey)
		return
	}
	r.releaseKey(d)
}

// releaseKey lets the next delivery queued behind d's key run.
func (r *run) releaseKey(d *delivery) {
	if !d.ordered {
		return
	}
	q, ok := r.keys[d.orderKey]
	if !ok {
		return
	}
	for len(q) > 0 {
		next := q[0]
		q[0] = nil
		q = q[1:]
		if next.revoked {
			continue
		}
		r.keys[d.orderKey] = q
		r.ready = append(r.ready, next)
		return
	}
	delete(r.keys, d.orderKey)
}

// wait parks a delivery until 'until', keeping its key busy.
func (r *run) wait(d *delivery, until time.Time) {
	d.due = until
	heap.Push(&r.waiting, d)
	r.resetTimer()
}

func (r *run) resetTimer() {
	if len(r.waiting) == 0 {
		r.timer.Stop()
		return
	}
	r.timer.Reset(max(time.Until(r.waiting[0].due), 0))
}

// wakeDue moves every waiting delivery whose time has come to the ready
// queue.
func (r *run) wakeDue() {
	now := time.Now()
	for len(r.waiting) > 0 && !r.waiting[0].due.After(now) {
		r.ready = append(r.ready, heap.Pop(&r.waiting).(*delivery))
	}
	r.resetTimer()
}

// returnNotStarted gives back to the broker every delivery that no handler
// has started: queued behind a key, ready, or waiting for a retry.
func (r *run) returnNotStarted() {
	// Take the key queues away first, so that returning a ready delivery
	// does not promote the one behind it into the ready queue.
	keys := r.keys
	r.keys = make(map[string][]*delivery)
	for _, q := range keys {
		for _, d := range q {
			if !d.revoked {
				r.settle(d, driver.Return, 0, true)
			}
		}
	}
	for _, d := range r.ready {
		r.settle(d, driver.Return, 0, true)
	}
	r.ready = nil
	for _, d := range r.waiting {
		d.heapIdx = -1
		r.settle(d, driver.Return, 0, true)
	}
	r.waiting = nil
	r.timer.Stop()
}

// extendLeases renews the lease of every delivery whose lease is two thirds
// gone: running, queued, held or waiting to run again. The renewal goes out
// with the next I/O job.
func (r *run) extendLeases() {
	if len(r.pending.extend) > 0 {
		return // the last round has not gone out yet
	}
	lease := r.l.extender.Lease()
	now := time.Now()
	renewBefore := now.Add(lease * 2 / 3)
	for d := r.head.next; d != &r.head; d = d.next {
		if !d.acked && d.leaseAt.Before(renewBefore) {
			r.pending.extend = append(r.pending.extend, d.handle)
			d.leaseAt = now.Add(lease)
		}
	}
}

// revoke lets go of every delivery in the revoked lanes: running handlers
// have their context cancelled and their outcome ignored; queued ones are
// dropped. Nothing of theirs is settled from now on. Done closes once the
// running ones have returned and the outcomes decided before the revocation
// have reached the driver.
func (r *run) revoke(rev driver.Revocation) {
	rw := &revocationWait{done: rev.Done, ioJobs: r.ioSent}
	if r.pending.hasWork() {
		rw.ioJobs++ // the job being filled now goes out next
	}
	lanes := make(map[string]bool, len(rev.Lanes))
	for _, lane := range rev.Lanes {
		lanes[lane] = true
		if ls := r.lanes[lane]; ls != nil {
			ls.cancel()
			delete(r.lanes, lane)
		}
	}
	queued := make(map[*delivery]bool)
	for _, d := range r.ready {
		queued[d] = true
	}
	for _, q := range r.keys {
		for _, d := range q {
			queued[d] = true
		}
	}
	for _, d := range r.waiting {
		queued[d] = true
	}
	for d := r.head.next; d != &r.head; {
		next := d.next
		if lanes[d.msg.Lane] {
			switch {
			case queued[d]:
				d.revoked = true
				r.dropRevoked(d)
			default: // running, perhaps already revoked by an earlier revocation
				d.revoked = true
				d.awaited = append(d.awaited, rw)
				rw.pending++
			}
		}
		d = next
	}
	r.ready = filterRevoked(r.ready)
	for k, q := range r.keys {
		if lanes[laneOfKey(k, r.l.cfg.ordering)] {
			delete(r.keys, k)
			continue
		}
		r.keys[k] = filterRevoked(q)
	}
	w := r.waiting[:0]
	for _, d := range r.waiting {
		if !d.revoked {
			w = append(w, d)
		}
	}
	r.waiting = w
	heap.Init(&r.waiting)
	r.resetTimer()
	r.revocations = append(r.revocations, rw)
	r.checkRevocations()
}

// checkRevocations closes the Done of every revocation that has nothing
// left to wait for.
func (r *run) checkRevocations() {
	r.revocations = slices.DeleteFunc(r.revocations, func(rw *revocationWait) bool {
		if rw.pending > 0 || r.ioRet < rw.ioJobs {
			return false
		}
		if rw.done != nil {
			close(rw.done)
		}
		return true
	})
}

// closeRevocations closes what revocations still wait when Run ends: the
// handlers they wait for were abandoned.
func (r *run) closeRevocations() {
	for _, rw := range r.revocations {
		if rw.done != nil {
			close(rw.done)
		}
	}
	r.revocations = nil
}

func laneOfKey(k string, o Ordering) string {
	if o == OrderByKey {
		for i := 0; i < len(k); i++ {
			if k[i] == 0 {
				return k[:i]
			}
		}
		return ""
	}
	return k
}

func filterRevoked(q []*delivery) []*delivery {
	out := q[:0]
	for _, d := range q {
		if !d.revoked {
			out = append(out, d)
		}
	}
	for i := len(out); i < len(q); i++ {
		q[i] = nil
	}
	return out
}

// dropRevoked frees a revoked delivery's slot without settling it.
func (r *run) dropRevoked(d *delivery) {
	r.l.stats.revoked.Add(1)
	r.listRemove(d)
	r.pending.release++
	if len(d.awaited) > 0 {
		for _, rw := range d.awaited {
			rw.pending--
		}
		d.awaited = nil
		r.checkRevocations()
	}
}

func (r *run) listPush(d *delivery) {
	if r.l.extender != nil {
		d.leaseAt = time.Now().Add(r.l.extender.Lease())
	}
	d.prev = r.head.prev
	d.next = &r.head
	r.head.prev.next = d
	r.head.prev = d
}

func (r *run) listRemove(d *delivery) {
	if d.next == nil {
		return
	}
	d.prev.next = d.next
	d.next.prev = d.prev
	d.prev, d.next = nil, nil
}
