package demo

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"
)

// Phase is a phase of the run; see the package documentation.
type Phase int

// The phases, in order.
const (
	PhaseSteady Phase = iota
	PhaseSlow
	PhaseFailing
	PhaseProtected
	PhaseRecovered
)

func (p Phase) String() string {
	switch p {
	case PhaseSteady:
		return "steady"
	case PhaseSlow:
		return "slow"
	case PhaseFailing:
		return "failing"
	case PhaseProtected:
		return "protected"
	case PhaseRecovered:
		return "recovered"
	}
	return fmt.Sprintf("Phase(%d)", int(p))
}

// describe is what the phase is about, printed when it begins.
func (p Phase) describe(c Config) string {
	switch p {
	case PhaseSteady:
		return fmt.Sprintf("the payments API answers in about %s", c.BaseLatency)
	case PhaseSlow:
		return fmt.Sprintf("the payments API slows down to %s per call: no errors, but the lag and the oldest message's age climb", c.SlowLatency)
	case PhaseFailing:
		return "the payments API is down: calls fail, retries back off with jitter, the breaker counts failures and opens"
	case PhaseProtected:
		return "still down: the open breaker holds messages (no attempts spent, nothing dead-lettered) and lets a trial call through now and then"
	case PhaseRecovered:
		return "the payments API is back: a trial call closes the breaker and the backlog drains"
	}
	return ""
}

// clock tells the phase from the time since the run began.
type clock struct {
	start time.Time
	ends  [4]time.Duration // end of steady, slow, failing, protected
}

func newClock(start time.Time, c Config) clock {
	k := clock{start: start}
	k.ends[0] = c.Steady
	k.ends[1] = k.ends[0] + c.Slow
	k.ends[2] = k.ends[1] + c.Failing
	k.ends[3] = k.ends[2] + c.Protected
	return k
}

func (k clock) at(elapsed time.Duration) Phase {
	for i, end := range k.ends {
		if elapsed < end {
			return Phase(i)
		}
	}
	return PhaseRecovered
}

func (k clock) now() (time.Duration, Phase) {
	e := time.Since(k.start)
	return e, k.at(e)
}

// beginning returns when p begins, since the start.
func (k clock) beginning(p Phase) time.Duration {
	if p == PhaseSteady {
		return 0
	}
	return k.ends[p-1]
}

// errUnavailable is the payments API's answer while it is down. It is the
// only failure, with timeouts, that counts against the breaker.
var errUnavailable = errors.New("payments API unavailable (503)")

// errUnderReview is the answer for the frozen customer: transient, so it is
// retried, but it never clears.
var errUnderReview = errors.New("customer account under review, try again later")

// payments is the simulated payments API: its latency and its failures
// follow the phase clock.
type payments struct {
	clock       clock
	base, slow  time.Duration
	calls       atomic.Int64
	failures    atomic.Int64
	outageCalls atomic.Int64 // calls made while it was down

	mu  sync.Mutex
	rng *rand.Rand // latency jitter

	trap *trap
}

func newPayments(k clock, c Config, t *trap) *payments {
	return &payments{
		clock: k, base: c.BaseLatency, slow: c.SlowLatency, trap: t,
		rng: rand.New(rand.NewPCG(c.Seed^0xa5a5a5a5, c.Seed+1)),
	}
}

// latency is the latency of a call that begins at elapsed: the base
// latency, climbing linearly to the slow latency over the slow phase, with
// ±20% jitter.
func (p *payments) latency(elapsed time.Duration, ph Phase) time.Duration {
	d := p.base
	switch ph {
	case PhaseSlow:
		from, to := p.clock.beginning(PhaseSlow), p.clock.beginning(PhaseFailing)
		frac := float64(elapsed-from) / float64(to-from)
		d = p.base + time.Duration(frac*float64(p.slow-p.base))
	case PhaseFailing, PhaseProtected:
		d = 5 * time.Millisecond // a refused connection is quick
	}
	p.mu.Lock()
	j := 0.8 + 0.4*p.rng.Float64()
	p.mu.Unlock()
	return time.Duration(float64(d) * j)
}

// down reports whether the API is down in phase ph.
func down(ph Phase) bool { return ph == PhaseFailing || ph == PhaseProtected }

// Charge charges an order. It fails with errUnavailable while the API is
// down (at the start or at the end of the call), and with ctx's error when
// ctx ends first.
func (p *payments) Charge(ctx context.Context, consumerName, orderID string) error {
	p.calls.Add(1)
	elapsed, ph := p.clock.now()
	if down(ph) {
		p.outageCalls.Add(1)
	}
	if p.trap.spring(ctx, consumerName, orderID, elapsed) {
		// The consumer is being killed in the middle of this call.
		<-ctx.Done()
		p.failures.Add(1)
		return ctx.Err()
	}
	t := time.NewTimer(p.latency(elapsed, ph))
	defer t.Stop()
	select {
	case <-ctx.Done():
		p.failures.Add(1)
		return ctx.Err()
	case <-t.C:
	}
	if _, after := p.clock.now(); down(ph) || down(after) {
		p.failures.Add(1)
		return fmt.Errorf("charge %s: %w", orderID, errUnavailable)
	}
	return nil
}

// trap catches one call of the consumer to be killed, once the kill time
// has come, and holds it until that consumer's handlers are cancelled.
type trap struct {
	victim string
	at     time.Duration
	armed  atomic.Bool
	sprung chan string // the order id of the caught call; buffered 1
}

func newTrap(victim string, at time.Duration) *trap {
	t := &trap{victim: victim, at: at, sprung: make(chan string, 1)}
	t.armed.Store(true)
	return t
}

func (t *trap) spring(ctx context.Context, consumerName, orderID string, elapsed time.Duration) bool {
	if consumerName != t.victim || elapsed < t.at || ctx.Err() != nil || !t.armed.CompareAndSwap(true, false) {
		return false
	}
	t.sprung <- orderID
	return true
}

// disarm makes sure the trap catches nothing from now on.
func (t *trap) disarm() { t.armed.Store(false) }
