package consumer

import (
	"context"
	"errors"
	"log/slog"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/ferrymq/ferry/internal/ratelog"
)

// Retry runs a failing handler again within one delivery, with exponential
// backoff and full jitter, and hands the message back to the broker with a
// growing, jittered delay once its budget for the delivery is spent.
//
// A run that returns a plain error (or a panic turned into a *PanicError by
// Recover, or a timeout) is run again after a random delay between zero and
// the capped exponential step: Initial, then Initial*Multiplier, and so on up
// to MaxInterval. Retry stops at once, and returns the error as it is, when:
//
//   - the error is permanent (Permanent): no retry can fix it;
//   - the message was held (Hold, from a circuit breaker): it was not
//     attempted, and the delivery loop keeps it;
//   - the handler asked for a delay of its own (RetryAfter): the broker
//     honours it;
//   - the delivery's context is done (shutdown, or a lost lane);
//   - a dead-letter publish failed (*DeadLetterError): the message must go
//     back to the broker untouched.
//
// When the runs of a delivery are spent (Attempts runs, or MaxElapsed time,
// or the message's MaxAttempts of a DeadLetter middleware reached), Retry
// returns RetryAfter(lastErr, d): the broker delivers the message again no
// sooner than d, where d keeps growing with Message.Attempt (the exponential
// continued from the runs already made, capped at RedeliveryMax) and is
// jittered over [d/2, d], so messages that failed together do not come back
// together and none comes back immediately.
//
// How runs are counted across redeliveries, and how that agrees with a
// DeadLetter middleware on either side of Retry, is described on DeadLetter.
//
// Build one with NewRetry; its Wrap method is a Middleware.
type Retry struct {
	retryConfig
	sleep func(ctx context.Context, d time.Duration) error // tests replace it
	logs  *ratelog.Limiter

	registered atomic.Bool  // its metrics were registered by hand (Stack.RegisterMetrics)
	retries    atomic.Int64 // in-process re-runs
	givenBack  atomic.Int64 // deliveries returned to the broker with a delay
}

// Retries returns how many times Retry ran a handler again in process.
func (r *Retry) Retries() int64 { return r.retries.Load() }

// GivenBack returns how many deliveries Retry returned to the broker with a
// redelivery delay after spending its in-process budget.
func (r *Retry) GivenBack() int64 { return r.givenBack.Load() }

// RetryOption configures NewRetry.
type RetryOption func(*retryConfig) error

// retryConfig is what the RetryOptions set.
type retryConfig struct {
	attempts      int
	maxElapsed    time.Duration
	redeliveryMax time.Duration
	b             backoff
	logger        *slog.Logger // nil: the Loop's (Logger)
}

// RetryAttempts sets how many times a delivery runs the handler in process,
// the first run included. 1 makes no in-process retry: each failure goes back
// to the broker with a jittered, growing delay. Default 3.
func RetryAttempts(n int) RetryOption {
	return func(c *retryConfig) error {
		if n < 1 {
			return ConfigErrorf("Retry.Attempts", "must be >= 1, got %d", n)
		}
		c.attempts = n
		return nil
	}
}

// RetryInitial sets the first backoff step. Default 100ms.
func RetryInitial(d time.Duration) RetryOption {
	return func(c *retryConfig) error {
		if d <= 0 {
			return ConfigErrorf("Retry.Initial", "must be > 0, got %s", d)
		}
		c.b.initial = d
		return nil
	}
}

// RetryMultiplier sets the growth of each backoff step over the one before.
// Default 2.
func RetryMultiplier(f float64) RetryOption {
	return func(c *retryConfig) error {
		if !(f >= 1) || f > 1e6 {
			return ConfigErrorf("Retry.Multiplier", "must be between 1 and 1e6, got %g", f)
		}
		c.b.multiplier = f
		return nil
	}
}

// RetryMaxInterval caps one in-process backoff step. Default 2s.
func RetryMaxInterval(d time.Duration) RetryOption {
	return func(c *retryConfig) error {
		if d <= 0 {
			return ConfigErrorf("Retry.MaxInterval", "must be > 0, got %s", d)
		}
		c.b.max = d
		return nil
	}
}

// RetryMaxElapsed bounds the time one delivery spends in Retry: no further
// run starts when its backoff would end past this bound since the first run
// began, and the message goes back to the broker instead. Default 10s.
func RetryMaxElapsed(d time.Duration) RetryOption {
	return func(c *retryConfig) error {
		if d <= 0 {
			return ConfigErrorf("Retry.MaxElapsed", "must be > 0, got %s", d)
		}
		c.maxElapsed = d
		return nil
	}
}

// RetryRedeliveryMax caps the delay with which a message whose in-process
// budget is spent goes back to the broker. Default 1m. (SQS accepts at most
// 12h.)
func RetryRedeliveryMax(d time.Duration) RetryOption {
	return func(c *retryConfig) error {
		if d <= 0 {
			return ConfigErrorf("Retry.RedeliveryMax", "must be > 0, got %s", d)
		}
		c.redeliveryMax = d
		return nil
	}
}

// RetryLogger sets where Retry logs a delivery whose in-process runs are
// spent (Warn: it goes back to the broker with a delay), a few lines a
// minute for each type of error, with the count of those left out. Default
// the logger of the Loop running the handler (Logger), or slog.Default()
// outside one.
func RetryLogger(l *slog.Logger) RetryOption {
	return func(c *retryConfig) error {
		if l == nil {
			return ConfigErrorf("Retry.Logger", "must not be nil")
		}
		c.logger = l
		return nil
	}
}

