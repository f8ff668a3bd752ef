package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sony/gobreaker/v2"

	"github.com/ferrymq/ferry/internal/ratelog"
)

// ErrBreakerOpen matches, through errors.Is, the error inside the Hold that
// a Breaker returns while it does not let calls through.
var ErrBreakerOpen = errors.New("circuit breaker open")

// BreakerState is the state of a Breaker.
type BreakerState uint8

const (
	// BreakerClosed lets every call through and counts failures.
	BreakerClosed BreakerState = iota
	// BreakerHalfOpen lets a few trial calls through after the open period;
	// the others are held.
	BreakerHalfOpen
	// BreakerOpen lets no call through; messages are held.
	BreakerOpen
)

func (s BreakerState) String() string {
	switch s {
	case BreakerClosed:
		return "closed"
	case BreakerHalfOpen:
		return "half-open"
	case BreakerOpen:
		return "open"
	}
	return fmt.Sprintf("BreakerState(%d)", uint8(s))
}

// Breaker is a circuit breaker (over github.com/sony/gobreaker/v2) that
// holds messages, instead of failing them, while the dependency behind the
// handler is known to be down.
//
// Closed, it lets every message through and counts consecutive failures
// among the errors that count (see BreakerCounts: by default every error but
// a permanent one, a panic, a hold, a Defer and a cancelled context). Its
// evidence of an outage is the failures of distinct messages: only a
// message's first run (Message.Attempt 1) can count as a failure, while its
// re-runs (Retry's, the loop's in place, a redelivery's) count only when
// they succeed. A poison message that fails with a plain error, run after
// run, is therefore one failure, not five: it spends its retry budget and
// reaches the dead-letter destination while the breaker stays closed for
// everyone else, and an outage, which fails every message, still opens the
// breaker after Failures messages. One case is told apart: where the loop
// holds a failed message in place and its lane waits behind it (a Kafka
// partition), a re-run that fails with nothing succeeded through the
// breaker since the message's last failure counts after all. Every lane
// is then stuck, as in an outage on a topic of fewer partitions than
// Failures, which must still open the breaker; a poison message among
// flowing lanes never makes it so. (When every lane of a Kafka topic is
// held by a poison message at once, that counts too, and the breaker's
// trials then move them on one at a time.) It opens after Failures of them
// in a row, or after Failures within its rolling window when they are at least
// FailureRatio of the calls counted there (an outage whose last slow calls
// still succeed).
//
// Open, it does not call the handler: it returns Hold(ErrBreakerOpen, d),
// with d the time left of the open period. The delivery loop keeps the
// message and its lease (extending it where the broker needs it), does not
// count an attempt, never dead-letters it, and stops fetching for d. After
// OpenFor the breaker is half-open and lets Trials messages through; the
// others are held a little longer (a quarter of OpenFor, at most a second). A
// trial is not spent on a message that has already failed: for that same
// short while after the breaker turned half-open, a re-run is held (a
// quarter of OpenFor for each run that failed) and a message on its first
// run is the trial. Only when none came in that time (on Kafka, every
// partition may be held at a record that failed in the outage) does a
// re-run become the trial: the one that failed fewest times comes back
// first, so the trials of a long outage go round the held messages rather
// than spend one message's attempts. A failed trial opens the breaker
// again; Trials successful ones close it, and the backlog drains by itself.
//
// State, Opened and Held make it observable, for metrics and health checks.
// One Breaker guards one dependency: share it between the consumers that
// call it. Build one with NewBreaker; its Wrap method is a Middleware.
type Breaker struct {
	name string
	// cb is gobreaker's two-step breaker, not CircuitBreaker.Execute: in
	// at-most-once mode the loop takes the call before the ack and the run
	// reports it later, which only the two steps allow, and both kinds of
	// call must count on one breaker. A closed breaker's call is therefore
	// gobreaker's floor for two steps: its lock and a time.Now in each step,
	// and the 48-byte closure Allow returns (Execute would save only that).
	cb       *gobreaker.TwoStepCircuitBreaker[struct{}]
	openFor  time.Duration
	halfHold time.Duration
	counts   func(error) bool
	onChange func(from, to BreakerState)
	errOpen  error
	logger   *slog.Logger // nil: the Loop's (Logger)
	logs     *ratelog.Limiter

	// changes are the state changes not yet logged: gobreaker reports them
	// under its lock, and they are logged after the call, with its context.
	// pending says there are some, so that a call that made none (almost
	// every call) does not take changesMu to find out.
	changesMu sync.Mutex
	changes   []breakerChange
	pending   atomic.Bool

	successes  atomic.Int64 // calls that succeeded (for breakerMark)
	openedAt   atomic.Int64 // unix nanoseconds of the last opening
	halfOpenAt atomic.Int64 // monotonic nanoseconds (monoNow) of the last turn to half-open
	registered atomic.Bool  // its metrics were registered by hand (Stack.RegisterMetrics)
	opened     atomic.Int64
	held       atomic.Int64
}

