package outbox

import (
	"context"
	"errors"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/ferrymq/ferry/consumer"
)

// Metric instrument names. They are observed from the relay's counters and
// one backlog query (Store.Backlog, whose cost does not grow with the
// backlog) when a reader collects, so a relay costs nothing per event for its
// metrics, and nothing at all when no MeterProvider is installed. Each carries the attribute ferry.outbox.relay (the relay's
// name).
const (
	MetricPublished       = "ferry.outbox.published"        // counter: events published and deleted
	MetricPublishFailures = "ferry.outbox.publish_failures" // counter: Publish calls that failed
	MetricFailed          = "ferry.outbox.failed"           // counter: events moved to the failed-events table
	MetricBacklog         = "ferry.outbox.backlog"          // gauge: events waiting to be published, counted up to BacklogCountLimit
	MetricOldestAge       = "ferry.outbox.oldest_age"       // gauge, seconds: how long the longest-waiting due event has been due
	MetricScheduled       = "ferry.outbox.scheduled"        // gauge: events held until a NotBefore still ahead, counted up to BacklogCountLimit
	MetricLanes           = "ferry.outbox.lanes"            // gauge: lanes this relay holds
)

// WithMeterProvider sets where the relay reports its metrics while it runs.
// Default the global provider (otel.GetMeterProvider), a no-op until one is
// installed.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(c *relayConfig) error {
		if mp == nil {
			return consumer.ConfigErrorf("MeterProvider", "must not be nil")
		}
		c.meterProvider = mp
		return nil
	}
}

// registerMetrics registers the relay's observable instruments for the
// length of one Run.
func (r *Relay) registerMetrics() (metric.Registration, error) {
	mp := r.cfg.meterProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	m := mp.Meter("github.com/ferrymq/ferry/outbox")
	var errs []error
	counter := func(name, desc string) metric.Int64ObservableCounter {
		c, err := m.Int64ObservableCounter(name, metric.WithDescription(desc), metric.WithUnit("{event}"))
		errs = append(errs, err)
		return c
	}
	published := counter(MetricPublished, "Outbox events published and deleted.")
	failures, err := m.Int64ObservableCounter(MetricPublishFailures, metric.WithDescription("Publish calls that failed in part or in whole."), metric.WithUnit("{call}"))
	errs = append(errs, err)
	failed := counter(MetricFailed, "Outbox events refused for good and moved to the failed-events table.")
	backlog, err := m.Int64ObservableGauge(MetricBacklog, metric.WithDescription("Outbox events waiting to be published."), metric.WithUnit("{event}"))
	errs = append(errs, err)
	oldest, err := m.Float64ObservableGauge(MetricOldestAge, metric.WithDescription("How long the longest-waiting outbox event has been due: since it was written, or since its NotBefore."), metric.WithUnit("s"))
	errs = append(errs, err)
	scheduled, err := m.Int64ObservableGauge(MetricScheduled, metric.WithDescription("Outbox events held until a NotBefore still ahead (part of the backlog)."), metric.WithUnit("{event}"))
	errs = append(errs, err)
	lanes, err := m.Int64ObservableGauge(MetricLanes, metric.WithDescription("Outbox lanes this relay holds."), metric.WithUnit("{lane}"))
	errs = append(errs, err)
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	attrs := metric.WithAttributes(attribute.String("ferry.outbox.relay", r.cfg.name))
	return m.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		s := r.Stats()
		o.ObserveInt64(published, s.Published, attrs)
		o.ObserveInt64(failures, s.PublishFailures, attrs)
		o.ObserveInt64(failed, s.Failed, attrs)
		o.ObserveInt64(lanes, int64(s.Lanes), attrs)
		bctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		if b, err := r.store.Backlog(bctx); err == nil {
			o.ObserveInt64(backlog, b.Events, attrs)
			o.ObserveFloat64(oldest, b.OldestAge.Seconds(), attrs)
			o.ObserveInt64(scheduled, b.Scheduled, attrs)
		}
		return nil
	}, published, failures, failed, backlog, oldest, scheduled, lanes)
}
