package consumer

import (
	"context"
	"errors"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
)

// This file is the loop's traffic to the broker after a fetch: settlements
// (acks and returns) and lease extensions. Each has goroutines of its own
// (one for extensions; one for settlements, or as many as the driver takes
// calls at once), so that a slow or hung Settle never stops the leases of
// the other messages from being extended, and a slow Extend never holds up
// acks. The dispatcher keeps the two apart for any one message: a
// settlement is not sent while an extension of the same message is being
// made, and a message whose settlement was sent is not extended again, so
// an extension never lands after a return (SQS would undo the return's
// delay).

// ioTimeout bounds one Extend or Settle call.
const ioTimeout = 30 * time.Second

// settleJob is one Settle call: the settlements, and the deliveries they
// belong to (index for index).
type settleJob struct {
	batch []driver.Settlement
	ds    []*delivery
	err   error
}

// extendJob is one Extend call.
type extendJob struct {
	handles []any
	ds      []*delivery
	err     error
}

// ioQueue is what the dispatcher has decided and not yet seen done. Only the
// dispatcher goroutine touches it; the I/O goroutines get jobs on channels
// and hand them back.
type ioQueue struct {
	l      *Loop
	ctx    context.Context // of settle and extend calls: outlives Run's context
	cancel context.CancelFunc

	settleC    chan settleJob
	settleBack chan settleJob
	pending    settleJob // settlements decided and not yet staged
	staged     settleJob // the next settle job, to be sent as soon as a settle goroutine takes it
	spare      settleJob // buffers of the last job, for reuse
	settlers   int       // settle goroutines: the most jobs with the driver at once (driver.Capabilities.Settlers)
	fullBatch  int       // what a further job needs while one is out (driver.Capabilities.SettleBatch)
	flush      bool      // shutting down: what is ready goes out, full batch or not
	settling   int       // settle jobs with the driver
	out        int       // settlements in those jobs
	blocked    int       // pending deliveries whose extension is being made now

	extendC    chan extendJob
	extendBack chan extendJob
	ext        extendJob // the next extension, being filled
	extSpare   extendJob
	extending  bool // an extend job is with the driver
}

func (q *ioQueue) init(ctx context.Context, l *Loop) {
	q.l = l
	q.settlers = min(max(l.caps.Settlers, 1), maxSettlers)
	q.fullBatch = 1
	if q.settlers > 1 {
		q.fullBatch = max(l.caps.SettleBatch, 1) // what a batch is matters only to overlapping calls
	}
	q.ctx, q.cancel = context.WithCancel(context.WithoutCancel(ctx))
	q.settleC = make(chan settleJob)
	q.settleBack = make(chan settleJob)
	q.extendC = make(chan extendJob)
	q.extendBack = make(chan extendJob)
}

// maxSettlers bounds driver.Capabilities.Settlers.
const maxSettlers = 16

// stage makes the next settle job from what is pending, when a settle
// goroutine is free, and reports whether a staged job waits to be sent.
// While a job is with the driver, a further one is made only of a full
// batch (see driver.Capabilities.SettleBatch), but for a shutdown's last
// settlements; with one settle goroutine, only once that job is back. A job
// of more than a full batch takes whole batches only: the rest would make a
// short call of its own, and waits for the next job instead (at the latest
// when no job is out). A delivery whose extension is being made now stays
// pending until the extension is back; the rest go without it, so that one
// slow Extend does not hold back the acks of other messages.
func (q *ioQueue) stage() bool {
	if len(q.staged.ds) > 0 {
		return q.settling < q.settlers
	}
	ready := len(q.pending.ds) - q.blocked
	if q.settling >= q.settlers || ready == 0 || q.settling > 0 && ready < q.fullBatch && !q.flush {
		return false
	}
	take := ready
	if ready > q.fullBatch && !q.flush {
		take -= ready % q.fullBatch
	}
	if take == len(q.pending.ds) {
		q.staged = q.pending
		q.pending = settleJob{batch: q.spare.batch[:0], ds: q.spare.ds[:0]}
	} else {
		q.staged = settleJob{batch: q.spare.batch[:0], ds: q.spare.ds[:0]}
		kept := 0
		for i, d := range q.pending.ds {
			if d.extending || len(q.staged.ds) == take {
				q.pending.ds[kept], q.pending.batch[kept] = d, q.pending.batch[i]
				kept++
				continue
			}
			q.staged.ds = append(q.staged.ds, d)
			q.staged.batch = append(q.staged.batch, q.pending.batch[i])
		}
		clear(q.pending.ds[kept:])
		clear(q.pending.batch[kept:])
		q.pending.ds, q.pending.batch = q.pending.ds[:kept], q.pending.batch[:kept]
	}
	q.spare = settleJob{}
	for _, d := range q.staged.ds {
		// Sent, as far as extensions go: none is started for it now.
		d.settleSent = true
	}
	return true
}