// BreakerOption configures NewBreaker.
type BreakerOption func(*breakerConfig) error

// breakerChange is one change of state.
type breakerChange struct {
	from, to BreakerState
	at       time.Time
}

type breakerConfig struct {
	logger   *slog.Logger
	name     string
	failures int
	ratio    float64
	window   time.Duration
	openFor  time.Duration
	trials   int
	counts   func(error) bool
	onChange func(from, to BreakerState)
}

// BreakerName names the breaker in its errors. Default "ferry".
func BreakerName(name string) BreakerOption {
	return func(c *breakerConfig) error {
		if name == "" {
			return ConfigErrorf("Breaker.Name", "must not be empty")
		}
		c.name = name
		return nil
	}
}

// BreakerFailures sets how many counted failures open the breaker: that
// many in a row, or that many within the window (BreakerWindow) when they
// are at least BreakerFailureRatio of the calls counted in it. Default 5.
func BreakerFailures(n int) BreakerOption {
	return func(c *breakerConfig) error {
		if n < 1 {
			return ConfigErrorf("Breaker.Failures", "must be >= 1, got %d", n)
		}
		c.failures = n
		return nil
	}
}

// BreakerFailureRatio sets the share of failures among the calls counted in
// the window from which BreakerFailures failures open the breaker, even when
// successes came in between. A dependency that fails fast while its last
// slow calls still succeed breaks every run of consecutive failures, and
// only the ratio opens the breaker in time. Default 0.5.
func BreakerFailureRatio(r float64) BreakerOption {
	return func(c *breakerConfig) error {
		if !(r > 0 && r <= 1) {
			return ConfigErrorf("Breaker.FailureRatio", "must be in (0, 1], got %v", r)
		}
		c.ratio = r
		return nil
	}
}

// BreakerWindow sets the rolling window over which failures and successes
// are counted while the breaker is closed. Default 10s.
func BreakerWindow(d time.Duration) BreakerOption {
	return func(c *breakerConfig) error {
		if d <= 0 {
			return ConfigErrorf("Breaker.Window", "must be > 0, got %s", d)
		}
		c.window = d
		return nil
	}
}

// BreakerOpenFor sets how long the breaker stays open before it lets a trial
// through. Default 10s.
func BreakerOpenFor(d time.Duration) BreakerOption {
	return func(c *breakerConfig) error {
		if d <= 0 {
			return ConfigErrorf("Breaker.OpenFor", "must be > 0, got %s", d)
		}
		c.openFor = d
		return nil
	}
}

// BreakerTrials sets how many trial calls the half-open breaker lets through,
// and how many of them must succeed to close it. Default 1.
func BreakerTrials(n int) BreakerOption {
	return func(c *breakerConfig) error {
		if n < 1 || n > 1<<20 {
			return ConfigErrorf("Breaker.Trials", "must be between 1 and 2^20, got %d", n)
		}
		c.trials = n
		return nil
	}
}

