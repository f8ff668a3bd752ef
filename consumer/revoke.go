package consumer

import (
	"slices"

	"github.com/ferrymq/ferry/consumer/driver"
)

// This file is what the loop does when the broker takes lanes away (a Kafka
// rebalance, a lost AMQP channel): it lets go of their deliveries without
// settling them, and tells the driver when that is done.

// revocationWait is a revocation whose Done waits for the running handlers
// of its lanes to return and for the settlements decided before it to be
// made.
type revocationWait struct {
	done    chan struct{}
	pending int // deliveries of the revoked lanes still running or settling
}

// revoke lets go of every delivery in the revoked lanes: running handlers
// have their context cancelled and their outcome ignored; ready, queued and
// waiting ones are dropped, and so are those in the work queue that no
// worker took yet. Settlements already decided are still made. Done closes
// once the running handlers have returned and those settlements are made.
func (dp *dispatcher) revoke(rev driver.Revocation) {
	if ok, left := dp.l.logs.Allow("revoke"); ok {
		dp.log.Info("ferry: the broker took lanes away (a rebalance, a lost channel); their running handlers are cancelled and their messages come again",
			"source", dp.l.caps.Source, "lanes", rev.Lanes, "unlogged", left)
	}
	rw := &revocationWait{done: rev.Done}
	lanes := make(map[string]bool, len(rev.Lanes))
	for _, lane := range rev.Lanes {
		lanes[lane] = true
		if rev.Before > dp.revokedGen[lane] {
			if dp.revokedGen == nil {
				dp.revokedGen = make(map[string]uint64)
			}
			dp.revokedGen[lane] = rev.Before
		}
		if ls := dp.lanes[lane]; ls != nil {
			ls.cancel()
			delete(dp.lanes, lane)
		}
	}
	// What no worker has started of a train of unordered deliveries comes
	// back first, to be let go (or offered again) like what is ready: a
	// revocation waits only for handlers that run, not for a slow handler
	// of another lane ahead of them in a train.
	dp.takeBackLoose()
	dp.reclaimWork(lanes)
	dropped := false
	for d := dp.head.next; d != &dp.head; {
		next := d.next
		if lanes[d.msg.Lane] {
			switch d.state {
			case stateReady, stateQueued, stateWaiting:
				if d.state == stateWaiting {
					dp.unwait(d)
				}
				d.revoked = true
				dropped = true
				dp.drop(d)
			case stateRunning:
				// Perhaps revoked already by an earlier revocation; this
				// one waits for it too.
				d.revoked = true
				d.rare().awaited = append(d.rare().awaited, rw)
				rw.pending++
			case stateSettling:
				d.rare().awaited = append(d.rare().awaited, rw)
				rw.pending++
			}
		}
		d = next
	}
	if dropped {
		dp.ready = slices.DeleteFunc(dp.ready, func(d *delivery) bool { return d.revoked })
	}
	for k, q := range dp.keys {
		if lanes[k.lane] {
			dp.queued -= len(q)
			delete(dp.keys, k)
		}
	}
	dp.revocations = append(dp.revocations, rw)
	dp.checkRevocations()
}

// reclaimWork takes the deliveries of revoked lanes out of the work queue,
// where they wait for a worker (every worker busy, perhaps in slow handlers
// of other lanes), and lets them go as a worker would hand them back
// unstarted, trains with them: a revocation waits for the handlers that
// run, not for a worker to come free. The other deliveries go back to the
// queue in their order.
func (dp *dispatcher) reclaimWork(lanes map[string]bool) {
	var keep []*delivery
	for taking := true; taking; {
		select {
		case d := <-dp.work:
			if !lanes[d.msg.Lane] {
				keep = append(keep, d)
				continue
			}
			d.revoked, d.err = true, errNotStarted
			if d.loose != nil {
				d.cut = d.loose.rest() // empty after takeBackLoose
			} else if len(d.train) > 0 {
				d.cut = d.train // its key's, so its lane's
			}
			dp.running--
			dp.finish(d)
		default:
			taking = false
		}
	}
	for _, d := range keep {
		// The dispatcher alone sends, and it took at least these out: the
		// queue has room for them.
		dp.work <- d
	}
}

// drop lets a revoked delivery go without settling it.
func (dp *dispatcher) drop(d *delivery) {
	dp.l.stats.revoked.Add(1)
	dp.leave(d)
}

// checkRevocations closes the Done of every revocation that has nothing
// left to wait for.
func (dp *dispatcher) checkRevocations() {
	dp.revocations = slices.DeleteFunc(dp.revocations, func(rw *revocationWait) bool {
		if rw.pending > 0 {
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
func (dp *dispatcher) closeRevocations() {
	for _, rw := range dp.revocations {
		if rw.done != nil {
			close(rw.done)
		}
	}
	dp.revocations = nil
}
