package consumer

import (
	"context"
	"math/rand/v2"
	"runtime/debug"
	"sync"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
	"go.opentelemetry.io/otel/trace"
)

// This file holds the goroutines around the dispatcher: the fetcher and the
// workers. None of them touches a delivery's state while the dispatcher owns
// it; they hand deliveries over on channels, and workers hand them back
// through their boxes.

// doneBox is where a worker puts the deliveries it has finished, for the
// dispatcher. A worker hands back each delivery as it finishes, under a lock
// it shares with the dispatcher alone, and wakes the dispatcher (doneSig)
// only when its box was empty: while the dispatcher is busy, deliveries
// gather there and it takes them all at its next wake-up. So the hand-back
// costs an uncontended lock a delivery and a wake-up a batch, and adds no
// wait: a finished delivery is taken the next time the dispatcher looks,
// exactly as soon as when each took a channel send of its own.
type doneBox struct {
	mu sync.Mutex
	ds []*delivery
	_  [64 - 32]byte // a cache line a box: workers do not share one
}

// handBack puts d into the worker's box, waking the dispatcher if the box
// was empty. A box that was not empty has a wake-up coming: the one sent
// when it was last found empty, which the dispatcher has not yet answered
// by emptying it.
func (dp *dispatcher) handBack(b *doneBox, d *delivery) {
	b.mu.Lock()
	first := len(b.ds) == 0
	b.ds = append(b.ds, d)
	b.mu.Unlock()
	if first {
		select {
		case dp.doneSig <- struct{}{}:
		default:
		}
	}
}

// worker runs handlers; box is its own doneBox.
func (dp *dispatcher) worker(box *doneBox) {
	atMostOnce := dp.l.cfg.mode == AtMostOnce
	var ack chan error
	if atMostOnce {
		ack = make(chan error, 1)
	}
	for d := range dp.work {
		dp.idle.Add(-1)
		// d, then its train in order while each succeeds (see delivery.train);
		// each goes back as it finishes, so that its ack is not held. A
		// train of unordered deliveries is claimed one at a time (the
		// dispatcher may take back what is unclaimed), and handed back
		// as soon as one of it is slow.
		train, next, loose := d.train, 0, d.loose
		// One clock reading a delivery: the end of one run is the start
		// of the next, for the process-duration metric and the train slice.
		began := monoNow()
		now := began
		for {
			ran := now // when d's run began
			switch {
			case dp.graceOver.Load():
				// The shutdown grace ended while it sat in the work queue.
				d.err = errNotStarted
			case d.ctx.Err() != nil:
				// Its lane was revoked while it queued: do not start it.
				d.err = errNotStarted
			case atMostOnce:
				now, d.err = dp.runAtMostOnce(d, ack)
			default:
				now, d.err = dp.call(d, now)
			}
			if !d.called {
				// Calls reserved at a breaker that no run will take.
				dp.releaseReservations(d)
			}
			var follow *delivery
			stop := d.err != nil || d.late || dp.yieldTrain(began, now)
			switch {
			case loose != nil && (stop || now-ran > looseTrainSlow):
				d.cut = loose.rest()
			case loose != nil:
				follow = loose.claim()
			case next < len(train) && stop:
				// What follows must not overtake it (or others wait for a
				// worker): hand the rest back, to the head of its key.
				d.cut = train[next:]
			case next < len(train):
				follow, next = train[next], next+1
			}
			if follow == nil {
				dp.idle.Add(1) // before the hand-back, which the dispatcher rebalances after
			}
			dp.handBack(box, d)
			if follow == nil {
				break
			}
			d = follow
		}
	}
}

// trainSlice is how long a worker keeps to one train while other deliveries
// wait for a worker: a train is for handlers quick enough that the round
// trip through the dispatcher would cost more than they do; slow ones take
// turns with other lanes as single deliveries do.
const trainSlice = 5 * time.Millisecond

// looseTrainSlow is how long a handler of a train of unordered deliveries may
// take before the worker hands the rest of the train back, for other workers
// to take: trains of them are for handlers quick enough that a hand-off each
// would cost more than they do, and must not keep work from idle workers.
const looseTrainSlow = 20 * time.Microsecond

// yieldTrain reports whether a train begun at began should end now, for other
// deliveries waiting in the work queue.
func (dp *dispatcher) yieldTrain(began, now time.Duration) bool {
	return len(dp.work) > 0 && now-began > trainSlice
}

// runAtMostOnce asks the breakers in the chain first, so that a message they
// would hold is kept rather than acked and dropped; then it has the message
// acked, waits until the ack is made, and only then runs the handler.
// It returns the clock as it returned, and the run's outcome.
func (dp *dispatcher) runAtMostOnce(d *delivery, ack chan error) (time.Duration, error) {
	if hold := dp.reserveGates(d); hold != nil {
		return monoNow(), hold
	}
	select {
	case dp.ackReq <- ackRequest{d, ack}:
	case <-dp.abandon:
		return monoNow(), errAckFailed
	}
	select {
	case err := <-ack:
		if err != nil {
			return monoNow(), err
		}
	case <-dp.abandon:
		return monoNow(), errAckFailed
	}
	// Timed from here: the wait for the ack is not the handler's.
	return dp.call(d, monoNow())
}