// BreakerCounts chooses which errors count as failures of the dependency;
// the others neither open nor close the breaker. A hold never counts,
// whatever counts says. Default DefaultBreakerCounts.
func BreakerCounts(counts func(err error) bool) BreakerOption {
	return func(c *breakerConfig) error {
		if counts == nil {
			return ConfigErrorf("Breaker.Counts", "must not be nil")
		}
		c.counts = counts
		return nil
	}
}

// BreakerOnStateChange sets a function called on every change of state, for
// logs and metrics. It runs under the breaker's lock: keep it short and do
// not call the breaker from it. Default none.
func BreakerOnStateChange(f func(from, to BreakerState)) BreakerOption {
	return func(c *breakerConfig) error {
		c.onChange = f
		return nil
	}
}

// BreakerLogger sets where the breaker logs its changes of state: opening
// (Warn, with the failure that opened it and the time it stays open),
// half-open and closing (Info), a few lines a minute. Default the logger of
// the Loop whose message made the change (Logger), or slog.Default().
func BreakerLogger(l *slog.Logger) BreakerOption {
	return func(c *breakerConfig) error {
		if l == nil {
			return ConfigErrorf("Breaker.Logger", "must not be nil")
		}
		c.logger = l
		return nil
	}
}

// DefaultBreakerCounts counts every error as a failure of the dependency
// except a permanent error (bad input says nothing about the dependency), a
// panic (a bug in the handler, not an outage), a hold, a Defer (the handler
// did not run), and context.Canceled (the consumer is shutting down).
func DefaultBreakerCounts(err error) bool {
	var p *PanicError
	return !IsPermanent(err) && !errors.Is(err, ErrHeld) && !IsDeferred(err) &&
		!errors.Is(err, context.Canceled) && !errors.As(err, &p)
}

// NewBreaker returns a closed Breaker. It fails with a *ConfigError naming
// the field when an option is invalid.
func NewBreaker(opts ...BreakerOption) (*Breaker, error) {
	c := breakerConfig{name: "ferry", failures: 5, ratio: 0.5, window: 10 * time.Second, openFor: 10 * time.Second, trials: 1, counts: DefaultBreakerCounts}
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o(&c); err != nil {
			return nil, err
		}
	}
	b := &Breaker{
		name:     c.name,
		openFor:  c.openFor,
		halfHold: min(max(c.openFor/4, time.Millisecond), time.Second),
		counts:   c.counts,
		onChange: c.onChange,
		errOpen:  fmt.Errorf("ferry: breaker %q: %w", c.name, ErrBreakerOpen),
		logger:   c.logger,
		logs:     ratelog.New(10, time.Minute),
	}
	failures, ratio := uint32(c.failures), c.ratio
	b.cb = gobreaker.NewTwoStepCircuitBreaker[struct{}](gobreaker.Settings{
		Name:         c.name,
		MaxRequests:  uint32(c.trials),
		Timeout:      c.openFor,
		Interval:     c.window,
		BucketPeriod: max(c.window/10, time.Millisecond),
		ReadyToTrip: func(n gobreaker.Counts) bool {
			if n.ConsecutiveFailures >= failures {
				return true
			}
			counted := n.TotalSuccesses + n.TotalFailures
			return n.TotalFailures >= failures && float64(n.TotalFailures) >= ratio*float64(counted)
		},
		IsExcluded: func(err error) bool {
			return err != nil && (err == errGateUnused || err == errRerunFailed || errors.Is(err, ErrHeld) || !b.counts(err))
		},
		OnStateChange: func(_ string, from, to gobreaker.State) {
			switch to {
			case gobreaker.StateOpen:
				b.openedAt.Store(time.Now().UnixNano())
				b.opened.Add(1)
			case gobreaker.StateHalfOpen:
				b.halfOpenAt.Store(int64(monoNow()))
			}
			b.changesMu.Lock()
			if len(b.changes) < 16 {
				b.changes = append(b.changes, breakerChange{from: fromGobreaker(from), to: fromGobreaker(to), at: time.Now()})
				b.pending.Store(true)
			}
			b.changesMu.Unlock()
			if b.onChange != nil {
				b.onChange(fromGobreaker(from), fromGobreaker(to))
			}
		},
	})
	return b, nil
}

