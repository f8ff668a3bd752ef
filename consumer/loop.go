package consumer

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/ratelog"
)

// ErrAlreadyRun is returned by a second call to Loop.Run: a Loop runs once
// and closes its driver when Run returns.
var ErrAlreadyRun = errors.New("ferry: consumer already run")

// ErrLagUnsupported is returned by Loop.Lag when the driver cannot report lag.
var ErrLagUnsupported = errors.New("ferry: driver does not report lag")

// Lag is how far a consumer is behind its broker.
type Lag = driver.Lag

// Loop is the delivery loop over one driver: the Consumer every broker
// adapter returns. Build one with New; run it once with Run.
type Loop struct {
	drv      driver.Driver
	cfg      config
	caps     driver.Capabilities
	extender driver.Extender // nil when the broker keeps no lease
	revoker  driver.Revoker  // nil when the broker never revokes
	tracer   trace.Tracer    // nil without WithTracerProvider
	health   healthWindow

	ran         atomic.Bool
	inflight    atomic.Int64 // deliveries taken and not yet settled or dropped
	deferredNow atomic.Int64 // of those, deferred ones, which take no room (see deferRun)
	paused      atomic.Int64 // unix nanos until which fetching pauses (a breaker is open)
	space       chan struct{}

	stats struct {
		fetched, acked, returned, failed, panics, held, deferred, retried, revoked atomic.Int64
		fetchErrors, settleErrors, running, dropped                                atomic.Int64
	}
	// logs bounds the lines of events that can repeat at the message rate.
	logs *ratelog.Limiter
	conn connState
	// instruments are the histograms, set when Run registers the metrics.
	instruments *loopInstruments
}

// Stats is a snapshot of a Loop's counters.
type Stats struct {
	Fetched      int64 // deliveries taken from the broker
	Acked        int64 // acks made (a failed ack is not counted)
	Returned     int64 // returns to the broker for redelivery, made
	Failed       int64 // handler runs that returned an error (panics included)
	Panics       int64 // handler runs that panicked
	Held         int64 // handler runs held by a circuit breaker (not attempts)
	Deferred     int64 // handler runs that returned Defer (not attempts)
	Retried      int64 // in-place re-runs (brokers that cannot redeliver)
	Revoked      int64 // deliveries let go because the broker revoked their lane
	Dropped      int64 // at most once: messages acked before they ran whose run failed or was held (lost, by the mode's definition)
	FetchErrors  int64 // failed fetches
	SettleErrors int64 // failed settle or extend calls
	InFlight     int64 // deliveries held now, unsettled
	Running      int64 // handlers running now
}

// New returns a delivery loop over drv. It fails with a *ConfigError naming
// the field when an option is invalid, drv is nil, or drv's lease is shorter
// than driver.MinLease.
func New(drv driver.Driver, opts ...Option) (*Loop, error) {
	if drv == nil {
		return nil, ConfigErrorf("Driver", "must not be nil")
	}
	cfg, err := buildConfig(opts)
	if err != nil {
		return nil, err
	}
	return newLoop(drv, cfg)
}

func newLoop(drv driver.Driver, cfg config) (*Loop, error) {
	l := &Loop{drv: drv, cfg: cfg, caps: drv.Capabilities(), space: make(chan struct{}, 1), logs: ratelog.New(5, time.Minute)}
	if e, ok := drv.(driver.Extender); ok && e.Lease() > 0 {
		if e.Lease() < driver.MinLease {
			return nil, ConfigErrorf("Lease", "%s is too short to keep extended; at least %s (a visibility timeout, on SQS)", e.Lease(), driver.MinLease)
		}
		l.extender = e
	}
	if r, ok := drv.(driver.Revoker); ok {
		l.revoker = r
	}
	if cfg.tracerProvider != nil {
		l.tracer = cfg.tracerProvider.Tracer(tracerName)
	}
	l.health.size, l.health.interval = cfg.healthSamples, cfg.healthInterval
	return l, nil
}

// signalSpace wakes a fetcher waiting for room in flight.
func (l *Loop) signalSpace() {
	select {
	case l.space <- struct{}{}:
	default:
	}
}

// Name is the consumer's name, as set by WithName.
func (l *Loop) Name() string { return l.cfg.name }

// Ordering is what the loop keeps in order, as set by WithOrdering.
func (l *Loop) Ordering() Ordering { return l.cfg.ordering }

// DeliveryMode is when the loop acknowledges a message, as set by
// WithDeliveryMode.
func (l *Loop) DeliveryMode() DeliveryMode { return l.cfg.mode }

// WedgedAfter is how long the loop may make no progress, with messages
// waiting, before Health calls it wedged, as set by WithWedgedAfter.
func (l *Loop) WedgedAfter() time.Duration { return l.cfg.wedgedAfter }

// MaxInFlight is the most messages the loop holds unsettled at once, as set
// by WithMaxInFlight (default four times the concurrency). A driver whose
// broker pushes deliveries (an AMQP prefetch) is sized from it before Run.
func (l *Loop) MaxInFlight() int { return l.cfg.maxInFlight }