// RetryJitter turns jitter on or off. With jitter off every delay is the
// exponential step itself, and consumers that failed together retry
// together; turn it off only to make delays predictable in a test. Default
// on.
func RetryJitter(on bool) RetryOption {
	return func(c *retryConfig) error {
		c.b.jitter = on
		return nil
	}
}

// NewRetry returns a Retry. It fails with a *ConfigError naming the field
// when an option is invalid, or when MaxInterval is below Initial.
func NewRetry(opts ...RetryOption) (*Retry, error) {
	c := retryConfig{
		attempts:      3,
		maxElapsed:    10 * time.Second,
		redeliveryMax: time.Minute,
		b:             backoff{initial: 100 * time.Millisecond, multiplier: 2, max: 2 * time.Second, jitter: true},
	}
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o(&c); err != nil {
			return nil, err
		}
	}
	if c.b.max < c.b.initial {
		return nil, ConfigErrorf("Retry.MaxInterval", "%s is below Initial %s", c.b.max, c.b.initial)
	}
	return &Retry{retryConfig: c, sleep: sleepCtx, logs: ratelog.New(5, time.Minute)}, nil
}

// Wrap returns next wrapped in the retry behaviour. r.Wrap is a Middleware.
func (r *Retry) Wrap(next Handler) Handler {
	return &retryHandler{r: r, next: next, timed: timedBelow(next)}
}

type retryHandler struct {
	r    *Retry
	next Handler
	// timed says a Timeout runs every run of next, with nothing but
	// breakers before it: the time it reads as a run begins is when the run
	// began for MaxElapsed too, and Retry need not read the clock itself.
	timed bool
}

// timedBelow reports whether next is a Timeout, or breakers around one.
// A breaker only asks gobreaker before it runs next, so the Timeout's
// reading of the clock is the run's start to within microseconds; any other
// layer might wait (a rate limiter) and is not counted on.
func timedBelow(next Handler) bool {
	for range maxChainDepth {
		switch h := next.(type) {
		case *timeoutHandler:
			return true
		case *breakerHandler:
			next = h.next
		default:
			return false
		}
	}
	return false
}

func (h *retryHandler) Handle(ctx context.Context, m *Message) error {
	return h.r.handle(ctx, m, h.next, h.timed)
}

// Unwrap returns the handler Retry runs.
func (h *retryHandler) Unwrap() Handler { return h.next }

func (h *retryHandler) retrier() *Retry { return h.r }

// handle runs next until it succeeds or the budget is spent. timed says
// a Timeout below notes when each run began (see retryHandler), so that a
// delivery whose first run succeeds, nearly all of them, reads no clock
// here.
func (r *Retry) handle(ctx context.Context, m *Message, next Handler, timed bool) error {
	ctx, rec := withRecord(ctx)
	if m.Attempt < 1 {
		m.Attempt = 1
	}
	var start time.Duration // when the first run began
	if timed {
		rec.runStart = 0
	} else {
		start = monoNow()
	}
	for run := 1; ; run++ {
		err := next.Handle(ctx, m)
		if err == nil {
			return nil
		}
		if stopsRetry(ctx, err) {
			return err
		}
		if run == 1 && timed {
			if start = rec.runStart; start == 0 {
				start = monoNow() // returned before its Timeout ran: it took no time
			}
		}
		rec.failed(time.Now())
		if run >= r.attempts || rec.spent(m) {
			return r.giveBack(ctx, m, err, run)
		}
		d := r.b.inProcess(run)
		if monoNow()-start+d > r.maxElapsed {
			return r.giveBack(ctx, m, err, run)
		}
		addRunEvent(ctx, EventRetry, func() []attribute.KeyValue { return retryEventAttrs(m.Attempt+1, d, err) })
		if serr := r.sleep(ctx, d); serr != nil {
			return err
		}
		r.retries.Add(1)
		m.Attempt++ // the next run
	}
}

// giveBack returns err to the broker with the redelivery delay for m, after
// runs failed runs of this delivery.
func (r *Retry) giveBack(ctx context.Context, m *Message, err error, runs int) error {
	r.givenBack.Add(1)
	d := r.b.redelivery(max(m.Attempt, 1), r.redeliveryMax)
	if ok, left := r.logs.Allow(errorType(err)); ok {
		log := r.logger
		if log == nil {
			log = Logger(ctx)
		}
		log.LogAttrs(ctx, slog.LevelWarn, "ferry: retries spent; the message goes back to the broker",
			slog.String("source", m.Source), slog.String("id", m.ID), slog.Int("attempt", m.Attempt),
			slog.Int("runs", runs), slog.Duration("redelivery_in", d), slog.Any("err", err),
			slog.String("error_type", errorType(err)), slog.Int64("unlogged", left))
	}
	return RetryAfter(err, d)
}

// stopsRetry reports whether err ends the in-process retries at once.
func stopsRetry(ctx context.Context, err error) bool {
	if ctx.Err() != nil || IsPermanent(err) || IsHeld(err) || IsDeferred(err) || IsRetryAfter(err) {
		return true
	}
	var dl *DeadLetterError
	return errors.As(err, &dl)
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
