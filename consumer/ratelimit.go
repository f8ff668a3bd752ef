package consumer

import (
	"context"
	"errors"
	"math"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"golang.org/x/time/rate"
)

// RateLimit caps how many handler runs start a second (over
// golang.org/x/time/rate's token bucket), for a dependency that takes only
// so many calls: a partner API's quota, a database that a backlog's drain
// would swamp. It is one consumer's limit or, shared between consumers (one
// RateLimit wrapping several handlers), one for all of them.
//
// A run whose turn has not come waits for it before the handler is called:
// the wait is not an attempt and never fails the message, the loop keeps
// the message's lease while it waits (as for any running handler), and
// once every worker waits no more is fetched (the loop's in-flight bound),
// so a backlog stays at the broker rather than in the process. A run whose
// context ends first (the consumer stopping, its lane taken away, or a
// deadline that comes before its turn) is not attempted: it gives its turn
// back and returns a Defer, so the message comes back (in at-most-once mode,
// where the message was acked before it ran, it is dropped, as any run cut
// short there).
//
// Put it inside Retry and the Breaker, so that each re-run takes a turn of
// its own and an open breaker takes none, and outside Timeout, so that the
// wait is not counted against a run's deadline: StandardRateLimit places it
// so. Use one RateLimit in a chain.
//
// Waited, Waiting and WaitedFor make it observable; a Loop reports them as
// ferry.ratelimit.* metrics. Build one with NewRateLimit; its Wrap method is
// a Middleware.
type RateLimit struct {
	perSecond float64
	lim       *rate.Limiter

	registered atomic.Bool  // its metrics were registered by hand
	waited     atomic.Int64 // runs that waited for their turn
	waiting    atomic.Int64 // runs waiting now
	waitedNs   atomic.Int64 // nanoseconds spent waiting
}

// ErrRateLimited matches, through errors.Is, the error inside the Defer
// with which a RateLimit hands back a message whose wait for its turn was
// cut short (the consumer stopping, its lane taken away, or a deadline
// before its turn).
var ErrRateLimited = errors.New("rate limited")

// RateLimitOption configures NewRateLimit.
type RateLimitOption func(*rateLimitConfig) error

type rateLimitConfig struct {
	burst int
}

// RateLimitBurst sets how many runs may start at once after a quiet
// while: the bucket's size. Default 1: runs start evenly spaced, never more
// than the rate in any interval.
func RateLimitBurst(n int) RateLimitOption {
	return func(c *rateLimitConfig) error {
		if n < 1 {
			return ConfigErrorf("RateLimit.Burst", "must be >= 1, got %d", n)
		}
		c.burst = n
		return nil
	}
}

// NewRateLimit returns a RateLimit that lets perSecond runs start a second.
// It fails with a *ConfigError naming the field when perSecond is not a
// positive finite rate or an option is invalid.
func NewRateLimit(perSecond float64, opts ...RateLimitOption) (*RateLimit, error) {
	if !(perSecond > 0) || math.IsInf(perSecond, 1) {
		return nil, ConfigErrorf("RateLimit.PerSecond", "must be a positive finite rate, got %v", perSecond)
	}
	c := rateLimitConfig{burst: 1}
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o(&c); err != nil {
			return nil, err
		}
	}
	return &RateLimit{perSecond: perSecond, lim: rate.NewLimiter(rate.Limit(perSecond), c.burst)}, nil
}

// Waited returns how many runs waited for their turn.
func (r *RateLimit) Waited() int64 { return r.waited.Load() }

// Waiting returns how many runs wait for their turn now.
func (r *RateLimit) Waiting() int64 { return r.waiting.Load() }

// WaitedFor returns the time runs spent waiting for their turn, summed.
func (r *RateLimit) WaitedFor() time.Duration { return time.Duration(r.waitedNs.Load()) }

// Wrap returns next with its runs started at most at the rate. r.Wrap is a
// Middleware.
func (r *RateLimit) Wrap(next Handler) Handler {
	return &rateLimitHandler{r: r, next: next}
}

type rateLimitHandler struct {
	r    *RateLimit
	next Handler
}

func (h *rateLimitHandler) Handle(ctx context.Context, m *Message) error {
	if err := h.r.take(ctx); err != nil {
		return err
	}
	return h.next.Handle(ctx, m)
}

