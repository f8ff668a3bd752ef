package consumer

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"

	"github.com/ferrymq/ferry/consumer/driver"
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

	ran      atomic.Bool
	inflight atomic.Int64 // deliveries taken and not yet settled or dropped
	paused   atomic.Int64 // unix nanos until which fetching pauses (a breaker is open)
	space    chan struct{}

	stats struct {
		fetched, acked, returned, failed, panics, held, deferred, retried, revoked atomic.Int64
		fetchErrors, settleErrors, running                                         atomic.Int64
	}
}

// Stats is a snapshot of a Loop's counters.
type Stats struct {
	Fetched      int64 // deliveries taken from the broker
	Acked        int64 // deliveries acknowledged
	Returned     int64 // deliveries returned to the broker for redelivery
	Failed       int64 // handler runs that returned an error (panics included)
	Panics       int64 // handler runs that panicked
	Held         int64 // handler runs held by a circuit breaker (not attempts)
	Deferred     int64 // handler runs that returned Defer (not attempts)
	Retried      int64 // in-place re-runs (brokers that cannot redeliver)
	Revoked      int64 // deliveries let go because the broker revoked their lane
	FetchErrors  int64 // failed fetches
	SettleErrors int64 // failed settle or extend calls
	InFlight     int64 // deliveries held now, unsettled
	Running      int64 // handlers running now
}

// New returns a delivery loop over drv. It fails with a *ConfigError naming
// the field when an option is invalid or drv is nil.
func New(drv driver.Driver, opts ...Option) (*Loop, error) {
	if drv == nil {
		return nil, configErr("Driver", "must not be nil")
	}
	cfg, err := buildConfig(opts)
	if err != nil {
		return nil, err
	}
	l := &Loop{drv: drv, cfg: cfg, caps: drv.Capabilities(), space: make(chan struct{}, 1)}
	if e, ok := drv.(driver.Extender); ok && e.Lease() > 0 {
		l.extender = e
	}
	if r, ok := drv.(driver.Revoker); ok {
		l.revoker = r
	}
	return l, nil
}

// Name is the consumer's name, as set by WithName.
func (l *Loop) Name() string { return l.cfg.name }

// Stats returns a snapshot of the loop's counters. It is safe to call at any
// time from any goroutine.
func (l *Loop) Stats() Stats {
	s := &l.stats
	return Stats{
		Fetched: s.fetched.Load(), Acked: s.acked.Load(), Returned: s.returned.Load(),
		Failed: s.failed.Load(), Panics: s.panics.Load(), Held: s.held.Load(), Deferred: s.deferred.Load(),
		Retried: s.retried.Load(), Revoked: s.revoked.Load(),
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

// Name returns the name (WithName) of the Loop whose handler got ctx, or
// "ferry" when ctx did not come from a Loop. Middleware uses it to namespace
// keys and label dead letters.
func Name(ctx context.Context) string {
	if n, ok := ctx.Value(nameKey{}).(string); ok {
		return n
	}
	return "ferry"
}

// Run delivers messages to h until ctx ends, then drains: it stops
// fetching, returns every message not yet started to the broker, and lets
// running handlers finish for the shutdown grace period, acking those that
// succeed. Handlers still running after the grace have their contexts
// cancelled; whatever they return then, their messages are returned for
// redelivery (a handler that saw its context end may not have finished its
// work). Run closes the driver before it returns.
//
// Run returns nil after a clean shutdown, and an error only when the
// driver reports a fatal one. A Loop runs once: a second call returns
// ErrAlreadyRun.
func (l *Loop) Run(ctx context.Context, h Handler) error {
	if h == nil {
		return configErr("Handler", "must not be nil")
	}
	if !l.ran.CompareAndSwap(false, true) {
		return ErrAlreadyRun
	}
	defer l.drv.Close()
	if reg, err := l.registerMetrics(); err != nil {
		l.cfg.logger.Warn("ferry: metrics unavailable", "consumer", l.cfg.name, "err", err)
	} else {
		defer reg.Unregister()
	}

	r := newRun(l, h, ctx)
	defer r.cancelHandler()

	fetchCtx, stopFetch := context.WithCancel(ctx)
	defer stopFetch()
	fetcherDone := make(chan struct{})
	go func() { defer close(fetcherDone); r.fetchLoop(fetchCtx) }()
	var workers sync.WaitGroup
	for i := 0; i < l.cfg.concurrency; i++ {
		workers.Add(1)
		go func() { defer workers.Done(); r.worker() }()
	}
	ioDone := make(chan struct{})
	go func() { defer close(ioDone); r.ioLoop() }()

	err := r.dispatch(ctx, stopFetch, fetcherDone)

	// Hand the last settlements over and wait for them, so that what
	// finished is acked before Run returns.
	r.flushIO()
	close(r.ioCh)
	<-ioDone
	r.closeRevocations()
	close(r.abandon) // a fetcher or worker still trying to hand something over gives up
	<-fetcherDone
	close(r.work)
	if r.running == 0 {
		workers.Wait() // otherwise some handler ignored cancellation: do not wait for it
	}
	r.timer.Stop()
	return err
}
