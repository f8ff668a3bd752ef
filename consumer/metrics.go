package consumer

import (
	"context"
	"errors"
	"time"

	"github.com/ferrymq/ferry/internal/msgmetrics"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// Metric instrument names. Counters and gauges are observed from the loop's
// own counters when a reader collects, so a consumer costs nothing per
// message for its metrics, and nothing at all when no MeterProvider is
// installed.
const (
	MetricConsumed    = "messaging.client.consumed.messages" // counter: deliveries taken from the broker (OTel messaging semconv)
	MetricAcked       = "ferry.consumer.acked"               // counter: deliveries acknowledged
	MetricReturned    = "ferry.consumer.returned"            // counter: deliveries returned for redelivery
	MetricFailed      = "ferry.consumer.failed"              // counter: handler runs that failed (panics included)
	MetricHeld        = "ferry.consumer.held"                // counter: handler runs held by an open circuit breaker
	MetricDropped     = "ferry.consumer.dropped"             // counter: at most once, messages acked before they ran whose run failed or was held
	MetricFetchErrors = "ferry.consumer.fetch_errors"        // counter: failed attempts to reach the broker or the source
	MetricInFlight    = "ferry.consumer.in_flight"           // gauge: deliveries held unsettled
	MetricRunning     = "ferry.consumer.running"             // gauge: handlers running
	MetricLag         = "ferry.consumer.lag"                 // gauge: messages not yet done (waiting, and taken but unsettled): the lag of Health and of ferry lag
	MetricOldestAge   = "ferry.consumer.oldest_age"          // gauge, seconds: age of the oldest waiting message
	MetricHealth      = "ferry.consumer.health"              // gauge: the Health state, 0 steady, 1 downstream slow, 2 retry storm, 3 backlog past retention, 4 protected, 5 dead-letter failing, 6 starting, 7 disconnected, 8 wedged, 9 stopped
)

// healthLevel is the value of MetricHealth for a state.
func healthLevel(s HealthState) int64 {
	switch s {
	case HealthDownstreamSlow:
		return 1
	case HealthRetryStorm:
		return 2
	case HealthBacklogPastRetention:
		return 3
	case HealthProtected:
		return 4
	case HealthDeadLetterFailing:
		return 5
	case HealthStarting:
		return 6
	case HealthDisconnected:
		return 7
	case HealthWedged:
		return 8
	case HealthStopped:
		return 9
	}
	return 0
}

// registerMetrics registers the loop's observable instruments, the
// histograms it records into, and the counters of the middleware in its
// chain that nobody registered by hand, all on the loop's MeterProvider.
// They stay registered after Run returns, so that the health gauge reports
// the consumer stopped rather than vanish.
func (l *Loop) registerMetrics(parts chainParts) (metric.Registration, error) {
	mp := l.cfg.meterProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	m := mp.Meter("github.com/ferrymq/ferry/consumer")
	var errs []error
	counter := func(name, desc string) metric.Int64ObservableCounter {
		c, err := m.Int64ObservableCounter(name, metric.WithDescription(desc), metric.WithUnit("{message}"))
		errs = append(errs, err)
		return c
	}
	gauge := func(name, desc, unit string) metric.Int64ObservableGauge {
		g, err := m.Int64ObservableGauge(name, metric.WithDescription(desc), metric.WithUnit(unit))
		errs = append(errs, err)
		return g
	}
	consumed := counter(MetricConsumed, "Messages taken from the broker.")
	acked := counter(MetricAcked, "Messages acknowledged after their handler succeeded.")
	returned := counter(MetricReturned, "Messages returned to the broker for redelivery.")
	failed := counter(MetricFailed, "Handler runs that returned an error or panicked.")
	held := counter(MetricHeld, "Handler runs held because a circuit breaker was open.")
	dropped := counter(MetricDropped, "At most once: messages acked before they ran whose run failed or was held, and so lost.")
	fetchErrors := counter(MetricFetchErrors, "Failed attempts to reach the broker or the source (connect and fetch).")
	inFlight := gauge(MetricInFlight, "Messages held by the consumer and not yet settled.", "{message}")
	running := gauge(MetricRunning, "Handlers running now.", "{handler}")
	lag := gauge(MetricLag, "Messages not yet done: waiting at the broker, or taken and not yet settled (a log: past the committed offset).", "{message}")
	oldest, err := m.Float64ObservableGauge(MetricOldestAge, metric.WithDescription("Age of the oldest waiting message."), metric.WithUnit("s"))
	errs = append(errs, err)
	health := gauge(MetricHealth, "The consumer's health state: 0 steady, 1 downstream slow, 2 retry storm, 3 backlog past retention, 4 protected, 5 dead-letter failing, 6 starting, 7 disconnected, 8 wedged, 9 stopped.", "{state}")
	process, err := msgmetrics.Duration(m, msgmetrics.ProcessDuration, "Duration of one run of the handler chain for a message.")
	errs = append(errs, err)
	operation, err := msgmetrics.Duration(m, msgmetrics.OperationDuration, "Duration of messaging operations: publish, receive and settle calls.")
	errs = append(errs, err)
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	base := []attribute.KeyValue{
		msgmetrics.KeySystem.String(l.caps.System),
		msgmetrics.KeyDestination.String(l.caps.Source),
		msgmetrics.KeyGroup.String(l.cfg.name),
	}
	l.instruments = newLoopInstruments(process, operation, base)
	attrs := metric.WithAttributes(base...)
	consumedAttrs := metric.WithAttributes(append(base, msgmetrics.KeyOperationName.String("receive"))...)
	reg, err := m.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		s := l.Stats()
		o.ObserveInt64(consumed, s.Fetched, consumedAttrs)
		o.ObserveInt64(acked, s.Acked, attrs)
		o.ObserveInt64(returned, s.Returned, attrs)
		o.ObserveInt64(failed, s.Failed, attrs)
		o.ObserveInt64(held, s.Held, attrs)
		o.ObserveInt64(dropped, s.Dropped, attrs)
		o.ObserveInt64(fetchErrors, s.FetchErrors, attrs)
		o.ObserveInt64(inFlight, s.InFlight, attrs)
		o.ObserveInt64(running, s.Running, attrs)
		o.ObserveInt64(health, healthLevel(l.Health().State), attrs)
		if phase, _, _, _ := l.conn.get(); phase == phaseStopped {
			return nil // no broker to ask
		}
		// The health sampler asks the broker for the lag every interval
		// while Run runs; a collection between samples reuses the last
		// one rather than asking again.
		if notDone, age, ok := l.lastLag(); ok {
			o.ObserveInt64(lag, notDone, attrs)
			o.ObserveFloat64(oldest, age.Seconds(), attrs)
			return nil
		}
		lctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		if lg, err := l.Lag(lctx); err == nil {
			o.ObserveInt64(lag, lagOf(lg), attrs)
			o.ObserveFloat64(oldest, lg.OldestAge.Seconds(), attrs)
		}
		return nil
	}, consumed, acked, returned, failed, held, dropped, fetchErrors, inFlight, running, lag, oldest, health)
	if err != nil {
		return nil, err
	}
	chain := parts.unregistered()
	if len(chain.deadLetters)+len(chain.retries)+len(chain.breakers) > 0 {
		if _, err := chain.registerMetrics(mp, metric.WithAttributes(msgmetrics.KeyGroup.String(l.cfg.name))); err != nil {
			return reg, err
		}
	}
	for _, src := range chain.metrics {
		if _, err := src.RegisterMetrics(mp, l.cfg.name); err != nil {
			return reg, err
		}
	}
	return reg, nil
}

