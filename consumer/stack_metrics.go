package consumer

import (
	"context"
	"errors"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/embedded"
)

// Metric instrument names of the middleware stack, observed from its
// counters when a reader collects.
const (
	MetricDeadLettered  = "ferry.deadletter.messages"         // counter: messages moved to the dead-letter destination
	MetricDLQFailures   = "ferry.deadletter.publish_failures" // counter: dead-letter publishes that failed
	MetricRetries       = "ferry.retry.retries"               // counter: in-process re-runs
	MetricGivenBack     = "ferry.retry.given_back"            // counter: deliveries returned with a redelivery delay
	MetricBreakerState  = "ferry.breaker.state"               // gauge: 0 closed, 1 half-open, 2 open
	MetricBreakerOpened = "ferry.breaker.opened"              // counter: times the breaker opened
	MetricBreakerHeld   = "ferry.breaker.held"                // counter: messages held while it was open
)

// RegisterMetrics reports the stack's counters and the breaker's state
// through mp, labelled with name (the consumer's name), until the returned
// registration is unregistered. A dead-letter count that grows and a breaker
// that stays open are what an alert should watch.
//
// A Loop running the stack registers these itself, on its own
// MeterProvider (WithMeterProvider), when Run starts; call RegisterMetrics
// only to report them elsewhere. Parts registered here are not registered
// again by a Loop.
func (s *Stack) RegisterMetrics(mp metric.MeterProvider, name string) (metric.Registration, error) {
	if mp == nil {
		return nil, ConfigErrorf("MeterProvider", "must not be nil")
	}
	p := chainParts{}
	if s.DeadLetter != nil {
		p.deadLetters = []*DeadLetter{s.DeadLetter}
	}
	if s.Retry != nil {
		p.retries = []*Retry{s.Retry}
	}
	if s.Breaker != nil {
		p.breakers = []*Breaker{s.Breaker}
	}
	p.markRegistered()
	reg, err := p.registerMetrics(mp, metric.WithAttributes(attribute.String("messaging.consumer.group.name", name)))
	if err != nil || s.RateLimit == nil {
		return reg, err
	}
	rreg, err := s.RateLimit.RegisterMetrics(mp, name)
	if err != nil {
		_ = reg.Unregister()
		return nil, err
	}
	return bothRegistrations{a: reg, b: rreg}, nil
}

// bothRegistrations unregisters two registrations as one.
type bothRegistrations struct {
	embedded.Registration
	a, b metric.Registration
}

func (r bothRegistrations) Unregister() error {
	return errors.Join(r.a.Unregister(), r.b.Unregister())
}

// markRegistered notes that the parts' metrics were registered by hand.
func (p chainParts) markRegistered() {
	for _, d := range p.deadLetters {
		d.registered.Store(true)
	}
	for _, r := range p.retries {
		r.registered.Store(true)
	}
	for _, b := range p.breakers {
		b.registered.Store(true)
	}
}

// unregistered returns the parts whose metrics nobody registered by hand.
func (p chainParts) unregistered() chainParts {
	var out chainParts
	for _, d := range p.deadLetters {
		if !d.registered.Load() {
			out.deadLetters = append(out.deadLetters, d)
		}
	}
	for _, r := range p.retries {
		if !r.registered.Load() {
			out.retries = append(out.retries, r)
		}
	}
	for _, b := range p.breakers {
		if !b.registered.Load() {
			out.breakers = append(out.breakers, b)
		}
	}
	for _, m := range p.metrics {
		if !m.MetricsRegistered() {
			out.metrics = append(out.metrics, m)
		}
	}
	return out
}

// registerMetrics reports the counters of the middleware parts through mp
// with attrs.
func (p chainParts) registerMetrics(mp metric.MeterProvider, attrs metric.MeasurementOption) (metric.Registration, error) {
	m := mp.Meter("github.com/ferrymq/ferry/consumer")
	var errs []error
	// Units are what is counted, in UCUM's curly braces as the OpenTelemetry
	// semantic conventions write them: messages, openings of the breaker,
	// and a state (an enumeration, not a quantity).
	counter := func(name, desc, unit string) metric.Int64ObservableCounter {
		c, err := m.Int64ObservableCounter(name, metric.WithDescription(desc), metric.WithUnit(unit))
		errs = append(errs, err)
		return c
	}
	dead := counter(MetricDeadLettered, "Messages moved to the dead-letter destination.", "{message}")
	dlqFail := counter(MetricDLQFailures, "Dead-letter publishes that failed; the message was not acked.", "{message}")
	retries := counter(MetricRetries, "Handler runs repeated in process after a failure.", "{message}")
	givenBack := counter(MetricGivenBack, "Deliveries returned to the broker with a redelivery delay.", "{message}")
	opened := counter(MetricBreakerOpened, "Times the circuit breaker opened.", "{opening}")
	held := counter(MetricBreakerHeld, "Messages held while the circuit breaker was open.", "{message}")
	state, err := m.Int64ObservableGauge(MetricBreakerState,
		metric.WithDescription("Circuit breaker state: 0 closed, 1 half-open, 2 open."), metric.WithUnit("{state}"))
	errs = append(errs, err)
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		var nDead, nFail, nRetries, nBack int64
		for _, d := range p.deadLetters {
			nDead += d.Count()
			nFail += d.PublishFailures()
		}
		for _, r := range p.retries {
			nRetries += r.Retries()
			nBack += r.GivenBack()
		}
		if len(p.deadLetters) > 0 {
			o.ObserveInt64(dead, nDead, attrs)
			o.ObserveInt64(dlqFail, nFail, attrs)
		}
		if len(p.retries) > 0 {
			o.ObserveInt64(retries, nRetries, attrs)
			o.ObserveInt64(givenBack, nBack, attrs)
		}
		for _, b := range p.breakers {
			battrs := metric.WithAttributes(attribute.String("ferry.breaker.name", b.Name()))
			o.ObserveInt64(state, int64(b.State()), attrs, battrs)
			o.ObserveInt64(opened, b.Opened(), attrs, battrs)
			o.ObserveInt64(held, b.Held(), attrs, battrs)
		}
		return nil
	}, dead, dlqFail, retries, givenBack, opened, held, state)
}

// MetricsSource is a middleware whose counters a Loop reports on its own
// MeterProvider while it runs the middleware (idempotency's Dedup is one):
// a Handler in the chain that has a method MetricsSource() MetricsSource is
// asked for it. One WithMeterProvider then wires every metric of a
// consumer.
type MetricsSource interface {
	// RegisterMetrics reports the counters through mp, labelled with the
	// consumer's name, until the registration is unregistered.
	RegisterMetrics(mp metric.MeterProvider, name string) (metric.Registration, error)
	// MetricsRegistered reports whether RegisterMetrics was called by hand:
	// a Loop then does not register it again.
	MetricsRegistered() bool
}

// metricsSourcer is a Handler layer that names its MetricsSource.
type metricsSourcer interface{ MetricsSource() MetricsSource }
