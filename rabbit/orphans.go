package rabbit

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/metric"
)

// A delayed message whose queue was deleted while it waited goes, when its
// time comes, to the queue ferry.delay.orphans, which nobody consumes. Left
// at that, it would be lost without a sign: so a Broker that published a
// delayed message watches that queue, counts what waits there in the metric
// MetricDelayOrphans, and logs a warning each time the count grows.

// MetricDelayOrphans is the gauge of the messages waiting in the queue
// ferry.delay.orphans: delayed messages whose queue was gone when their
// time came. A Broker reports it once it has published a delayed message,
// read every [DefaultOrphanCheck] (a passive declare of the queue); any
// value above 0 needs an operator.
const MetricDelayOrphans = "ferry.rabbit.delay.orphans"

// DefaultOrphanCheck is how often a Broker that published a delayed message
// counts the messages in ferry.delay.orphans.
const DefaultOrphanCheck = 30 * time.Second

// orphanWatch is a Broker's watch of ferry.delay.orphans.
type orphanWatch struct {
	every   time.Duration
	started atomic.Bool
	count   atomic.Int64 // the last count read; -1 before the first
	warned  int64        // the count the last warning gave (watch goroutine only)
}

// registerOrphanGauge reports the last count read, once there is one.
func (b *Broker) registerOrphanGauge(mp metric.MeterProvider) error {
	m := mp.Meter("github.com/ferrymq/ferry/rabbit")
	g, err := m.Int64ObservableGauge(MetricDelayOrphans, metric.WithUnit("{message}"),
		metric.WithDescription("Delayed messages whose queue was gone when their time came, waiting in ferry.delay.orphans."))
	if err != nil {
		return err
	}
	_, err = m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		if n := b.orphans.count.Load(); n >= 0 {
			o.ObserveInt64(g, n)
		}
		return nil
	}, g)
	return err
}

// watchOrphans starts the watch, once in the Broker's life: called when the
// delay levels were declared or found.
func (b *Broker) watchOrphans() {
	if b.orphans.started.Swap(true) {
		return
	}
	go func() {
		t := time.NewTicker(b.orphans.every)
		defer t.Stop()
		for {
			b.checkOrphans()
			select {
			case <-b.closed:
				return
			case <-t.C:
			}
		}
	}()
}

// checkOrphans counts the messages in ferry.delay.orphans and tells the
// operator when the count grew. A count that cannot be read (the connection
// is down, which its own warnings report) keeps the last one.
func (b *Broker) checkOrphans() {
	ctx, cancel := context.WithTimeout(b.life, 10*time.Second)
	defer cancel()
	n, err := b.countOrphans(ctx)
	if err != nil {
		if b.life.Err() == nil {
			b.log.Debug("ferry/rabbit: could not count the delayed messages in "+scheduleOrphans, "err", err)
		}
		return
	}
	b.orphans.count.Store(n)
	w := &b.orphans.warned
	switch {
	case n > *w:
		b.log.Warn("ferry/rabbit: delayed messages whose queue was gone when their time came wait in "+scheduleOrphans+
			"; nothing consumes it: see them with ferry dlq peek "+scheduleOrphans+", and redrive or purge them",
			"messages", n, "new", n-*w)
		*w = n
	case n == 0 && *w > 0:
		b.log.Info("ferry/rabbit: " + scheduleOrphans + " is empty again")
		*w = 0
	case n < *w:
		*w = n // some were taken: warn again only when it grows past this
	}
}

// countOrphans is how many messages ferry.delay.orphans holds (0 when it
// does not exist).
func (b *Broker) countOrphans(ctx context.Context) (int64, error) {
	conn, err := b.consConn.get(ctx)
	if err != nil {
		return 0, err
	}
	var n int
	err = withContext(ctx, func() error {
		ch, err := conn.Channel()
		if err != nil {
			return err
		}
		defer closeChannel(ch)
		q, err := ch.QueueDeclarePassive(scheduleOrphans, true, false, false, false, nil)
		if isNotFound(err) {
			return nil
		}
		n = q.Messages
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("count %s: %w", scheduleOrphans, err)
	}
	return int64(n), nil
}
