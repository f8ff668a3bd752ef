package consumer

import (
	"math"
	"math/rand/v2"
	"time"
)

// backoff is the delay schedule of the Retry middleware: exponential growth
// from initial by multiplier, capped, with jitter.
//
// step(n) is the capped exponential step before try n+1 (n >= 1 tries made):
// initial * multiplier^(n-1), at most max. Two kinds of delay come from it:
//
//   - inProcess(n): full jitter, a uniform random delay in [0, step(n)). Many
//     consumers that failed together spread their next calls over the whole
//     interval instead of calling again in lock step.
//   - redelivery(n, max): "equal" jitter, uniform in [step/2, step] with its
//     own cap, so a message handed back to the broker never comes back at
//     once, and redeliveries of messages that failed together are spread.
//
// Without jitter both return the step itself.
type backoff struct {
	initial    time.Duration
	multiplier float64
	max        time.Duration
	jitter     bool
}

// step returns initial*multiplier^(n-1), capped at limit. n < 1 counts as 1.
func (b backoff) step(n int, limit time.Duration) time.Duration {
	if n < 1 {
		n = 1
	}
	d := float64(b.initial) * math.Pow(b.multiplier, float64(n-1))
	if d >= float64(limit) || math.IsInf(d, 0) || math.IsNaN(d) {
		return limit
	}
	return time.Duration(d)
}

// inProcess returns the delay before try n+1 within one delivery, with full
// jitter when jitter is on.
func (b backoff) inProcess(n int) time.Duration {
	s := b.step(n, b.max)
	if !b.jitter || s <= 0 {
		return s
	}
	return time.Duration(rand.Int64N(int64(s)))
}

// redelivery returns the delay before the broker delivers the message again
// after n tries, capped at limit: uniform in [step/2, step] with jitter on.
// It is never zero when initial is positive.
func (b backoff) redelivery(n int, limit time.Duration) time.Duration {
	s := b.step(n, limit)
	if !b.jitter || s <= 1 {
		return s
	}
	half := s / 2
	return half + time.Duration(rand.Int64N(int64(s-half)+1))
}
