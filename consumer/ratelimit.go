package consumer

import (
	"container/list"
	"context"
	"errors"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"golang.org/x/time/rate"
)

// RateLimit caps how many handler runs start a second (over
// golang.org/x/time/rate's token bucket), for a dependency that takes only
// so many calls: a partner API's quota, a database that a backlog's drain
// would swamp. It is one consumer's limit, or one per message key
// (RateLimitPerKey), or, shared between consumers (one RateLimit wrapping
// several handlers), one for all of them.
//
// A run whose turn has not come is not an attempt and never fails the
// message. With one rate for every message, it waits for its turn before
// the handler is called: the loop keeps the message's lease while it waits
// (as for any running handler), and once every worker waits no more is
// fetched (the loop's in-flight bound), so a backlog stays at the broker
// rather than in the process. With a rate per key, a run whose turn is more
// than a few milliseconds away is deferred to it instead (Defer, with its
// turn kept), so that a busy key's messages do not take the workers from
// the others'. A consumer that stops, or whose lane is taken away, while a
// run waits gets the message back unattempted (a Defer).
//
// Put it inside Retry and the Breaker, so that each re-run takes a turn of
// its own and an open breaker takes none, and outside Timeout, so that the
// wait is not counted against a run's deadline: StandardRateLimit places it
// so.
//
// Waited, Deferred, Waiting and WaitedFor make it observable; a Loop
// reports them as ferry.ratelimit.* metrics. Build one with NewRateLimit;
// its Wrap method is a Middleware.
type RateLimit struct {
	perSecond float64
	burst     int
	one       *rate.Limiter // every run's, without RateLimitPerKey
	keys      *keyLimiters  // one a key, with RateLimitPerKey
	errWait   error

	registered atomic.Bool  // its metrics were registered by hand
	waited     atomic.Int64 // runs that waited for their turn
	deferred   atomic.Int64 // runs deferred to their turn (RateLimitPerKey)
	waiting    atomic.Int64 // runs waiting now
	waitedNs   atomic.Int64 // nanoseconds spent waiting
}

// ErrRateLimited matches, through errors.Is, the error inside the Defer
// with which a RateLimit hands back a message whose turn has not come: one
// whose wait was cut short (the consumer stopping, or its lane taken away),
// or, with RateLimitPerKey, one whose turn is further away than a wait.
var ErrRateLimited = errors.New("rate limited")

// RateLimitOption configures NewRateLimit.
type RateLimitOption func(*rateLimitConfig) error