func fromGobreaker(s gobreaker.State) BreakerState {
	switch s {
	case gobreaker.StateOpen:
		return BreakerOpen
	case gobreaker.StateHalfOpen:
		return BreakerHalfOpen
	}
	return BreakerClosed
}

// Name returns the breaker's name (BreakerName).
func (b *Breaker) Name() string { return b.name }

// State returns the breaker's state now.
func (b *Breaker) State() BreakerState { return fromGobreaker(b.cb.State()) }

// Opened returns how many times the breaker has opened.
func (b *Breaker) Opened() int64 { return b.opened.Load() }

// Held returns how many times the breaker held a message instead of calling
// the handler.
func (b *Breaker) Held() int64 { return b.held.Load() }

// Wrap returns next guarded by the breaker. b.Wrap is a Middleware.
func (b *Breaker) Wrap(next Handler) Handler {
	return &breakerHandler{b: b, next: next}
}

type breakerHandler struct {
	b    *Breaker
	next Handler
}

func (h *breakerHandler) Handle(ctx context.Context, m *Message) error {
	ctx, rec := withRecord(ctx)
	call, reserved := takeReservation(ctx, h.b) // taken before an at-most-once ack
	if !reserved {
		var hold error
		if call, hold = h.b.allow(m, rec); hold != nil {
			h.b.logChanges(ctx, nil)
			return hold
		}
	}
	finished := false
	defer func() {
		if !finished { // next panicked: a panic is not the dependency's failure
			call.done(&PanicError{Value: "breaker: handler panicked"})
		}
	}()
	err := h.next.Handle(ctx, m)
	finished = true
	h.b.report(call, rec, err)
	h.b.logChanges(ctx, err)
	return err
}

// report reports the outcome of call, and notes it in rec: a success
// counts, a failure marks the message with the successes so far.
func (b *Breaker) report(call breakerCall, rec *record, err error) {
	switch {
	case err == nil:
		b.successes.Add(1)
	case b.counts(err) && !errors.Is(err, ErrHeld):
		rec.failMark = breakerMark{b: b, successes: b.successes.Load()}
	}
	call.report(err)
}

// logChanges logs the changes of state not yet logged; cause is the result
// of the call that made them, if a call did.
func (b *Breaker) logChanges(ctx context.Context, cause error) {
	if !b.pending.Load() {
		return
	}
	b.changesMu.Lock()
	changes := b.changes
	b.changes = nil
	b.pending.Store(false)
	b.changesMu.Unlock()
	if len(changes) == 0 {
		return
	}
	log := b.logger
	if log == nil {
		log = Logger(ctx)
	}
	for _, c := range changes {
		ok, left := b.logs.Allow("")
		if !ok {
			continue
		}
		attrs := []slog.Attr{slog.String("breaker", b.name), slog.String("from", c.from.String()), slog.Int64("unlogged", left)}
		switch c.to {
		case BreakerOpen:
			attrs = append(attrs, slog.Duration("open_for", b.openFor), slog.Int64("opened", b.opened.Load()))
			if cause != nil {
				attrs = append(attrs, slog.Any("err", cause), slog.String("error_type", errorType(cause)))
			}
			log.LogAttrs(ctx, slog.LevelWarn, "ferry: circuit breaker opened; holding messages (they keep their attempts)", attrs...)
		case BreakerHalfOpen:
			log.LogAttrs(ctx, slog.LevelInfo, "ferry: circuit breaker half-open; letting a trial through", attrs...)
		default:
			log.LogAttrs(ctx, slog.LevelInfo, "ferry: circuit breaker closed; consuming again", attrs...)
		}
	}
}

