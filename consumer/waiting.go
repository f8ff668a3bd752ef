package consumer

import (
	"container/heap"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
)

// This file is the deliveries that wait in the loop to run again: a record
// retried in place (a log cannot take it back), a message held by an open
// breaker, and one deferred while a duplicate of it runs elsewhere. A
// waiting delivery keeps its key busy, so nothing behind it overtakes it,
// and keeps its lease.

// dueHeap orders waiting deliveries by when they run again.
type dueHeap []*delivery

func (h dueHeap) Len() int           { return len(h) }
func (h dueHeap) Less(i, j int) bool { return h[i].x.due.Before(h[j].x.due) }
func (h dueHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i]; h[i].x.heapIdx = i; h[j].x.heapIdx = j }
func (h *dueHeap) Push(x any)        { d := x.(*delivery); d.x.heapIdx = len(*h); *h = append(*h, d) }
func (h *dueHeap) Pop() any {
	old := *h
	d := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	d.x.heapIdx = -1
	return d
}

// wait parks a delivery until 'until', keeping its key busy.
func (r *run) wait(d *delivery, until time.Time) {
	d.state = stateWaiting
	d.rare().due = until
	heap.Push(&r.waiting, d)
	r.resetTimer()
}

// unwait takes a delivery out of the waiting heap.
func (r *run) unwait(d *delivery) {
	if i := d.waitingIdx(); i >= 0 {
		heap.Remove(&r.waiting, i)
	}
	r.resetTimer()
}

func (r *run) resetTimer() {
	if len(r.waiting) == 0 {
		r.timer.Stop()
		return
	}
	r.timer.Reset(max(time.Until(r.waiting[0].x.due), 0))
}

// wakeDue moves every waiting delivery whose time has come to the ready
// queue.
func (r *run) wakeDue() {
	now := time.Now()
	for len(r.waiting) > 0 && !r.waiting[0].x.due.After(now) {
		d := heap.Pop(&r.waiting).(*delivery)
		if d.deferred {
			r.undefer(d)
		}
		d.state = stateReady
		r.ready = append(r.ready, d)
	}
	r.resetTimer()
}

// deferRun keeps a deferred delivery and runs it again after delay. Deferred
// deliveries wait on someone else (a duplicate of theirs running on another
// worker), so they are counted apart from the in-flight bound: a pile of
// them never stops fresh messages from being fetched, and so up to twice the
// bound can be unsettled at once. Beyond the bound, a broker that takes
// messages back gets them back with the delay, not attempted; a log, which
// cannot take one back, keeps it waiting here inside the bound. When
// stopping, it goes back to the broker with its delay.
func (r *run) deferRun(d *delivery, delay time.Duration) {
	r.l.stats.deferred.Add(1)
	switch {
	case r.shutting:
		r.settle(d, driver.Return, delay)
	case r.deferred < r.l.cfg.maxInFlight:
		d.deferred = true
		r.deferred++
		r.l.deferredNow.Add(1)
		r.l.signalSpace()
		r.wait(d, time.Now().Add(delay))
	case r.l.caps.Redelivers:
		r.settle(d, driver.Return, delay)
	default:
		r.wait(d, time.Now().Add(delay))
	}
}

// undefer counts a deferred delivery back into the in-flight bound.
func (r *run) undefer(d *delivery) {
	d.deferred = false
	r.deferred--
	r.l.deferredNow.Add(-1)
}
