package consumer

import (
	"context"
	"math"
	"sync"
	"sync/atomic"
	"time"
)

// deadlineCtx is a context with a deadline that costs one small allocation
// and no lock until somebody waits on it. context.WithTimeout starts a timer
// and links into its parent for every message (about 600ns and four
// allocations), although most handlers never select on Done: they finish,
// and only Err is asked. deadlineCtx answers Err from the clock and builds
// the channel, the timer and the link to its parent only when Done is first
// called.
//
// Its state is one pointer: nil while it is live and nobody waits on it;
// one of the end sentinels once it ended without a channel (released, or
// its deadline or its parent's end seen by Err); an armed, with the
// channel, the timer and the link, once Done was called. A live context
// leaves nil only by a compare-and-swap, so the common path (created, maybe
// asked Err, released) takes no lock; an armed one keeps to its lock.
type deadlineCtx struct {
	context.Context               // the parent
	start           time.Duration // when it was made, on the monotonic clock (see monoNow)
	at              time.Duration // the deadline on the monotonic clock
	parentFirst     bool          // the parent's deadline comes before this one's own
	state           atomic.Pointer[armed]
}

// armed is the part of a deadlineCtx that somebody waits on.
type armed struct {
	mu    sync.Mutex
	done  chan struct{}
	err   error
	timer *time.Timer
	stop  func() bool // unlinks from the parent's cancellation
}

// The ends of a deadlineCtx nobody waited on: released (Canceled), its own
// deadline passed, or its parent ended (the parent's Err, which stays the
// same once set). They are compared by address only.
var (
	endReleased = new(armed)
	endDeadline = new(armed)
	endParent   = new(armed)
)

// closedDone is the Done channel of a deadlineCtx that ended before anybody
// waited on it.
var closedDone = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// withLazyDeadline returns a child of parent that ends at the earlier of
// parent's deadline and now+d. Its release method must be called when the
// work is done. (It returns no release func: a method value would cost an
// allocation of its own.)
func withLazyDeadline(parent context.Context, d time.Duration) *deadlineCtx {
	now := monoNow()
	c := &deadlineCtx{Context: parent, start: now, at: addSat(now, d)}
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
	for {
		switch st := c.state.Load(); st {
		case endReleased, endDeadline, endParent:
			return closedDone
		case nil:
			a := &armed{done: make(chan struct{})}
			// Locked before it is published, so that nobody sees it half
			// armed: a release racing with this waits, and then stops the
			// timer and the link this starts.
			a.mu.Lock()
			if !c.state.CompareAndSwap(nil, a) {
				a.mu.Unlock()
				continue // ended (or armed) meanwhile
			}
			if a.err = c.currentErr(); a.err != nil {
				close(a.done)
			} else {
				a.timer = time.AfterFunc(c.at-monoNow(), func() { a.end(context.DeadlineExceeded) })
				a.stop = context.AfterFunc(c.Context, func() { a.end(c.Context.Err()) })
			}
			a.mu.Unlock()
			return a.done
		default:
			return st.done
		}
	}
}

func (c *deadlineCtx) Err() error {
	for {
		switch st := c.state.Load(); st {
		case endReleased:
			return context.Canceled
		case endDeadline:
			return context.DeadlineExceeded
		case endParent:
			return c.Context.Err()
		case nil:
			err := c.currentErr()
			if err == nil {
				return nil
			}
			end := endDeadline
			if err != context.DeadlineExceeded {
				end = endParent
			}
			if c.state.CompareAndSwap(nil, end) {
				return err
			}
			// Ended (or armed) meanwhile: answer as that says.
		default:
			st.mu.Lock()
			if st.err == nil {
				if st.err = c.currentErr(); st.err != nil {
					close(st.done)
				}
			}
			err := st.err
			st.mu.Unlock()
			return err
		}
	}
}

// currentErr is the parent's error, else DeadlineExceeded once the deadline
// has passed, else nil.
func (c *deadlineCtx) currentErr() error {
	if err := c.Context.Err(); err != nil {
		return err
	}
	if monoNow() >= c.at {
		return context.DeadlineExceeded
	}
	return nil
}

func (a *armed) end(err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.err != nil {
		return
	}
	a.err = err
	close(a.done)
}

// release stops the timer and unlinks from the parent. The context counts
// as cancelled afterwards, as after context.WithTimeout's cancel. A context
// nobody waited on ends with one compare-and-swap; an armed one ends in the
// critical section in which its timer stops, so a Done racing with release
// either sees the end and starts nothing, or armed first and is stopped
// here.
func (c *deadlineCtx) release() {
	for {
		switch st := c.state.Load(); st {
		case endReleased, endDeadline, endParent:
			return
		case nil:
			if c.state.CompareAndSwap(nil, endReleased) {
				return
			}
		default:
			st.mu.Lock()
			if st.timer != nil {
				st.timer.Stop()
			}
			if st.stop != nil {
				st.stop() // never waits for the callback, which would need st.mu
			}
			if st.err == nil {
				st.err = context.Canceled
				close(st.done)
			}
			st.mu.Unlock()
			return
		}
	}
}

// expired reports whether this context's own deadline has passed: the
// work ran past it, whether or not the parent was cancelled later. A
// deadline the parent set earlier is not this one's.
func (c *deadlineCtx) expired() bool {
	return !c.parentFirst && monoNow() >= c.at
}