type rateLimitConfig struct {
	burst   int
	perKey  bool
	maxKeys int
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

// RateLimitPerKey gives each message key (Message.Key) a rate of its own,
// so that one busy tenant's messages do not take the others' turns; the
// messages without a key share one. At most maxKeys keys are kept: the key
// unused the longest is forgotten first, and comes back with a full bucket.
// Default: one rate for every message.
func RateLimitPerKey(maxKeys int) RateLimitOption {
	return func(c *rateLimitConfig) error {
		if maxKeys < 1 {
			return ConfigErrorf("RateLimit.PerKey", "must keep at least 1 key, got %d", maxKeys)
		}
		c.perKey, c.maxKeys = true, maxKeys
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
	r := &RateLimit{perSecond: perSecond, burst: c.burst, errWait: ErrRateLimited}
	if c.perKey {
		r.keys = &keyLimiters{max: c.maxKeys, byKey: make(map[string]*list.Element), newLimiter: r.newLimiter}
	} else {
		r.one = r.newLimiter()
	}
	return r, nil
}

func (r *RateLimit) newLimiter() *rate.Limiter {
	return rate.NewLimiter(rate.Limit(r.perSecond), r.burst)
}

// Waited returns how many runs waited for their turn.
func (r *RateLimit) Waited() int64 { return r.waited.Load() }

// Deferred returns how many runs were deferred to their turn
// (RateLimitPerKey).
func (r *RateLimit) Deferred() int64 { return r.deferred.Load() }

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
	ctx, rec := withRecord(ctx)
	if err := h.r.take(ctx, m, rec); err != nil {
		return err
	}
	return h.next.Handle(ctx, m)
}

// Unwrap returns the handler the rate limit guards.
func (h *rateLimitHandler) Unwrap() Handler { return h.next }

// MetricsSource returns the RateLimit, for the Loop that runs h to
// register its metrics.
func (h *rateLimitHandler) MetricsSource() MetricsSource { return h.r }

// waitAtMost is the longest a run with a rate per key waits in its worker;
// a turn further away is deferred to. Shorter than a timer's slack, a
// deferral would cost more than the wait.
const waitAtMost = 5 * time.Millisecond

// take takes m's turn: at once, after a wait, or as a Defer to it, kept in
// rec for the run that comes back. A wait cut short gives the turn back
// and returns a Defer.
func (r *RateLimit) take(ctx context.Context, m *Message, rec *record) error {
	now := time.Now()
	var (
		d   time.Duration
		res *rate.Reservation
	)
	if turn := rec.rateTurn; !turn.IsZero() {
		// Deferred to a turn reserved before: it is this run's.
		rec.rateTurn = time.Time{}
		d = turn.Sub(now)
	} else {
		lim := r.one
		if lim == nil {
			lim = r.keys.get(m.Key)
		}
		res = lim.ReserveN(now, 1) // burst >= 1: always ok
		d = res.DelayFrom(now)
		if d > waitAtMost && r.keys != nil {
			rec.rateTurn = now.Add(d)
			r.deferred.Add(1)
			return Defer(r.errWait, d)
		}
	}
	if d <= 0 {
		return nil
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
		if res != nil {
			res.Cancel()
		}
		waited := time.Since(now)
		r.waitedNs.Add(int64(waited))
		return Defer(r.errWait, d-waited)
	}
}

// keyLimiters is RateLimitPerKey's limiters, the least recently used
// forgotten first beyond max.
type keyLimiters struct {
	mu         sync.Mutex
	max        int
	byKey      map[string]*list.Element // of *keyLimiter
	lru        list.List                // front: used last
	newLimiter func() *rate.Limiter
}

type keyLimiter struct {
	key string
	lim *rate.Limiter
}

func (k *keyLimiters) get(key string) *rate.Limiter {
	k.mu.Lock()
	defer k.mu.Unlock()
	if e, ok := k.byKey[key]; ok {
		k.lru.MoveToFront(e)
		return e.Value.(*keyLimiter).lim
	}
	if k.lru.Len() >= k.max {
		old := k.lru.Back()
		k.lru.Remove(old)
		delete(k.byKey, old.Value.(*keyLimiter).key)
	}
	kl := &keyLimiter{key: key, lim: k.newLimiter()}
	k.byKey[key] = k.lru.PushFront(kl)
	return kl.lim
}

// Metric instrument names of a RateLimit, observed from its counters when
// a reader collects.
const (
	MetricRateLimitWaited    = "ferry.ratelimit.waited"     // counter: runs that waited for their turn
	MetricRateLimitDeferred  = "ferry.ratelimit.deferred"   // counter: runs deferred to their turn (per key)
	MetricRateLimitWaiting   = "ferry.ratelimit.waiting"    // gauge: runs waiting for their turn now
	MetricRateLimitWaitedFor = "ferry.ratelimit.wait_time"  // counter: seconds runs spent waiting
	MetricRateLimitRate      = "ferry.ratelimit.per_second" // gauge: the rate it lets through
)

// RegisterMetrics reports r's counters through mp, labelled with name (the
// consumer's name), until the returned registration is unregistered. A
// wait time that grows as fast as the clock means the rate, not the
// handler, sets the pace: the backlog grows unless the rate is raised.
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
	deferred, err5 := m.Int64ObservableCounter(MetricRateLimitDeferred, metric.WithUnit("{message}"),
		metric.WithDescription("Handler runs deferred to their turn under a rate per key."))
	perSecond, err4 := m.Float64ObservableGauge(MetricRateLimitRate, metric.WithUnit("{message}/s"),
		metric.WithDescription("The rate limit: handler runs let start a second (per key with RateLimitPerKey)."))
	if err := errors.Join(err1, err2, err3, err4, err5); err != nil {
		return nil, err
	}
	attrs := metric.WithAttributes(attribute.String("messaging.consumer.group.name", name))
	return m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		o.ObserveInt64(waited, r.Waited(), attrs)
		o.ObserveInt64(deferred, r.Deferred(), attrs)
		o.ObserveInt64(waiting, r.Waiting(), attrs)
		o.ObserveFloat64(waitedFor, r.WaitedFor().Seconds(), attrs)
		o.ObserveFloat64(perSecond, r.perSecond, attrs)
		return nil
	}, waited, deferred, waiting, waitedFor, perSecond)
}
