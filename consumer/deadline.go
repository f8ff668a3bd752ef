package consumer

import (
	"context"
	"math"
	"sync"
	"time"
)

// deadlineCtx is a context with a deadline that costs one allocation until
// somebody waits on it. context.WithTimeout starts a timer and links into
// its parent for every message (about 600ns and four allocations), although
// most handlers never select on Done: they finish, and only Err is asked.
// deadlineCtx answers Err from the clock and builds the channel, the timer
// and the link to its parent only when Done is first called.
type deadlineCtx struct {
	context.Context               // the parent
	at              time.Duration // the deadline on the monotonic clock (see monoNow)
	parentFirst     bool          // the parent's deadline comes before this one's own

	mu    sync.Mutex
	done  chan struct{}
	err   error
	timer *time.Timer
	stop  func() bool // unlinks from the parent's cancellation
}

// withLazyDeadline returns a child of parent that ends at the earlier of
// parent's deadline and now+d. Its release method must be called when the
// work is done. (It returns no release func: a method value would cost an
// allocation of its own.)
func withLazyDeadline(parent context.Context, d time.Duration) *deadlineCtx {
	now := monoNow()
	c := &deadlineCtx{Context: parent, at: addSat(now, d)}
	if pd, ok := parent.Deadline(); ok {
		if pat := monoOffset(pd, now); pat < c.at {
			c.at, c.parentFirst = pat, true
		}
	}
	return c
}

// monoOffset places t on monoNow's scale, now being monoNow(). A time with
// a monotonic reading (time.Now and what is derived from it) is placed by
// it. One without (time.Date, Round(0), a deadline decoded from a message)
// is a wall-clock time: it is placed by how far the wall clock now is from
// it, not by the wall clock as it read at monoBase, which a clock step
// since (NTP, a host resuming from suspend) would have moved.
func monoOffset(t time.Time, now time.Duration) time.Duration {
	if t != t.Round(0) { // Round(0) strips the monotonic reading
		return t.Sub(monoBase)
	}
	return addSat(now, time.Until(t))
}

// addSat is a+b, held at the ends of Duration's range instead of wrapping
// (a Timeout of math.MaxInt64 means no deadline in practice, as with
// time.Time.Add).
func addSat(a, b time.Duration) time.Duration {
	s := a + b
	switch {
	case b > 0 && s < a:
		return math.MaxInt64
	case b < 0 && s > a:
		return math.MinInt64
	}
	return s
}

// monoBase anchors monoNow.
var monoBase = time.Now()

// monoNow is the time on the monotonic clock since monoBase. It reads one
// clock where time.Now reads two (the wall clock too), which the
// per-message path (a deadline set, asked and checked for every message)
// felt: time.Now was a tenth of the full stack's CPU.
func monoNow() time.Duration { return time.Since(monoBase) }

// Deadline is the parent's own when it comes first (exactly as the parent
// says it), else this one's, placed from monoBase.
func (c *deadlineCtx) Deadline() (time.Time, bool) {
	if c.parentFirst {
		return c.Context.Deadline()
	}
	return monoBase.Add(c.at), true
}

func (c *deadlineCtx) Done() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.done != nil {
		return c.done
	}
	c.done = make(chan struct{})
	if c.err == nil {
		c.err = c.currentErrLocked()
	}
	if c.err != nil {
		close(c.done)
		return c.done
	}
	c.timer = time.AfterFunc(c.at-monoNow(), func() { c.end(context.DeadlineExceeded) })
	c.stop = context.AfterFunc(c.Context, func() { c.end(c.Context.Err()) })
	return c.done
}

func (c *deadlineCtx) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err == nil {
		c.err = c.currentErrLocked()
		if c.err != nil && c.done != nil {
			close(c.done)
		}
	}
	return c.err
}

func (c *deadlineCtx) currentErrLocked() error {
	if err := c.Context.Err(); err != nil {
		return err
	}
	if monoNow() >= c.at {
		return context.DeadlineExceeded
	}
	return nil
}

func (c *deadlineCtx) end(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil {
		return
	}
	c.err = err
	if c.done != nil {
		close(c.done)
	}
}

// release stops the timer and unlinks from the parent. The context counts
// as cancelled afterwards, as after context.WithTimeout's cancel. It ends
// the context in the same critical section, so a Done racing with it sees
// the end and starts no timer.
func (c *deadlineCtx) release() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.timer != nil {
		c.timer.Stop()
	}
	if c.stop != nil {
		c.stop() // never waits for the callback, which would need c.mu
	}
	if c.err == nil {
		c.err = context.Canceled
		if c.done != nil {
			close(c.done)
		}
	}
}

// expired reports whether this context's own deadline has passed: the
// work ran past it, whether or not the parent was cancelled later. A
// deadline the parent set earlier is not this one's.
func (c *deadlineCtx) expired() bool {
	return !c.parentFirst && monoNow() >= c.at
}
