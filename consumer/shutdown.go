package consumer

import (
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
)

// This file is how a Run ends. Cancelling its context stops fetching; what
// was already fetched runs, within the shutdown grace, and is acked when it
// succeeds, so a graceful restart hands nothing back that it could have
// done (every message handed back counts as a delivery on SQS and RabbitMQ).
// What waits to run again later (a retry in place, a hold, a deferral) goes
// back at once with its delay. When the grace ends, running handlers have
// their contexts cancelled and whatever has not started goes back, not
// attempted. A second after that, and in any case once the settlements are
// made, Run returns.

// shutdown is the timers of a shutdown in progress; their channels are nil
// until it begins.
type shutdown struct {
	grace, abandon *time.Timer
	graceC         <-chan time.Time
	abandonC       <-chan time.Time
}

func (s *shutdown) stop() {
	if s.grace != nil {
		s.grace.Stop()
	}
	if s.abandon != nil {
		s.abandon.Stop()
	}
}

// abandonAfter is how long after the grace Run waits for handlers that
// ignore their cancelled context and for settlements still being made.
const abandonAfter = time.Second

func (r *run) beginShutdown(s *shutdown) {
	if r.shutting {
		return
	}
	r.shutting = true
	// The last settlements go out as they come, not held for full batches:
	// the grace is no time to gather them.
	r.io.flush = true
	// What waits to run later goes back now, with what waits behind it.
	waiting := r.waiting
	r.waiting = nil
	r.timer.Stop()
	for _, d := range waiting {
		d.x.heapIdx = -1
		r.settle(d, driver.Return, max(time.Until(d.x.due), 0))
	}
	s.grace = time.NewTimer(r.l.cfg.grace)
	s.graceC = s.grace.C
}

// endGrace cancels the running handlers and hands back what has not
// started.
func (r *run) endGrace(s *shutdown) {
	s.graceC = nil
	r.graceOver.Store(true)
	if r.running > 0 {
		r.log.Warn("ferry: shutdown grace over; cancelling running handlers", "running", r.running)
	}
	r.cancelHandler()
	r.withdrawAcks()
	// Take the key queues away first, so that returning a ready delivery
	// does not promote the one behind it into the ready queue.
	keys := r.keys
	r.keys = make(map[orderKey][]*delivery)
	r.queued = 0
	for _, q := range keys {
		for _, d := range q {
			r.settle(d, driver.Return, 0)
		}
	}
	// With what is ready, the unclaimed rest of every run of unordered
	// deliveries: a worker stuck in a handler would never start them, and
	// one that returns claims nothing more.
	r.takeBackLoose()
	for _, d := range r.ready {
		r.settle(d, driver.Return, 0)
	}
	r.ready = nil
	// And what sits in the work queue, which a worker stuck in a handler
	// that ignores its cancelled context would never take.
	for reclaimed := true; reclaimed; {
		select {
		case d := <-r.work:
			unstarted := d.run
			if d.loose != nil {
				// An unordered run: what of it was unclaimed went back
				// above (takeBackLoose), or before (rebalance), so d.run
				// is no longer all its own.
				unstarted = d.loose.rest()
			}
			r.returnUnstarted(d)
			for _, f := range unstarted {
				r.returnUnstarted(f)
			}
		default:
			reclaimed = false
		}
	}
	s.abandon = time.NewTimer(abandonAfter)
	s.abandonC = s.abandon.C
}

// returnUnstarted gives back a delivery taken from a worker before it
// started (see endGrace).
func (r *run) returnUnstarted(d *delivery) {
	r.running--
	d.passKey = false
	if d.revoked {
		// Its lane was taken away: nothing of it is settled.
		r.drop(d)
		return
	}
	r.settle(d, driver.Return, 0)
}

// drained reports whether nothing is left to run or settle.
func (r *run) drained() bool {
	return r.running == 0 && len(r.ready) == 0 && r.queued == 0 && len(r.waiting) == 0 && r.io.idle()
}
