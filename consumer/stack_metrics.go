package consumer

import (
	"context"
	"errors"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
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
func (s *Stack) RegisterMetrics(mp metric.MeterProvider, name string) (metric.Registration, error) {
	if mp == nil {
		return nil, configErr("MeterProvider", "must not be nil")
	}
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
	attrs := metric.WithAttributes(attribute.String("messaging.consumer.group.name", name))
	return m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		if s.DeadLetter != nil {
			o.ObserveInt64(dead, s.DeadLetter.Count(), attrs)
			o.ObserveInt64(dlqFail, s.DeadLetter.PublishFailures(), attrs)
		}
		if s.Retry != nil {
			o.ObserveInt64(retries, s.Retry.Retries(), attrs)
			o.ObserveInt64(givenBack, s.Retry.GivenBack(), attrs)
		}
		if s.Breaker != nil {
			o.ObserveInt64(state, int64(s.Breaker.State()), attrs)
			o.ObserveInt64(opened, s.Breaker.Opened(), attrs)
			o.ObserveInt64(held, s.Breaker.Held(), attrs)
		}
		return nil
	}, dead, dlqFail, retries, givenBack, opened, held, state)
}
