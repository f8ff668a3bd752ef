package consumer

import (
	"container/heap"
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"runtime/debug"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
)

// ErrAlreadyRun is returned by a second call to Loop.Run: a Loop runs once
// and closes its driver when Run returns.
var ErrAlreadyRun = errors.New("ferry: consumer already run")

// ErrLagUnsupported is returned by Loop.Lag when the driver cannot report lag.
var ErrLagUnsupported = errors.New("ferry: driver does not report lag")

// Lag is how far a consumer is behind its broker.
type Lag = driver.Lag

// Loop is the delivery loop over one driver: the Consumer every broker
// adapter returns. Build one with New; run it once with Run.
type Loop struct {
	drv      driver.Driver
	cfg      config
	caps     driver.Capabilities
	extender driver.Extender // nil when the broker keeps no lease
	revoker  driver.Revoker  // nil when the broker never revokes

	ran      atomic.Bool
	inflight atomic.Int64 // deliveries taken and not yet settled or dropped
	paused   atomic.Int64 // unix nanos until which fetching pauses (a breaker is open)
	space    chan struct{}

	stats struct {
		fetched, acked, returned, failed, panics, held, retried, revoked atomic.Int64
		fetchErrors, settleErrors, running                               atomic.Int64
	}
}

// Stats is a snapshot of a Loop's counters.
type Stats struct {
	Fetched      int64 // deliveries taken from the broker
	Acked        int64 // deliveries acknowledged
	Returned     int64 // deliveries returned to the broker for redelivery
	Failed       int64 // handler runs that returned an error (panics included)
	Panics       int64 // handler runs that panicked
	Held         int64 // handler runs held by a circuit breaker (not attempts)
	Retried      int64 // in-place re-runs (brokers that cannot redeliver)
	Revoked      int64 // deliveries let go because the broker revoked their lane
	FetchErrors  int64 // failed fetches
	SettleErrors int64 // failed settle or extend calls
	InFlight     int64 // deliveries held now, unsettled
	Running      int64 // handlers running now
}

// New returns a delivery loop over drv. It fails with a *ConfigError naming
// the field when an option is invalid or drv is nil.
func New(drv driver.Driver, opts ...Option) (*Loop, error) {
	if drv == nil {
		return nil, configErr("Driver", "must not be nil")
	}
	cfg, err := buildConfig(opts)
	if err != nil {
		return nil, err
	}
	l := &Loop{drv: drv, cfg: cfg, caps: drv.Capabilities(), space: make(chan struct{}, 1)}
	if e, ok := drv.(driver.Extender); ok && e.Lease() > 0 {
		l.extender = e
	}
	if r, ok := drv.(driver.Revoker); ok {
		l.revoker = r
	}
	return l, nil
}

// Name is the consumer's name, as set by WithName.
func (l *Loop) Name() string { return l.cfg.name }

// Stats returns a snapshot of the loop's counters. It is safe to call at any
// time from any goroutine.
func (l *Loop) Stats() Stats {
	s := &l.stats
	return Stats{
		Fetched: s.fetched.Load(), Acked: s.acked.Load(), Returned: s.returned.Load(),
		Failed: s.failed.Load(), Panics: s.panics.Load(), Held: s.held.Load(),
		Retried: s.retried.Load(), Revoked: s.revoked.Load(),
		FetchErrors: s.fetchErrors.Load(), SettleErrors: s.settleErrors.Load(),
		InFlight: l.inflight.Load(), Running: s.running.Load(),
	}
}

// Lag asks the broker how far this consumer is behind. It returns
// ErrLagUnsupported when the driver cannot tell.
func (l *Loop) Lag(ctx context.Context) (Lag, error) {
	r, ok := l.drv.(driver.LagReporter)
	if !ok {
		return Lag{}, ErrLagUnsupported
	}
	return r.Lag(ctx)
}

type nameKey struct{}

// ConsumerName returns the name (WithName) of the Loop whose handler got
// ctx, or "ferry" when ctx did not come from a Loop. Middleware uses it to
// namespace keys and label dead letters.
func ConsumerName(ctx context.Context) string {
	if n, ok := ctx.Value(nameKey{}).(string); ok {
		return n
	}
	return "ferry"
}