func (q *ioQueue) canExtend() bool { return !q.extending && len(q.ext.ds) > 0 }

// idle reports whether nothing is decided and unsent, and nothing is with
// the driver.
func (q *ioQueue) idle() bool {
	return q.settling == 0 && !q.extending && len(q.pending.ds) == 0 && len(q.staged.ds) == 0 && len(q.ext.ds) == 0
}

// outstanding is how many settlements are decided and not yet made.
func (q *ioQueue) outstanding() int {
	return len(q.pending.ds) + len(q.staged.ds) + q.out
}

func (q *ioQueue) settleJob() settleJob { return q.staged }
func (q *ioQueue) extendJob() extendJob { return q.ext }

// add queues a settlement for d with the next settle job.
func (q *ioQueue) add(d *delivery, s driver.Settlement) {
	q.pending.batch = append(q.pending.batch, s)
	q.pending.ds = append(q.pending.ds, d)
	if d.extending {
		q.blocked++
	}
}

func (q *ioQueue) settleSent() {
	q.settling++
	q.out += len(q.staged.ds)
	q.staged = settleJob{}
}

func (q *ioQueue) extendSent() {
	q.extending = true
	q.ext = extendJob{handles: q.extSpare.handles[:0], ds: q.extSpare.ds[:0]}
	q.extSpare = extendJob{}
}

// settleLoop makes Settle calls, one at a time. The loop runs
// ioQueue.settlers of them: with one, the calls are made in the order
// decided.
func (q *ioQueue) settleLoop(abandon <-chan struct{}) {
	for job := range q.settleC {
		ctx := withLazyDeadline(q.ctx, ioTimeout)
		began := monoNow()
		job.err = q.l.drv.Settle(ctx, job.batch)
		if li := q.l.instruments; li != nil {
			li.recordOp(li.settle, li.settleErr, monoNow()-began, job.err)
		}
		ctx.release()
		select {
		case q.settleBack <- job:
		case <-abandon:
			return
		}
	}
}

// extendLoop makes the Extend calls, one at a time.
func (q *ioQueue) extendLoop(abandon <-chan struct{}) {
	for job := range q.extendC {
		ctx := withLazyDeadline(q.ctx, ioTimeout)
		job.err = q.l.extender.Extend(ctx, job.handles, q.l.extender.Lease())
		ctx.release()
		select {
		case q.extendBack <- job:
		case <-abandon:
			return
		}
	}
}