// Unwrap returns the handler the breaker guards.
func (h *breakerHandler) Unwrap() Handler { return h.next }

func (h *breakerHandler) breaker() *Breaker { return h.b }

// errRerunFailed is what a breaker call reports for a failed re-run while
// the breaker was closed: the message's first failure already counted, and
// its re-runs are no new evidence of an outage.
var errRerunFailed = errors.New("ferry: a re-run failed again")

// breakerCall is one call the breaker let through.
type breakerCall struct {
	done func(error) // gobreaker's: reports the call's outcome
	// evidence is false for a re-run let through while the breaker was
	// closed: its failure does not count, its success does.
	evidence bool
}

// report reports the outcome of the call.
func (c breakerCall) report(err error) {
	if err != nil && !c.evidence {
		err = errRerunFailed
	}
	c.done(err)
}

// allow asks for one call for m's run, whose delivery's record is rec.
// While the breaker does not let calls through, it returns the Hold
// instead.
func (b *Breaker) allow(m *Message, rec *record) (breakerCall, error) {
	failedBefore := m != nil && m.Attempt > 1
	rerun := failedBefore // a re-run's failure is no evidence, unless...
	// A re-run is evidence after all when its lane waits for it (the loop
	// holds it in place) and nothing has succeeded through the breaker
	// since its last failure: every lane is stuck, which a poison message
	// among flowing traffic never makes, and an outage on a topic of few
	// partitions always does.
	if rerun && rec != nil && rec.inPlace && rec.failMark.b == b && rec.failMark.successes == b.successes.Load() {
		rerun = false
	}
	// Only a message that failed before needs the state before its call
	// (a first run is evidence in any state, and may make the trial), so
	// a first run costs gobreaker's two steps and nothing more: State
	// takes gobreaker's lock and reads the wall clock, which was a quarter
	// of a closed breaker's cost. Whether its failure is evidence or not,
	// a message that failed before leaves the trial to one that has not.
	state := gobreaker.StateClosed
	if failedBefore {
		state = b.cb.State()
		switch {
		case state == gobreaker.StateOpen:
			// Held, without asking gobreaker: its open period may end
			// between State and Allow, and the re-run would then take
			// the trial that the rule below keeps for a message that has
			// not failed yet. Held to the end of the period, it comes
			// back inside the rule's window.
			b.held.Add(1)
			return breakerCall{}, Hold(b.errOpen, b.remaining())
		case state == gobreaker.StateHalfOpen && monoNow()-time.Duration(b.halfOpenAt.Load()) < b.halfHold:
			// Keep the trial for a message that has not failed yet, or
			// failed fewer times: held a half-hold for each failure, the
			// message with the fewest comes back first, once the window
			// is over, and makes the trial. The trials of a long outage
			// so go round the held messages, rather than spend the
			// attempts of the one that happened to wake first each time
			// (a good message dead-lettered while the others kept theirs).
			b.held.Add(1)
			return breakerCall{}, Hold(b.errOpen, min(b.halfHold*time.Duration(m.Attempt-1), b.openFor))
		}
	}
	done, err := b.cb.Allow()
	switch {
	case err == nil:
		return breakerCall{done: done, evidence: !rerun || state != gobreaker.StateClosed}, nil
	case errors.Is(err, gobreaker.ErrOpenState):
		b.held.Add(1)
		return breakerCall{}, Hold(b.errOpen, b.remaining())
	case errors.Is(err, gobreaker.ErrTooManyRequests):
		b.held.Add(1)
		return breakerCall{}, Hold(b.errOpen, b.halfHold)
	}
	return breakerCall{}, err
}

// remaining returns the time left of the open period, at least a
// millisecond.
func (b *Breaker) remaining() time.Duration {
	left := time.Until(time.Unix(0, b.openedAt.Load()).Add(b.openFor))
	return max(left, time.Millisecond)
}
