// Package inboxcount counts what a transactional inbox (pgstore's,
// sqlitestore's) does, and reports it under the idempotency middleware's
// metric names, so that a dashboard reads one set of series whichever way a
// consumer deduplicates.
package inboxcount

import (
	"context"
	"errors"
	"sync/atomic"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// Counts is an inbox's counters. It is a consumer.MetricsSource: the Loop
// running the inbox registers it on its own MeterProvider.
type Counts struct {
	Completed   atomic.Int64 // handler runs committed with their key
	Duplicates  atomic.Int64 // duplicates acknowledged without running
	StoreErrors atomic.Int64 // database calls that failed
	NoKey       atomic.Int64 // messages without a key

	registered atomic.Bool
}

var _ consumer.MetricsSource = (*Counts)(nil)

// MetricsRegistered reports whether RegisterMetrics was called by hand.
func (c *Counts) MetricsRegistered() bool { return c.registered.Load() }

// RegisterMetrics reports the counters through mp, labelled with the
// consumer's name, until the registration is unregistered.
func (c *Counts) RegisterMetrics(mp metric.MeterProvider, name string) (metric.Registration, error) {
	m := mp.Meter("github.com/ferrymq/ferry/idempotency")
	var errs []error
	counter := func(name, desc string) metric.Int64ObservableCounter {
		ctr, err := m.Int64ObservableCounter(name, metric.WithDescription(desc), metric.WithUnit("{message}"))
		errs = append(errs, err)
		return ctr
	}
	completed := counter(idempotency.MetricCompleted, "Handler runs whose key was recorded as done.")
	duplicates := counter(idempotency.MetricDuplicates, "Duplicates of done keys, acknowledged without running the handler.")
	storeErrs := counter(idempotency.MetricStoreErrors, "Calls to the idempotency store that failed.")
	noKey := counter(idempotency.MetricNoKey, "Messages without an idempotency key, failed as permanent.")
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	attrs := metric.WithAttributes(attribute.String("messaging.consumer.group.name", name))
	return m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		o.ObserveInt64(completed, c.Completed.Load(), attrs)
		o.ObserveInt64(duplicates, c.Duplicates.Load(), attrs)
		o.ObserveInt64(storeErrs, c.StoreErrors.Load(), attrs)
		o.ObserveInt64(noKey, c.NoKey.Load(), attrs)
		return nil
	}, completed, duplicates, storeErrs, noKey)
}

// Handler is an inbox's consumer.Handler: its function, and its counts for
// the Loop to register.
type Handler struct {
	Fn     func(ctx context.Context, m *consumer.Message) error
	Counts *Counts
}

// Handle runs the inbox.
func (h *Handler) Handle(ctx context.Context, m *consumer.Message) error { return h.Fn(ctx, m) }

// MetricsSource returns the inbox's counts.
func (h *Handler) MetricsSource() consumer.MetricsSource { return h.Counts }

// StoreErr counts a failed database call and returns err wrapped by wrap.
func (c *Counts) StoreErr(wrap func(string, error) error, op string, err error) error {
	c.StoreErrors.Add(1)
	return wrap(op, err)
}
