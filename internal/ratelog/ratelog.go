// Package ratelog bounds how many log lines a repeating event makes: the
// first few of each kind in a window are logged, the rest are counted, and
// the next line that is logged says how many were left out. A dependency
// that fails 10,000 times a second then yields a handful of lines a minute,
// and the operator still learns how many failures there were.
package ratelog

import (
	"sync"
	"time"
)

// Limiter decides which events of each kind are logged. The zero value is
// not usable; build one with New. It is safe for concurrent use.
type Limiter struct {
	burst  int
	window time.Duration
	now    func() time.Time // tests replace it

	mu    sync.Mutex
	kinds map[string]*kind
}

type kind struct {
	start      time.Time // of the current window
	logged     int       // in the current window
	suppressed int64     // since the last line logged
}

// maxKinds bounds the memory a Limiter keeps: past it, kinds whose window
// has ended are forgotten (their left-out count with them, which at worst
// loses a "left out" figure, never a first line).
const maxKinds = 1024

// New returns a Limiter that logs the first burst events of each kind in
// every window. burst < 1 is taken as 1, a window <= 0 as a minute.
func New(burst int, window time.Duration) *Limiter {
	if burst < 1 {
		burst = 1
	}
	if window <= 0 {
		window = time.Minute
	}
	return &Limiter{burst: burst, window: window, now: time.Now, kinds: make(map[string]*kind)}
}

// Allow reports whether an event of kind k should be logged now, and how
// many events of that kind were left out since the last one logged (to be
// reported on this line).
func (l *Limiter) Allow(k string) (ok bool, suppressed int64) {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	e := l.kinds[k]
	if e == nil {
		if len(l.kinds) >= maxKinds {
			l.forget(now)
		}
		e = &kind{start: now}
		l.kinds[k] = e
	}
	if now.Sub(e.start) >= l.window {
		e.start, e.logged = now, 0
	}
	if e.logged >= l.burst {
		e.suppressed++
		return false, 0
	}
	e.logged++
	suppressed, e.suppressed = e.suppressed, 0
	return true, suppressed
}

// forget drops the kinds whose window has ended; with l.mu held.
func (l *Limiter) forget(now time.Time) {
	for k, e := range l.kinds {
		if now.Sub(e.start) >= l.window {
			delete(l.kinds, k)
		}
	}
	if len(l.kinds) >= maxKinds { // every kind is busy: start over
		clear(l.kinds)
	}
}