// loopInstruments are the histograms the loop records into, with their
// attribute sets made once.
type loopInstruments struct {
	process, operation                     metric.Float64Histogram
	processOK                              recordOpts
	processErr                             map[string]recordOpts // by error.type
	receive, receiveErr, settle, settleErr recordOpts
}

// recordOpts are the options of a Record call, made once: passed as
// opts..., they cost no allocation a call, as one option would (its
// variadic slice escapes).
type recordOpts []metric.RecordOption

func newLoopInstruments(process, operation metric.Float64Histogram, base []attribute.KeyValue) *loopInstruments {
	with := func(kv ...attribute.KeyValue) recordOpts {
		return recordOpts{metric.WithAttributeSet(attribute.NewSet(append(append([]attribute.KeyValue(nil), base...), kv...)...))}
	}
	li := &loopInstruments{
		process: process, operation: operation,
		processOK:  with(msgmetrics.KeyOperationName.String("process"), msgmetrics.KeyOperationType.String("process")),
		processErr: map[string]recordOpts{},
		receive:    with(msgmetrics.KeyOperationName.String("receive"), msgmetrics.KeyOperationType.String("receive")),
		receiveErr: with(msgmetrics.KeyOperationName.String("receive"), msgmetrics.KeyOperationType.String("receive"),
			msgmetrics.KeyErrorType.String("error")),
		settle: with(msgmetrics.KeyOperationName.String("settle"), msgmetrics.KeyOperationType.String("settle")),
		settleErr: with(msgmetrics.KeyOperationName.String("settle"), msgmetrics.KeyOperationType.String("settle"),
			msgmetrics.KeyErrorType.String("error")),
	}
	for _, kind := range []string{"permanent", "panic", "timeout", "error", "held", "deferred"} {
		li.processErr[kind] = with(msgmetrics.KeyOperationName.String("process"), msgmetrics.KeyOperationType.String("process"),
			msgmetrics.KeyErrorType.String(kind))
	}
	return li
}

// recordProcess records one run of the handler chain that took d and
// returned err.
func (li *loopInstruments) recordProcess(d time.Duration, err error) {
	opt := li.processOK
	if err != nil {
		switch {
		case IsHeld(err):
			opt = li.processErr["held"]
		case IsDeferred(err):
			opt = li.processErr["deferred"]
		default:
			opt = li.processErr[errorKind(err)]
		}
	}
	li.process.Record(context.Background(), d.Seconds(), opt...)
}

// recordOp records a receive or settle call.
func (li *loopInstruments) recordOp(ok, failed recordOpts, d time.Duration, err error) {
	opt := ok
	if err != nil && !errors.Is(err, context.Canceled) {
		opt = failed
	}
	li.operation.Record(context.Background(), d.Seconds(), opt...)
}