// settle decides d's outcome; the settlement goes out with the next settle
// job, and d leaves the loop once it is made. A returned message takes what
// waits behind its key along, so that nothing overtakes it; an acked one
// lets the next of its key run.
func (dp *dispatcher) settle(d *delivery, a driver.Action, delay time.Duration) {
	s := driver.Settlement{Handle: d.msg.handle, Action: a, Delay: delay, NotAttempted: d.runs == d.prior}
	if a != driver.Ack {
		s.History = d.history()
		if dp.ledger != nil {
			dp.ledger.put(ledgerKey{d.msg.Source, d.msg.ID}, s.History)
		}
	}
	if d.deferred {
		dp.undefer(d)
	}
	d.state = stateSettling
	dp.io.add(d, s)
	if a == driver.Ack {
		dp.releaseKey(d)
		return
	}
	if dp.shutting && d.ordered {
		// Its key stays closed for the rest of the Run: a delivery of it
		// fetched as the Run stopped must not overtake it (see admit).
		if dp.closedKeys == nil {
			dp.closedKeys = make(map[orderKey]bool)
		}
		dp.closedKeys[dp.orderKey(d)] = true
	}
	for _, f := range dp.takeFollowers(d) {
		dp.settle(f, driver.Return, delay)
	}
}

// ackFirst queues the ack of an at-most-once delivery that a worker is about
// to run; the worker waits until the ack is made. A delivery whose lane was
// revoked, or asked for after the grace ended, is refused: it does not run.
func (dp *dispatcher) ackFirst(req ackRequest) {
	d := req.d
	if d.revoked || dp.graceOver.Load() {
		req.reply <- errNotStarted
		return
	}
	d.acked = true
	d.ackWait = req.reply
	dp.io.add(d, driver.Settlement{Handle: d.msg.handle, Action: driver.Ack, BeforeRun: true})
}

// withdrawAcks takes back the at-most-once acks that are decided and not yet
// sent (pending or staged), when the grace ends: their handlers would start
// on a cancelled context, so the messages go back not attempted instead.
func (dp *dispatcher) withdrawAcks() {
	q := &dp.io
	q.pending = dp.withdrawFrom(q.pending)
	q.staged = dp.withdrawFrom(q.staged)
}

func (dp *dispatcher) withdrawFrom(job settleJob) settleJob {
	kept := 0
	for i, d := range job.ds {
		if d.ackWait == nil {
			job.ds[kept], job.batch[kept] = d, job.batch[i]
			kept++
			continue
		}
		if d.extending {
			dp.io.blocked--
		}
		d.settleSent = false
		d.acked = false
		d.ackWait <- errNotStarted
		d.ackWait = nil
	}
	clear(job.ds[kept:])
	clear(job.batch[kept:])
	job.ds, job.batch = job.ds[:kept], job.batch[:kept]
	return job
}

// settled takes back a settle job the driver is done with.
func (dp *dispatcher) settled(job settleJob) {
	q := &dp.io
	q.settling--
	q.out -= len(job.ds)
	failed := failedSettlements(job.err, len(job.batch))
	if job.err != nil {
		dp.l.stats.settleErrors.Add(1)
		if ok, left := dp.l.logs.Allow("settle"); ok {
			dp.log.Warn("ferry: settling failed; the broker redelivers those messages after their lease",
				"err", job.err, "failed", failed.count(len(job.batch)), "count", len(job.batch), "unlogged", left)
		}
	}
	var (
		acked, returned, left int64
		awaited               bool
	)
	for i, d := range job.ds {
		d.settleSent = false
		ok := !failed.has(i)
		if ok {
			// Counted once made: a broker refusing every ack must not look
			// healthy in the counters.
			if job.batch[i].Action == driver.Ack {
				acked++
			} else {
				returned++
			}
		}
		if d.ackWait != nil {
			// At most once: acked before it runs; tell its worker.
			if ok {
				d.ackWait <- nil
			} else {
				d.ackWait <- errAckFailed
			}
			d.ackWait = nil
			continue
		}
		awaited = dp.release(d) || awaited
		left++
	}
	// The counters and the fetcher's wake-up once a job, not once a delivery.
	dp.l.stats.acked.Add(acked)
	dp.l.stats.returned.Add(returned)
	dp.freed(left)
	if awaited {
		dp.checkRevocations()
	}
	clear(job.batch)
	clear(job.ds)
	q.spare = settleJob{batch: job.batch[:0], ds: job.ds[:0]}
}