// delivery is one message while the loop holds it. The dispatcher goroutine
// owns every field except err, which the worker running it writes before it
// hands the delivery back.
type delivery struct {
	msg    Message
	handle any
	ctx    context.Context // the handler's context: the lane's, or the loop's
	lane   *laneState      // nil unless the driver revokes lanes

	orderKey string // the key it is serialised on; "" when unordered
	ordered  bool

	err     error     // the handler's result, written by the worker
	leaseAt time.Time // when its lease runs out (drivers with leases)
	due     time.Time // when a waiting delivery runs again
	heapIdx int
	held    bool // waiting because a breaker held it
	revoked bool
	awaited *revocationWait // the revocation waiting for this running handler

	prev, next *delivery // the list of everything in flight, for lease extension and revocation
}

type laneState struct {
	ctx    context.Context
	cancel context.CancelFunc
}

type settleBatch struct {
	s       []driver.Settlement
	release int // slots freed once the batch is settled
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

// run is the state of one Run call, owned by the dispatcher goroutine.
type run struct {
	l   *Loop
	h   Handler
	log *slog.Logger

	handlerCtx    context.Context // parent of every handler's context
	cancelHandler context.CancelFunc

	work    chan *delivery
	done    chan *delivery
	fetched chan []*delivery
	back    chan []*delivery
	fatal   chan error
	abandon chan struct{}

	settleCh   chan settleBatch
	settleBack chan []driver.Settlement
	pending    settleBatch
	spare      []driver.Settlement
	settling   bool

	extendCh chan []any

	ready   []*delivery
	keys    map[string][]*delivery // busy keys and the deliveries queued behind them
	waiting dueHeap
	timer   *time.Timer
	head    delivery // sentinel of the in-flight list
	lanes   map[string]*laneState
	running int

	revocations []*revocationWait
	shutting    bool
	stopping    atomic.Bool // shutting, for the workers
}

// errNotStarted is the outcome of a delivery that a worker picked up after
// shutdown began and so never ran.
var errNotStarted = errors.New("not started: consumer stopping")

type revocationWait struct {
	done    chan struct{}
	pending int
}

// Run delivers messages to h until ctx ends, then drains: it stops
// fetching, returns every message not yet started to the broker, lets
// running handlers finish for the shutdown grace period (acking those that
// succeed), cancels the contexts of those still running after it and leaves
// their messages for redelivery. It closes the driver before it returns.
//
// Run returns nil after a clean shutdown, and an error only when the
// driver reports a fatal one. A Loop runs once: a second call returns
// ErrAlreadyRun.
func (l *Loop) Run(ctx context.Context, h Handler) error {
	if h == nil {
		return configErr("Handler", "must not be nil")
	}
	if !l.ran.CompareAndSwap(false, true) {
		return ErrAlreadyRun
	}
	defer l.drv.Close()
	if reg, err := l.registerMetrics(); err != nil {
		l.cfg.logger.Warn("ferry: metrics unavailable", "consumer", l.cfg.name, "err", err)
	} else {
		defer reg.Unregister()
	}

	r := &run{
		l:          l,
		h:          h,
		log:        l.cfg.logger.With("consumer", l.cfg.name),
		work:       make(chan *delivery, l.cfg.concurrency),
		done:       make(chan *delivery, l.cfg.concurrency),
		fetched:    make(chan []*delivery),
		back:       make(chan []*delivery),
		fatal:      make(chan error, 1),
		abandon:    make(chan struct{}),
		settleCh:   make(chan settleBatch),
		settleBack: make(chan []driver.Settlement),
		extendCh:   make(chan []any),
		keys:       make(map[string][]*delivery),
		timer:      time.NewTimer(time.Hour),
	}
	r.timer.Stop()
	r.head.next, r.head.prev = &r.head, &r.head
	r.handlerCtx, r.cancelHandler = context.WithCancel(
		context.WithValue(context.WithoutCancel(ctx), nameKey{}, l.cfg.name))
	defer r.cancelHandler()
	if l.revoker != nil {
		r.lanes = make(map[string]*laneState)
	}

	fetchCtx, stopFetch := context.WithCancel(ctx)
	defer stopFetch()
	var wg sync.WaitGroup
	fetcherDone := make(chan struct{})
	go func() { defer close(fetcherDone); r.fetchLoop(fetchCtx) }()
	for i := 0; i < l.cfg.concurrency; i++ {
		wg.Add(1)
		go func() { defer wg.Done(); r.worker() }()
	}
	settlerDone := make(chan struct{})
	go func() { defer close(settlerDone); r.settler() }()
	extenderDone := make(chan struct{})
	go func() { defer close(extenderDone); r.extenderLoop() }()

	err := r.dispatch(ctx, stopFetch, fetcherDone)

	// Hand the last settlements over and wait for them, so that what
	// finished is acked before Run returns.
	if r.settling {
		r.spare = <-r.settleBack
		r.settling = false
	}
	if len(r.pending.s) > 0 || r.pending.release > 0 {
		r.settleCh <- r.pending
		<-r.settleBack
	}
	close(r.settleCh)
	<-settlerDone
	close(r.extendCh)
	<-extenderDone
	close(r.abandon)
	close(r.work)
	if r.running == 0 {
		wg.Wait()
	}
	r.timer.Stop()
	for _, rw := range r.revocations {
		if rw.done != nil {
			close(rw.done)
		}
	}
	return err
}

// dispatch is the loop's single owner of state: it routes fetched
// deliveries, hands them to workers, applies outcomes and drains on
// shutdown.
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
			workC   chan *delivery
			next    *delivery
			settleC chan settleBatch
		)
		if len(r.ready) > 0 {
			workC, next = r.work, r.ready[0]
		}
		if !r.settling && (len(r.pending.s) > 0 || r.pending.release > 0) {
			settleC = r.settleCh
		}

		select {
		case workC <- next:
			r.ready[0] = nil
			r.ready = r.ready[1:]
			r.running++
			if l.cfg.mode == AtMostOnce {
				r.settle(next, driver.Ack, 0, false)
				r.listRemove(next) // acked: no lease to keep
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

		case settleC <- r.pending:
			r.settling = true
			r.pending = settleBatch{s: r.spare[:0]}
			r.spare = nil

		case buf := <-r.settleBack:
			r.settling = false
			r.spare = buf[:0]

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
		d.lane, d.ctx = ls, ls.ctx
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
	if err == errNotStarted {
		if l.cfg.mode == AtMostOnce {
			// Already acked when it was handed to the worker.
			r.listRemove(d)
			r.releaseKey(d)
			r.pending.release++
			return
		}
		r.settle(d, driver.Return, 0, true)
		return
	}
	if l.cfg.mode == AtMostOnce {
		// Acked before it ran; a failure here is lost by choice.
		if err != nil {
			r.countFailure(d, err)
		}
		r.listRemove(d)
		r.releaseKey(d)
		r.pending.release++
		return
	}
	if err == nil {
		r.settle(d, driver.Ack, 0, true)
		return
	}
	var held *HeldError
	if errors.As(err, &held) {
		l.stats.held.Add(1)
		until := time.Now().Add(held.Delay)
		if p := until.UnixNano(); p > l.paused.Load() {
			l.paused.Store(p)
		}
		if r.shutting {
			r.settle(d, driver.Return, 0, true)
			return
		}
		d.held = true
		r.wait(d, until)
		return
	}
	r.countFailure(d, err)
	delay := r.redeliveryDelay(d, err)
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
	c := r.l.cfg
	delay := c.backoffMin
	for i := 1; i < d.msg.Attempt && delay < c.backoffMax; i++ {
		delay *= 2
	}
	return min(delay, c.backoffMax)
}

// settle queues an outcome for the settler. release says whether the
// delivery's slot frees once it is settled.
func (r *run) settle(d *delivery, a driver.Action, delay time.Duration, release bool) {
	r.pending.s = append(r.pending.s, driver.Settlement{Handle: d.handle, Action: a, Delay: delay})
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
			r.pending.s = append(r.pending.s, driver.Settlement{Handle: f.handle, Action: driver.Return, Delay: delay})
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
		d := heap.Pop(&r.waiting).(*delivery)
		d.held = false
		r.ready = append(r.ready, d)
	}
	r.resetTimer()
}

