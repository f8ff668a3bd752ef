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
func (dp *dispatcher) wait(d *delivery, until time.Time) {
	d.state = stateWaiting
	d.rare().due = until
	heap.Push(&dp.waiting, d)
	dp.resetTimer()
}

// unwait takes a delivery out of the waiting heap.
func (dp *dispatcher) unwait(d *delivery) {
	if i := d.waitingIdx(); i >= 0 {
		heap.Remove(&dp.waiting, i)
	}
	dp.resetTimer()
}

func (dp *dispatcher) resetTimer() {
	if len(dp.waiting) == 0 {
		dp.timer.Stop()
		return
	}
	dp.timer.Reset(max(time.Until(dp.waiting[0].x.due), 0))
}

// wakeDue moves every waiting delivery whose time has come to the ready
// queue.
func (dp *dispatcher) wakeDue() {
	now := time.Now()
	for len(dp.waiting) > 0 && !dp.waiting[0].x.due.After(now) {
		d := heap.Pop(&dp.waiting).(*delivery)
		if d.deferred {
			dp.undefer(d)
		}
		d.state = stateReady
		dp.ready = append(dp.ready, d)
	}
	dp.resetTimer()
}

// deferRun keeps a deferred delivery and runs it again after delay. Deferred
// deliveries wait on someone else (a duplicate of theirs running on another
// worker), so they are counted apart from the in-flight bound: a pile of
// them never stops fresh messages from being fetched, and so up to twice the
// bound can be unsettled at once. Beyond the bound, a broker that takes
// messages back gets them back with the delay, not attempted; a log, which
// cannot take one back, keeps it waiting here inside the bound. When
// stopping, it goes back to the broker with its delay.
func (dp *dispatcher) deferRun(d *delivery, delay time.Duration) {
	dp.l.stats.deferred.Add(1)
	switch {
	case dp.shutting:
		dp.settle(d, driver.Return, delay)
	case dp.deferred < dp.l.cfg.maxInFlight:
		d.deferred = true
		dp.deferred++
		dp.l.deferredNow.Add(1)
		dp.l.signalSpace()
		dp.wait(d, time.Now().Add(delay))
	case dp.l.caps.Redelivers:
		dp.settle(d, driver.Return, delay)
	default:
		dp.wait(d, time.Now().Add(delay))
	}
}

// undefer counts a deferred delivery back into the in-flight bound.
func (dp *dispatcher) undefer(d *delivery) {
	d.deferred = false
	dp.deferred--
	dp.l.deferredNow.Add(-1)
}