// failedSet says which entries of a settle batch failed.
type failedSet struct {
	all     bool
	indices map[int]bool
}

func failedSettlements(err error, n int) failedSet {
	if err == nil {
		return failedSet{}
	}
	var se *driver.SettleError
	if errors.As(err, &se) && len(se.Failed) < n {
		m := make(map[int]bool, len(se.Failed))
		for _, i := range se.Failed {
			m[i] = true
		}
		return failedSet{indices: m}
	}
	return failedSet{all: true}
}

func (f failedSet) has(i int) bool { return f.all || f.indices[i] }

func (f failedSet) count(n int) int {
	if f.all {
		return n
	}
	return len(f.indices)
}

// leave lets d go: out of the in-flight list, its slot freed, and the
// revocations waiting for it told.
func (dp *dispatcher) leave(d *delivery) {
	awaited := dp.release(d)
	dp.freed(1)
	if awaited {
		dp.checkRevocations()
	}
}

// freed frees n slots in flight, of deliveries released, and wakes the
// fetcher if it waits for room.
func (dp *dispatcher) freed(n int64) {
	if n == 0 {
		return
	}
	dp.l.inflight.Add(-n)
	dp.l.signalSpace()
}

// release takes d out of the loop (see leave) but for its slot in flight,
// which the caller frees before it checks the revocations (release reports
// whether any waited for d): a revocation is done only once its deliveries
// are out of the count in flight.
func (dp *dispatcher) release(d *delivery) (awaited bool) {
	dp.listRemove(d)
	d.forget()
	if d.deferred {
		dp.undefer(d)
	}
	if d.x == nil || len(d.x.awaited) == 0 {
		return false
	}
	for _, rw := range d.x.awaited {
		rw.pending--
	}
	d.x.awaited = nil
	return true
}

// extendLeases collects, for the next extension, every delivery whose lease
// is two thirds gone: running, queued, waiting to run again, or waiting for
// its settlement to be sent. A round waits for the one before it.
func (dp *dispatcher) extendLeases() {
	q := &dp.io
	if q.extending || len(q.ext.ds) > 0 {
		return
	}
	lease := dp.l.extender.Lease()
	now := time.Now()
	renewBefore := now.Add(lease * 2 / 3)
	for d := dp.head.next; d != &dp.head; d = d.next {
		// An at-most-once ack that is queued and not yet made keeps its
		// lease, like any settlement waiting to be sent.
		if d.settleSent || (d.acked && d.ackWait == nil) || d.leaseAt.After(renewBefore) {
			continue
		}
		q.ext.handles = append(q.ext.handles, d.msg.handle)
		q.ext.ds = append(q.ext.ds, d)
		d.extending = true
		d.leaseAt = now.Add(lease)
		if d.state == stateSettling || d.ackWait != nil {
			q.blocked++ // its settlement waits for the extension
		}
	}
}

// extended takes back an extend job the driver is done with.
func (dp *dispatcher) extended(job extendJob) {
	q := &dp.io
	q.extending = false
	failed := job.err != nil
	if failed {
		dp.l.stats.settleErrors.Add(1)
		if ok, left := dp.l.logs.Allow("extend"); ok {
			dp.log.Warn("ferry: extending leases failed; trying again at the next tick (a lease that runs out lets the broker hand the message to another consumer)",
				"err", job.err, "count", len(job.handles), "unlogged", left)
		}
	}
	now := time.Now()
	for _, d := range job.ds {
		d.extending = false
		if failed {
			// Its lease was taken as extended when the job was made; it
			// was not, so it is due again.
			d.leaseAt = now
		}
		if (d.state == stateSettling || d.ackWait != nil) && !d.settleSent {
			q.blocked--
		}
	}
	clear(job.handles)
	clear(job.ds)
	q.extSpare = extendJob{handles: job.handles[:0], ds: job.ds[:0]}
}
