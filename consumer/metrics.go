package consumer

import (
	"context"
	"errors"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// Metric instrument names. Counters and gauges are observed from the loop's
// own counters when a reader collects, so a consumer costs nothing per
// message for its metrics, and nothing at all when no MeterProvider is
// installed.
const (
	MetricConsumed  = "messaging.client.consumed.messages" // counter: deliveries taken from the broker (OTel messaging semconv)
	MetricAcked     = "ferry.consumer.acked"               // counter: deliveries acknowledged
	MetricReturned  = "ferry.consumer.returned"            // counter: deliveries returned for redelivery
	MetricFailed    = "ferry.consumer.failed"              // counter: handler runs that failed (panics included)
	MetricHeld      = "ferry.consumer.held"                // counter: handler runs held by an open circuit breaker
	MetricDropped   = "ferry.consumer.dropped"             // counter: at most once, messages acked before they ran whose run failed or was held
	MetricInFlight  = "ferry.consumer.in_flight"           // gauge: deliveries held unsettled
	MetricRunning   = "ferry.consumer.running"             // gauge: handlers running
	MetricLag       = "ferry.consumer.lag"                 // gauge: messages not yet done, as Health.Lag and ferry lag count them
	MetricOldestAge = "ferry.consumer.oldest_age"          // gauge, seconds: age of the oldest waiting message
	MetricHealth    = "ferry.consumer.health"              // gauge: the Health state, 0 steady, 1 downstream slow, 2 retry storm, 3 backlog past retention, 4 protected, 5 dead-letter failing, 6 starting, 7 disconnected, 8 wedged, 9 stopped
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

// WithMeterProvider sets where the loop reports its metrics. Default the
// global provider (otel.GetMeterProvider), a no-op until one is installed.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(c *config) error {
		if mp == nil {
			return configErr("MeterProvider", "must not be nil")
		}
		c.meterProvider = mp
		return nil
	}
}

// registerMetrics registers the loop's observable instruments for the
// length of one Run.
func (l *Loop) registerMetrics() (metric.Registration, error) {
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
	inFlight := gauge(MetricInFlight, "Messages held by the consumer and not yet settled.", "{message}")
	running := gauge(MetricRunning, "Handlers running now.", "{handler}")
	lag := gauge(MetricLag, "Messages not yet done: waiting at the broker, or taken and not yet settled (a log: past the committed offset).", "{message}")
	oldest, err := m.Float64ObservableGauge(MetricOldestAge, metric.WithDescription("Age of the oldest waiting message."), metric.WithUnit("s"))
	errs = append(errs, err)
	health := gauge(MetricHealth, "The consumer's health state: 0 steady, 1 downstream slow, 2 retry storm, 3 backlog past retention, 4 protected, 5 dead-letter failing, 6 starting, 7 disconnected, 8 wedged, 9 stopped.", "{state}")
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	attrs := metric.WithAttributes(attribute.String("messaging.consumer.group.name", l.cfg.name))
	return m.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		s := l.Stats()
		o.ObserveInt64(consumed, s.Fetched, attrs)
		o.ObserveInt64(acked, s.Acked, attrs)
		o.ObserveInt64(returned, s.Returned, attrs)
		o.ObserveInt64(failed, s.Failed, attrs)
		o.ObserveInt64(held, s.Held, attrs)
		o.ObserveInt64(dropped, s.Dropped, attrs)
		o.ObserveInt64(inFlight, s.InFlight, attrs)
		o.ObserveInt64(running, s.Running, attrs)
		o.ObserveInt64(health, healthLevel(l.Health().State), attrs)
		// The health sampler asks the broker for the lag every interval
		// while Run runs; a collection between samples reuses the last
		// one rather than asking again.
		if n, age, ok := l.lastLag(); ok {
			o.ObserveInt64(lag, n, attrs)
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
	}, consumed, acked, returned, failed, held, dropped, inFlight, running, lag, oldest, health)
}
