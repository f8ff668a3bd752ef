package consumer

import (
	"time"
)

// Stack is the recommended composition of the shared middleware, built by
// Standard. Its Wrap handles a message as
//
//	DeadLetter → Retry → Breaker → [RateLimit →] Timeout → Recover → handler
//
// (outermost first; RateLimit only with StandardRateLimit), for these
// reasons:
//
//   - Recover is innermost, so a panic is an error (*PanicError) to every
//     other layer: the breaker counts it, Retry retries it, DeadLetter records
//     it as a panic.
//   - Timeout is inside Retry, so each run has its own deadline rather than
//     one deadline for all the runs of a delivery, and inside the breaker, so
//     a run that timed out counts as a failure of the dependency.
//   - The breaker is inside Retry, so it sees every call made to the
//     dependency and opens after Failures calls, not after Failures whole
//     retry sequences; once it is open, Retry's next run is held at once
//     instead of spending the budget, and Retry passes the hold out.
//   - The rate limit is inside the breaker and Retry, so that each call to
//     the dependency takes a turn and an open breaker takes none, and outside
//     Timeout, so that waiting for a turn does not eat into a run's deadline.
//   - DeadLetter is outermost, so it judges the final outcome of a delivery:
//     a hold is never dead-lettered, a failed dead-letter publish never counts
//     against the dependency's breaker, and Retry stops exactly at
//     MaxAttempts (see DeadLetter for how attempts are counted).
//
// The guarantees do not depend on this order: DeadLetter and Retry agree on
// attempts on either side of each other, and holds pass through every layer.
// The order above is the one that makes the fewest calls to a dependency that
// is down.
//
// The fields are the parts, for observing them (DeadLetter.Count,
// Breaker.State) or composing them differently.
type Stack struct {
	DeadLetter *DeadLetter
	Retry      *Retry
	Breaker    *Breaker
	// RateLimit caps the runs started a second; nil for none.
	RateLimit *RateLimit
	// Timeout is the deadline of each run of the handler; 0 for none.
	Timeout time.Duration
}

// StandardOption configures Standard.
type StandardOption func(*standardConfig) error

type standardConfig struct {
	retry      []RetryOption
	breaker    []BreakerOption
	shared     *Breaker
	deadLetter []DeadLetterOption
	timeout    time.Duration
	rate       float64
	rateSet    bool
	rateOpts   []RateLimitOption
}

// StandardRetry passes options to the stack's Retry. Default NewRetry's
// defaults.
func StandardRetry(opts ...RetryOption) StandardOption {
	return func(c *standardConfig) error {
		c.retry = append(c.retry, opts...)
		return nil
	}
}

// StandardBreaker passes options to the stack's Breaker. Default NewBreaker's
// defaults.
func StandardBreaker(opts ...BreakerOption) StandardOption {
	return func(c *standardConfig) error {
		c.breaker = append(c.breaker, opts...)
		return nil
	}
}

// StandardUseBreaker makes the stack use b, so that several consumers that
// call the same dependency share one breaker. StandardBreaker options are
// then not allowed. Default a breaker of the stack's own.
func StandardUseBreaker(b *Breaker) StandardOption {
	return func(c *standardConfig) error {
		if b == nil {
			return ConfigErrorf("Standard.Breaker", "must not be nil")
		}
		c.shared = b
		return nil
	}
}

// StandardDeadLetter passes options to the stack's DeadLetter. Default
// NewDeadLetter's defaults.
func StandardDeadLetter(opts ...DeadLetterOption) StandardOption {
	return func(c *standardConfig) error {
		c.deadLetter = append(c.deadLetter, opts...)
		return nil
	}
}

// StandardTimeout sets the deadline of each run of the handler; 0 sets
// none. Default 30s.
func StandardTimeout(d time.Duration) StandardOption {
	return func(c *standardConfig) error {
		if d < 0 {
			return ConfigErrorf("Standard.Timeout", "must be >= 0, got %s", d)
		}
		c.timeout = d
		return nil
	}
}

// StandardRateLimit adds a RateLimit of perSecond runs a second to the
// stack, inside the breaker and outside the timeout (see Stack), with opts
// passed to NewRateLimit. Default: no rate limit.
func StandardRateLimit(perSecond float64, opts ...RateLimitOption) StandardOption {
	return func(c *standardConfig) error {
		c.rate, c.rateOpts, c.rateSet = perSecond, opts, true
		return nil
	}
}

// Standard returns the recommended middleware stack, dead-lettering through
// pub to dlqDestination. It fails with a *ConfigError naming the field when
// an argument or option is invalid.
func Standard(pub Publisher, dlqDestination string, opts ...StandardOption) (*Stack, error) {
	c := standardConfig{timeout: 30 * time.Second}
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o(&c); err != nil {
			return nil, err
		}
	}
	if c.shared != nil && len(c.breaker) > 0 {
		return nil, ConfigErrorf("Standard.Breaker", "options given together with a shared breaker")
	}
	dl, err := NewDeadLetter(pub, dlqDestination, c.deadLetter...)
	if err != nil {
		return nil, err
	}
	rt, err := NewRetry(c.retry...)
	if err != nil {
		return nil, err
	}
	br := c.shared
	if br == nil {
		if br, err = NewBreaker(c.breaker...); err != nil {
			return nil, err
		}
	}
	st := &Stack{DeadLetter: dl, Retry: rt, Breaker: br, Timeout: c.timeout}
	if c.rateSet {
		if st.RateLimit, err = NewRateLimit(c.rate, c.rateOpts...); err != nil {
			return nil, err
		}
	}
	return st, nil
}

// layers returns the stack's layers, outermost first, for Chain. A nil
// part is left out, so a Stack literal may hold only the parts it wants.
func (s *Stack) layers() []Middleware {
	mws := make([]Middleware, 0, 6)
	if s.DeadLetter != nil {
		mws = append(mws, s.DeadLetter.Wrap)
	}
	if s.Retry != nil {
		mws = append(mws, s.Retry.Wrap)
	}
	if s.Breaker != nil {
		mws = append(mws, s.Breaker.Wrap)
	}
	if s.RateLimit != nil {
		mws = append(mws, s.RateLimit.Wrap)
	}
	return append(mws, Timeout(s.Timeout), Recover())
}

// Wrap returns h wrapped in the stack. s.Wrap is a Middleware.
func (s *Stack) Wrap(h Handler) Handler {
	return Chain(h, s.layers()...)
}