// returnNotStarted gives back to the broker every delivery that no handler
// has started: queued, waiting behind a key, or waiting for a retry.
func (r *run) returnNotStarted() {
	for _, d := range r.ready {
		r.settle(d, driver.Return, 0, true)
	}
	r.ready = nil
	for k, q := range r.keys {
		for _, d := range q {
			r.settle(d, driver.Return, 0, true)
		}
		delete(r.keys, k)
	}
	for _, d := range r.waiting {
		d.heapIdx = -1
		r.settle(d, driver.Return, 0, true)
	}
	r.waiting = nil
	r.timer.Stop()
}

// extendLeases renews the lease of every delivery whose lease is two thirds
// gone: running, queued, held or waiting to run again.
func (r *run) extendLeases() {
	lease := r.l.extender.Lease()
	now := time.Now()
	renewBefore := now.Add(lease * 2 / 3)
	var handles []any
	for d := r.head.next; d != &r.head; d = d.next {
		if d.leaseAt.Before(renewBefore) {
			handles = append(handles, d.handle)
		}
	}
	if len(handles) == 0 {
		return
	}
	select {
	case r.extendCh <- handles:
		for d := r.head.next; d != &r.head; d = d.next {
			if d.leaseAt.Before(renewBefore) {
				d.leaseAt = now.Add(lease)
			}
		}
	default:
		// The extender is still busy with the last round; try next tick.
	}
}