// Unwrap returns the handler the rate limit guards.
func (h *rateLimitHandler) Unwrap() Handler { return h.next }

// MetricsSource returns the RateLimit, for the Loop that runs h to
// register its metrics.
func (h *rateLimitHandler) MetricsSource() MetricsSource { return h.r }

// take takes a run's turn, waiting for it when it has not come. A wait
// cut short, or one that would outlast ctx's deadline, gives the turn back
// and returns a Defer.
func (r *RateLimit) take(ctx context.Context) error {
	now := time.Now()
	res := r.lim.ReserveN(now, 1) // burst >= 1: always ok
	d := res.DelayFrom(now)
	if d <= 0 {
		return nil
	}
	if dl, ok := ctx.Deadline(); ok && dl.Sub(now) < d {
		// As rate.Limiter.Wait does: the run could not start in time.
		res.CancelAt(now)
		return Defer(ErrRateLimited, d)
	}
	r.waited.Add(1)
	r.waiting.Add(1)
	defer r.waiting.Add(-1)
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		r.waitedNs.Add(int64(d))
		return nil
	case <-ctx.Done():
		res.Cancel()
		waited := time.Since(now)
		r.waitedNs.Add(int64(waited))
		return Defer(ErrRateLimited, d-waited)
	}
}

// Metric instrument names of a RateLimit, observed from its counters when
// a reader collects.
const (
	MetricRateLimitWaited    = "ferry.ratelimit.waited"     // counter: runs that waited for their turn
	MetricRateLimitWaiting   = "ferry.ratelimit.waiting"    // gauge: runs waiting for their turn now
	MetricRateLimitWaitedFor = "ferry.ratelimit.wait_time"  // counter: seconds runs spent waiting, summed over runs
	MetricRateLimitRate      = "ferry.ratelimit.per_second" // gauge: the rate it lets through
)

// RegisterMetrics reports r's counters through mp, labelled with name (the
// consumer's name), until the returned registration is unregistered. Runs
// waiting near the consumer's concurrency all the time mean the rate, not
// the handler, sets the pace: the backlog grows unless the rate is raised.
//
// A Loop running r registers these itself, on its own MeterProvider, when
// Run starts; call RegisterMetrics only to report them elsewhere.
func (r *RateLimit) RegisterMetrics(mp metric.MeterProvider, name string) (metric.Registration, error) {
	r.registered.Store(true)
	return r.registerMetrics(mp, name)
}

// MetricsRegistered reports whether RegisterMetrics was called: a Loop then
// does not register r's metrics again.
func (r *RateLimit) MetricsRegistered() bool { return r.registered.Load() }

func (r *RateLimit) registerMetrics(mp metric.MeterProvider, name string) (metric.Registration, error) {
	if mp == nil {
		return nil, ConfigErrorf("MeterProvider", "must not be nil")
	}
	m := mp.Meter("github.com/ferrymq/ferry/consumer")
	waited, err1 := m.Int64ObservableCounter(MetricRateLimitWaited, metric.WithUnit("{message}"),
		metric.WithDescription("Handler runs that waited for their turn under the rate limit."))
	waiting, err2 := m.Int64ObservableGauge(MetricRateLimitWaiting, metric.WithUnit("{message}"),
		metric.WithDescription("Handler runs waiting for their turn under the rate limit now."))
	waitedFor, err3 := m.Float64ObservableCounter(MetricRateLimitWaitedFor, metric.WithUnit("s"),
		metric.WithDescription("Time handler runs spent waiting for their turn under the rate limit, summed."))
	perSecond, err4 := m.Float64ObservableGauge(MetricRateLimitRate, metric.WithUnit("{message}/s"),
		metric.WithDescription("The rate limit: handler runs let start a second."))
	if err := errors.Join(err1, err2, err3, err4); err != nil {
		return nil, err
	}
	attrs := metric.WithAttributes(attribute.String("messaging.consumer.group.name", name))
	return m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		o.ObserveInt64(waited, r.Waited(), attrs)
		o.ObserveInt64(waiting, r.Waiting(), attrs)
		o.ObserveFloat64(waitedFor, r.WaitedFor().Seconds(), attrs)
		o.ObserveFloat64(perSecond, r.perSecond, attrs)
		return nil
	}, waited, waiting, waitedFor, perSecond)
}
