package idempotency

import (
	"context"
	"errors"

	"github.com/ferrymq/ferry/consumer"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// Metric instrument names of a Dedup, observed from its counters when a
// reader collects.
const (
	MetricCompleted   = "ferry.idempotency.completed"    // counter: handler runs whose key was recorded done
	MetricDuplicates  = "ferry.idempotency.duplicates"   // counter: duplicates of done keys, acked without running
	MetricDeferred    = "ferry.idempotency.deferred"     // counter: deliveries deferred while their key was held elsewhere
	MetricClaimsLost  = "ferry.idempotency.claims_lost"  // counter: handler runs that outlived their claim
	MetricReleased    = "ferry.idempotency.released"     // counter: claims released after the handler failed
	MetricStoreErrors = "ferry.idempotency.store_errors" // counter: failed store calls
	MetricNoKey       = "ferry.idempotency.no_key"       // counter: messages without a key
)

// RegisterMetrics reports d's counters through mp, labelled with name (the
// consumer's name, as messaging.consumer.group.name), until the returned
// registration is unregistered. The counters are read when a reader
// collects, so the middleware costs nothing more per message. Claims lost
// and store errors that grow are what an alert should watch.
//
// A consumer.Loop running the middleware registers these itself, on its own
// MeterProvider, when Run starts; call RegisterMetrics only to report them
// elsewhere. A Dedup registered here is not registered again by a Loop.
func (d *Dedup) RegisterMetrics(mp metric.MeterProvider, name string) (metric.Registration, error) {
	d.registered.Store(true)
	return d.registerMetrics(mp, name)
}

// MetricsRegistered reports whether RegisterMetrics was called: a
// consumer.Loop then does not register d's metrics again.
func (d *Dedup) MetricsRegistered() bool { return d.registered.Load() }

// MetricsSource returns d, for the consumer.Loop that runs h to register
// its metrics.
func (h *handler) MetricsSource() consumer.MetricsSource { return h.d }

func (d *Dedup) registerMetrics(mp metric.MeterProvider, name string) (metric.Registration, error) {
	if mp == nil {
		return nil, consumer.ConfigErrorf("MeterProvider", "must not be nil")
	}
	m := mp.Meter("github.com/ferrymq/ferry/idempotency")
	var errs []error
	counter := func(name, desc string) metric.Int64ObservableCounter {
		c, err := m.Int64ObservableCounter(name, metric.WithDescription(desc), metric.WithUnit("{message}"))
		errs = append(errs, err)
		return c
	}
	completed := counter(MetricCompleted, "Handler runs whose key was recorded as done.")
	duplicates := counter(MetricDuplicates, "Duplicates of done keys, acknowledged without running the handler.")
	deferred := counter(MetricDeferred, "Deliveries deferred because another worker held their key.")
	lost := counter(MetricClaimsLost, "Handler runs that finished after their claim's lease ended; the effect may have happened twice.")
	released := counter(MetricReleased, "Claims released after the handler failed.")
	storeErrs := counter(MetricStoreErrors, "Calls to the idempotency store that failed.")
	noKey := counter(MetricNoKey, "Messages without an idempotency key, failed as permanent.")
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	attrs := metric.WithAttributes(attribute.String("messaging.consumer.group.name", name))
	return m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		o.ObserveInt64(completed, d.Completed(), attrs)
		o.ObserveInt64(duplicates, d.Duplicates(), attrs)
		o.ObserveInt64(deferred, d.Deferred(), attrs)
		o.ObserveInt64(lost, d.ClaimsLost(), attrs)
		o.ObserveInt64(released, d.Released(), attrs)
		o.ObserveInt64(storeErrs, d.StoreErrors(), attrs)
		o.ObserveInt64(noKey, d.NoKey(), attrs)
		return nil
	}, completed, duplicates, deferred, lost, released, storeErrs, noKey)
}
