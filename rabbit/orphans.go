package rabbit

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"
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
	unreg   metric.Registration

	// Of the watch goroutine alone:
	read   bool  // a count was read
	warned int64 // the count the last warning gave, or the one it fell to
	last   int64 // the count read before this one
}

// watchOrphans starts the watch, once in the Broker's life: called when the
// delay levels were declared or found. Its gauge is registered here, not
// before: a Broker that never delays a message reports nothing.
func (b *Broker) watchOrphans() {
	if b.orphans.started.Swap(true) {
		return
	}
	if err := b.registerOrphanGauge(); err != nil {
		b.log.Warn("ferry/rabbit: the gauge "+MetricDelayOrphans+" is not reported", "err", err)
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

// registerOrphanGauge reports the last count read, once there is one, with
// the attributes that keep Brokers of other clusters apart.
func (b *Broker) registerOrphanGauge() error {
	m := b.cfg.meters.Meter("github.com/ferrymq/ferry/rabbit")
	g, err := m.Int64ObservableGauge(MetricDelayOrphans, metric.WithUnit("{message}"),
		metric.WithDescription("Delayed messages whose queue was gone when their time came, waiting in ferry.delay.orphans."))
	if err != nil {
		return err
	}
	first := b.uris[0]
	attrs := metric.WithAttributeSet(attribute.NewSet(
		attribute.String("messaging.system", MessagingSystem),
		attribute.String("messaging.destination.name", scheduleOrphans),
		attribute.String("server.address", first.Host),
		attribute.Int("server.port", first.Port),
		attribute.String("ferry.rabbit.vhost", first.Vhost),
	))
	reg, err := m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		if n := b.orphans.count.Load(); n >= 0 {
			o.ObserveInt64(g, n, attrs)
		}
		return nil
	}, g)
	if err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.isClosed() {
		return reg.Unregister() // Close came first: it found nothing to unregister
	}
	b.orphans.unreg = reg
	return nil
}

// stopOrphanGauge unregisters the gauge (Close): the MeterProvider would
// keep the Broker, and its last count, for good.
func (b *Broker) stopOrphanGauge() {
	b.mu.Lock()
	reg := b.orphans.unreg
	b.orphans.unreg = nil
	b.mu.Unlock()
	if reg != nil {
		_ = reg.Unregister()
	}
}

// checkOrphans counts the messages in ferry.delay.orphans and tells the
// operator when the count grew. A count that cannot be read (the connection
// is down, which its own warnings report) keeps the last one.
func (b *Broker) checkOrphans() {
	ctx, cancel := context.WithTimeout(b.life, 10*time.Second)
	defer cancel()
	n, err := b.countOrphans(ctx)
	if errors.Is(err, errOrphansGone) {
		// The fanout exchange now routes to nothing, and a delayed message
		// of a deleted queue would stay in its level for ever, stopping
		// the level: declare it again now.
		if err := b.redeclareOrphans(ctx); err != nil {
			b.log.Warn("ferry/rabbit: the queue "+scheduleOrphans+" was deleted and could not be declared again: a delayed message whose queue is gone will stop its level of delay until it is", "err", err)
			return
		}
		b.log.Warn("ferry/rabbit: the queue " + scheduleOrphans + " was deleted; declared it again")
		return
	}
	if err != nil {
		if b.life.Err() == nil {
			b.log.Debug("ferry/rabbit: could not count the delayed messages in "+scheduleOrphans, "err", err)
		}
		return
	}
	b.orphans.count.Store(n)
	const hint = "; nothing consumes it: see them with ferry dlq peek " + scheduleOrphans + ", and redrive or purge them"
	switch news, added := b.orphans.note(n); news {
	case orphansFound:
		b.log.Warn("ferry/rabbit: delayed messages whose queue was gone when their time came wait in "+scheduleOrphans+hint, "messages", n)
	case orphansAdded:
		b.log.Warn("ferry/rabbit: more delayed messages whose queue was gone when their time came wait in "+scheduleOrphans+hint,
			"messages", n, "new", added)
	case orphansGone:
		b.log.Info("ferry/rabbit: " + scheduleOrphans + " is empty again")
	}
}

// orphanNews is what a count of the orphans tells the operator.
type orphanNews int

const (
	orphansNoNews orphanNews = iota
	orphansFound             // the first count, and some wait
	orphansAdded             // more than the last warning gave
	orphansGone              // none left, at two counts in a row
)

// note takes a count (of the watch goroutine) and says what it tells the
// operator, and for orphansAdded how many are new.
func (w *orphanWatch) note(n int64) (orphanNews, int64) {
	prev, first := w.last, !w.read
	w.last, w.read = n, true
	switch {
	case first && n > 0:
		w.warned = n
		return orphansFound, n
	case n > w.warned:
		added := n - w.warned
		w.warned = n
		return orphansAdded, added
	case n < w.warned && prev < w.warned:
		// Lower at two counts in a row: taken (moved or purged), not held
		// for a moment by a peek (a passive declare counts only the
		// messages ready, not those a consumer holds).
		w.warned = max(n, prev)
		if w.warned == 0 {
			return orphansGone, 0
		}
	}
	return orphansNoNews, 0
}

// redeclareOrphans declares ferry.delay.orphans again, as the levels had
// it.
func (b *Broker) redeclareOrphans(ctx context.Context) error {
	version, err := b.serverVersion(ctx)
	if err != nil {
		return err
	}
	return withContext(ctx, func() error {
		return b.onChannel(ctx, func(ch *amqp.Channel) error {
			err := declareOrphans(ch, serverMajor(version) >= 4)
			return refused(err)
		})
	})
}

// errOrphansGone is countOrphans' error when ferry.delay.orphans does not
// exist.
var errOrphansGone = errors.New("the queue " + scheduleOrphans + " does not exist")

// countOrphans is how many messages ferry.delay.orphans holds ready.
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
			return errOrphansGone
		}
		n = q.Messages
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("count %s: %w", scheduleOrphans, err)
	}
	return int64(n), nil
}
