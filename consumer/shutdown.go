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

func (dp *dispatcher) beginShutdown(s *shutdown) {
	if dp.shutting {
		return
	}
	dp.shutting = true
	// The last settlements go out as they come, not held for full batches:
	// the grace is no time to gather them.
	dp.io.flush = true
	// What waits to run later goes back now, with what waits behind it.
	waiting := dp.waiting
	dp.waiting = nil
	dp.timer.Stop()
	for _, d := range waiting {
		d.x.heapIdx = -1
		dp.settle(d, driver.Return, max(time.Until(d.x.due), 0))
	}
	s.grace = time.NewTimer(dp.l.cfg.grace)
	s.graceC = s.grace.C
}

// endGrace cancels the running handlers and hands back what has not
// started.
func (dp *dispatcher) endGrace(s *shutdown) {
	s.graceC = nil
	dp.graceOver.Store(true)
	if dp.running > 0 {
		dp.log.Warn("ferry: shutdown grace over; cancelling running handlers", "running", dp.running)
	}
	dp.cancelHandler()
	dp.withdrawAcks()
	// Take the key queues away first, so that returning a ready delivery
	// does not promote the one behind it into the ready queue.
	keys := dp.keys
	dp.keys = make(map[orderKey][]*delivery)
	dp.queued = 0
	for _, q := range keys {
		for _, d := range q {
			dp.settle(d, driver.Return, 0)
		}
	}
	// With what is ready, the unclaimed rest of every train of unordered
	// deliveries: a worker stuck in a handler would never start them, and
	// one that returns claims nothing more.
	dp.takeBackLoose()
	for _, d := range dp.ready {
		dp.settle(d, driver.Return, 0)
	}
	dp.ready = nil
	// And what sits in the work queue, which a worker stuck in a handler
	// that ignores its cancelled context would never take.
	for reclaimed := true; reclaimed; {
		select {
		case d := <-dp.work:
			unstarted := d.train
			if d.loose != nil {
				// An unordered train: what of it was unclaimed went back
				// above (takeBackLoose), or before (rebalance), so d.train
				// is no longer all its own.
				unstarted = d.loose.rest()
			}
			dp.returnUnstarted(d)
			for _, f := range unstarted {
				dp.returnUnstarted(f)
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
func (dp *dispatcher) returnUnstarted(d *delivery) {
	dp.running--
	d.passKey = false
	if d.revoked {
		// Its lane was taken away: nothing of it is settled. (The
		// revocation took its lane's deliveries out of the work queue
		// already; this guards the rule all the same.)
		dp.drop(d)
		return
	}
	dp.settle(d, driver.Return, 0)
}

// drained reports whether nothing is left to run or settle.
func (dp *dispatcher) drained() bool {
	return dp.running == 0 && len(dp.ready) == 0 && dp.queued == 0 && len(dp.waiting) == 0 && dp.io.idle()
}