// Stats returns a snapshot of the loop's counters. It is safe to call at any
// time from any goroutine.
func (l *Loop) Stats() Stats {
	s := &l.stats
	return Stats{
		Fetched: s.fetched.Load(), Acked: s.acked.Load(), Returned: s.returned.Load(),
		Failed: s.failed.Load(), Panics: s.panics.Load(), Held: s.held.Load(), Deferred: s.deferred.Load(),
		Retried: s.retried.Load(), Revoked: s.revoked.Load(), Dropped: s.dropped.Load(),
		FetchErrors: s.fetchErrors.Load(), SettleErrors: s.settleErrors.Load(),
		InFlight: l.inflight.Load(), Running: s.running.Load(),
	}
}

// Lag asks the broker how far this consumer is behind. It returns
// ErrLagUnsupported when the driver cannot tell.
func (l *Loop) Lag(ctx context.Context) (Lag, error) {
	r, ok := l.drv.(driver.LagReporter)
	if !ok {
		return Lag{}, ErrLagUnsupported
	}
	return r.Lag(ctx)
}

type nameKey struct{}

// loopInfo is what a Loop tells the middleware of its handler through the
// handler's context.
type loopInfo struct {
	name string
	log  *slog.Logger // the Loop's logger, with the consumer's name
}

// Name returns the name (WithName) of the Loop whose handler got ctx, or
// "ferry" when ctx did not come from a Loop. Middleware uses it to namespace
// keys and label dead letters.
func Name(ctx context.Context) string {
	if n, ok := ctx.Value(nameKey{}).(*loopInfo); ok {
		return n.name
	}
	return "ferry"
}

// Logger returns the logger of the Loop whose handler got ctx (WithLogger,
// with the consumer's name as an attribute), or slog.Default() when ctx
// did not come from a Loop. The middleware log through it unless given a
// logger of their own, so that one WithLogger sends every line of a
// consumer to the same place.
func Logger(ctx context.Context) *slog.Logger {
	if n, ok := ctx.Value(nameKey{}).(*loopInfo); ok {
		return n.log
	}
	return slog.Default()
}

// Run delivers messages to h until ctx ends, then drains: it stops
// fetching, runs what it had already fetched, and lets running handlers
// finish, all within the shutdown grace period, acking what succeeds; what
// waits to run again later (a retry, a hold, a deferral) goes back to the
// broker at once with its delay. When the grace ends, handlers still running
// have their contexts cancelled and whatever they return then, their
// messages go back for redelivery (a handler that saw its context end may
// not have finished its work), as do the messages not yet started. Run
// closes the driver before it returns, at most a second after the grace
// (sooner when everything is settled).
//
// Run refuses a nil handler, and a chain with a nil handler inside it
// (found through the Unwrap methods of its middleware), with a
// *ConfigError. It returns nil after a clean shutdown, and an error only
// when the driver reports a fatal one. A Loop runs once: a second call
// returns ErrAlreadyRun.
func (l *Loop) Run(ctx context.Context, h Handler) (err error) {
	parts, err := inspectChain(h)
	if err != nil {
		return err
	}
	if !l.ran.CompareAndSwap(false, true) {
		return ErrAlreadyRun
	}
	breakers := parts.breakers
	l.health.mu.Lock()
	l.health.parts = parts
	l.health.mu.Unlock()
	defer l.drv.Close()
	if _, merr := l.registerMetrics(parts); merr != nil {
		l.cfg.logger.Warn("ferry: metrics unavailable", "consumer", l.cfg.name, "err", merr)
	}
	if l.cfg.mode != AtMostOnce {
		breakers = nil // only an ack before the run needs to ask them first
	}
	dp := newDispatcher(ctx, l, h, breakers)
	defer dp.cancelHandler()
	l.connStarting()
	slowStart := time.AfterFunc(l.cfg.reportAfter, func() { l.connSlowStart(dp.log) })
	defer slowStart.Stop()
	defer func() { l.connStopped(err) }()

	sampleCtx, stopSampling := context.WithCancel(context.WithoutCancel(ctx))
	sampled := make(chan struct{})
	go func() { defer close(sampled); l.sampleHealth(sampleCtx) }()
	defer func() { stopSampling(); <-sampled }()

	fetchCtx, stopFetch := context.WithCancel(ctx)
	defer stopFetch()
	fetcherDone := make(chan struct{})
	go func() { defer close(fetcherDone); dp.fetchLoop(fetchCtx) }()
	var workers, io sync.WaitGroup
	for i := range dp.boxes {
		workers.Add(1)
		go func() { defer workers.Done(); dp.worker(&dp.boxes[i]) }()
	}
	for range dp.io.settlers {
		io.Add(1)
		go func() { defer io.Done(); dp.io.settleLoop(dp.abandon) }()
	}
	if l.extender != nil {
		io.Add(1)
		go func() { defer io.Done(); dp.io.extendLoop(dp.abandon) }()
	}

	err = dp.dispatch(ctx, stopFetch, fetcherDone)

	// Drained, or given up on: let every goroutine go. Calls still with the
	// driver are cancelled; their results are not waited for.
	dp.io.cancel()
	close(dp.io.settleC)
	close(dp.io.extendC)
	dp.closeRevocations()
	close(dp.abandon)
	<-fetcherDone
	close(dp.work)
	if dp.running == 0 {
		workers.Wait() // otherwise some handler ignored cancellation: do not wait for it
	}
	waitTimeout(&io, abandonAfter)
	dp.timer.Stop()
	return err
}

// waitTimeout waits for wg, or d, whichever comes first.
func waitTimeout(wg *sync.WaitGroup, d time.Duration) {
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	}
}