// revoke lets go of every delivery in the revoked lanes: running handlers
// have their context cancelled and their outcome ignored; queued ones are
// dropped. Nothing of theirs is settled.
func (r *run) revoke(rev driver.Revocation) {
	rw := &revocationWait{done: rev.Done}
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
			d.revoked = true
			if queued[d] {
				r.dropRevoked(d)
			} else {
				rw.pending++ // running: let go when its handler returns
				d.awaited = rw
			}
		}
		d = next
	}
	// Purge dropped deliveries from the queues.
	r.ready = filterRevoked(r.ready)
	for k, q := range r.keys {
		r.keys[k] = filterRevoked(q)
	}
	for k := range r.keys {
		if lanes[laneOfKey(k, r.l.cfg.ordering)] {
			delete(r.keys, k)
		}
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
	if rw.pending == 0 {
		if rw.done != nil {
			close(rw.done)
		}
		return
	}
	r.revocations = append(r.revocations, rw)
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
	if rw := d.awaited; rw != nil {
		d.awaited = nil
		rw.pending--
		if rw.pending == 0 {
			if rw.done != nil {
				close(rw.done)
			}
			r.revocations = slices.DeleteFunc(r.revocations, func(x *revocationWait) bool { return x == rw })
		}
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

// worker runs handlers.
func (r *run) worker() {
	for d := range r.work {
		if r.stopping.Load() {
			// Shutdown began while it sat in the work queue: do not start it.
			d.err = errNotStarted
		} else if err := d.ctx.Err(); err != nil {
			// Its lane was revoked while it queued: do not start it.
			d.err = err
		} else {
			d.err = r.call(d)
		}
		select {
		case r.done <- d:
		case <-r.abandon:
			return
		}
	}
}

func (r *run) call(d *delivery) (err error) {
	s := &r.l.stats
	s.running.Add(1)
	defer func() {
		s.running.Add(-1)
		if v := recover(); v != nil {
			err = &PanicError{Value: v, Stack: debug.Stack()}
		}
	}()
	return r.h.Handle(d.ctx, &d.msg)
}

// fetchLoop takes batches from the driver whenever there is room in flight
// and fetching is not paused.
func (r *run) fetchLoop(ctx context.Context) {
	l := r.l
	var (
		buf      []driver.Message
		batch    = make([]*delivery, 0, l.cfg.fetchBatch)
		failures int
	)
	for ctx.Err() == nil {
		if p := l.paused.Load(); p > 0 {
			if wait := time.Until(time.Unix(0, p)); wait > 0 {
				if !sleep(ctx, wait) {
					return
				}
				continue
			}
		}
		room := l.cfg.maxInFlight - int(l.inflight.Load())
		if room <= 0 {
			select {
			case <-l.space:
				continue
			case <-ctx.Done():
				return
			}
		}
		var err error
		buf, err = l.drv.Fetch(ctx, buf[:0], min(room, l.cfg.fetchBatch))
		if len(buf) > 0 {
			l.inflight.Add(int64(len(buf)))
			l.stats.fetched.Add(int64(len(buf)))
			for i := range buf {
				batch = append(batch, newDelivery(&buf[i]))
				buf[i] = driver.Message{}
			}
			select {
			case r.fetched <- batch:
				batch = <-r.back
			case <-ctx.Done():
				r.returnUnadmitted(batch)
				return
			}
		}
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			if driver.IsFatal(err) {
				r.fatal <- err
				return
			}
			failures++
			l.stats.fetchErrors.Add(1)
			wait := fetchDelay(failures, l.cfg.fetchBackoff)
			r.log.Warn("ferry: fetch failed; retrying", "err", err, "retry_in", wait, "failures", failures)
			if !sleep(ctx, wait) {
				return
			}
			continue
		}
		failures = 0
	}
}

// returnUnadmitted gives back a batch fetched while Run was stopping.
func (r *run) returnUnadmitted(batch []*delivery) {
	s := make([]driver.Settlement, len(batch))
	for i, d := range batch {
		s[i] = driver.Settlement{Handle: d.handle, Action: driver.Return}
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.handlerCtx), 10*time.Second)
	defer cancel()
	if err := r.l.drv.Settle(ctx, s); err != nil {
		r.l.stats.settleErrors.Add(1)
		r.log.Warn("ferry: returning unstarted messages failed; the broker redelivers them after their lease", "err", err)
	}
	r.l.stats.returned.Add(int64(len(s)))
	r.l.inflight.Add(-int64(len(s)))
}