// call runs the handler chain on d, begun at start (monoNow), and returns
// the clock as it returned and its outcome (a panic made a PanicError).
func (dp *dispatcher) call(d *delivery, start time.Duration) (end time.Duration, err error) {
	var span trace.Span
	if dp.l.tracer != nil {
		// Deferred first, so it runs last: after a panic became err.
		defer func() { endRun(span, err) }()
	}
	s := &dp.l.stats
	s.running.Add(1)
	defer func() {
		s.running.Add(-1)
		if v := recover(); v != nil {
			err = &PanicError{Value: v, Stack: debug.Stack()}
		}
		end = monoNow()
		if li := dp.l.instruments; li != nil {
			li.recordProcess(end-start, err)
		}
	}()
	d.msg.Attempt = d.runs + 1
	d.rec.deadLettered = false
	d.called = true
	defer func() {
		// Noted as it returns: a handler that finished before the grace
		// ended did its work on a live context.
		d.late = dp.graceOver.Load()
	}()
	if dp.l.tracer != nil {
		var ctx context.Context
		ctx, span = dp.startRun(&d.ctx, &d.msg)
		return 0, dp.h.Handle(ctx, &d.msg)
	}
	return 0, dp.h.Handle(&d.ctx, &d.msg)
}

// fetchLoop takes batches from the driver whenever there is room in flight
// and fetching is not paused, and hands them to the dispatcher. A batch
// fetched as Run stops is handed over all the same: only the dispatcher
// decides what becomes of a delivery.
func (dp *dispatcher) fetchLoop(ctx context.Context) {
	l := dp.l
	aser, _ := l.drv.(driver.Aser)
	var (
		buf      []driver.Message
		batch    = make([]*delivery, 0, l.cfg.fetchBatch)
		slab     deliverySlab
		failures int
	)
	// Two batches take turns: the fetcher fills one while the dispatcher
	// admits the other, rather than waiting for the dispatcher to hand its
	// batch back before it fetches again.
	dp.back <- make([]*delivery, 0, l.cfg.fetchBatch)
	defer func() {
		// Stopped (not abandoned): what the broker pushed ahead of Fetch
		// runs in the drain rather than going back to it.
		if ctx.Err() == nil {
			return
		}
		dr, ok := l.drv.(driver.Drainer)
		if !ok {
			return
		}
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		buf, err := dr.Drain(dctx, buf[:0])
		if err != nil {
			dp.log.Warn("ferry: draining what the broker pushed ahead failed; it goes back to the broker", "err", err)
		}
		if len(buf) == 0 {
			return
		}
		l.inflight.Add(int64(len(buf)))
		l.stats.fetched.Add(int64(len(buf)))
		batch = batch[:0]
		for i := range buf {
			batch = append(batch, newDelivery(&slab, &buf[i], aser))
		}
		select {
		case dp.fetched <- batch:
		case <-dp.abandon:
		}
	}()
	if !dp.connect(ctx) {
		return
	}
	for ctx.Err() == nil {
		if p := l.paused.Load(); p > 0 {
			if wait := time.Until(time.Unix(0, p)); wait > 0 {
				if !sleep(ctx, wait) {
					return
				}
				continue
			}
		}
		// Deferred deliveries wait on someone else; they do not take room.
		room := l.cfg.maxInFlight - int(l.inflight.Load()-l.deferredNow.Load())
		if room <= 0 {
			select {
			case <-l.space:
				continue
			case <-ctx.Done():
				return
			}
		}
		var err error
		began := monoNow()
		buf, err = l.drv.Fetch(ctx, buf[:0], min(room, l.cfg.fetchBatch))
		if li := l.instruments; li != nil {
			li.recordOp(li.receive, li.receiveErr, monoNow()-began, err)
		}
		if len(buf) > 0 {
			l.inflight.Add(int64(len(buf)))
			l.stats.fetched.Add(int64(len(buf)))
			for i := range buf {
				batch = append(batch, newDelivery(&slab, &buf[i], aser))
				buf[i] = driver.Message{}
			}
			select {
			case dp.fetched <- batch:
			case <-dp.abandon:
				return // Run gave up; the broker redelivers these after their lease
			}
			select {
			case batch = <-dp.back:
			case <-dp.abandon:
				return
			}
		}
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			if driver.IsFatal(err) {
				dp.fatal <- err
				return
			}
			failures++
			wait := fetchDelay(failures, l.cfg.fetchBackoff)
			l.connFailed(dp.log, err, wait)
			if !sleep(ctx, wait) {
				return
			}
			continue
		}
		failures = 0
		if !l.conn.ok.Load() {
			l.connAnswered(dp.log)
		}
	}
}

// connect calls the driver's Connect, when it has one, until it succeeds,
// with the fetch backoff between failures. It reports false when the
// fetcher should stop: ctx ended, or the error was fatal.
func (dp *dispatcher) connect(ctx context.Context) bool {
	l := dp.l
	c, ok := l.drv.(driver.Connector)
	if !ok {
		return true
	}
	for failures := 1; ; failures++ {
		cctx, cancel := context.WithTimeout(ctx, 2*driver.ReportWithin)
		err := c.Connect(cctx)
		cancel()
		switch {
		case err == nil:
			l.connAnswered(dp.log)
			return true
		case ctx.Err() != nil:
			return false
		case driver.IsFatal(err):
			dp.fatal <- err
			return false
		}
		wait := fetchDelay(failures, l.cfg.fetchBackoff)
		l.connFailed(dp.log, err, wait)
		if !sleep(ctx, wait) {
			return false
		}
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