func newDelivery(m *driver.Message) *delivery {
	d := &delivery{handle: m.Handle, heapIdx: -1}
	d.msg = Message{
		ID: m.ID, Key: m.Key, Body: m.Body, Headers: m.Headers, Source: m.Source,
		Lane: m.Lane, Offset: m.Offset, Attempt: max(m.Attempt, 1), PublishedAt: m.PublishedAt,
		as: m.As,
	}
	return d
}

// settler applies settlements in batches, off the dispatcher.
func (r *run) settler() {
	l := r.l
	for b := range r.settleCh {
		if len(b.s) > 0 {
			ctx, cancel := context.WithTimeout(context.WithoutCancel(r.handlerCtx), 30*time.Second)
			if err := l.drv.Settle(ctx, b.s); err != nil {
				l.stats.settleErrors.Add(1)
				r.log.Warn("ferry: settling failed; the broker redelivers those messages after their lease", "err", err, "count", len(b.s))
			}
			cancel()
		}
		if b.release > 0 {
			l.inflight.Add(-int64(b.release))
			select {
			case l.space <- struct{}{}:
			default:
			}
		}
		clear(b.s)
		r.settleBack <- b.s[:0]
	}
}

// extenderLoop renews leases off the dispatcher.
func (r *run) extenderLoop() {
	l := r.l
	for handles := range r.extendCh {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(r.handlerCtx), 30*time.Second)
		if err := l.extender.Extend(ctx, handles, l.extender.Lease()); err != nil {
			l.stats.settleErrors.Add(1)
			r.log.Warn("ferry: extending leases failed", "err", err, "count", len(handles))
		}
		cancel()
	}
}

func fetchDelay(failures int, cap time.Duration) time.Duration {
	d := 100 * time.Millisecond
	for i := 1; i < failures && d < cap; i++ {
		d *= 2
	}
	d = min(d, cap)
	// Half fixed, half jitter: spread reconnecting consumers apart.
	return d/2 + rand.N(d/2+1)
}

func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
