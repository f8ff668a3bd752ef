package rabbit

import (
	"context"
	"errors"
	"fmt"
	"strings"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
)

var _ consumer.Admin = (*Broker)(nil)

// CreateSource declares the durable queue name with cfg ([consumer.Admin]),
// on the Broker's consuming connection (the publishing one may be blocked
// by an alarm, and declaring is no publish). It is the quorum queue a
// Topology's Queue declares by default, with:
//
//   - FIFO: a single active consumer (x-single-active-consumer), as
//     [Queue.SingleActiveConsumer];
//   - DeadLetter: messages the queue dead-letters go to that queue through
//     the default exchange (x-dead-letter-exchange "",
//     x-dead-letter-routing-key DeadLetter). The dead-letter queue is
//     declared first, a plain quorum queue, when it does not exist: a
//     message dead-lettered to no queue is dropped. DeleteSource does not
//     delete it.
//   - MaxDeliveries: x-delivery-limit, the deliveries after which the queue
//     dead-letters a message. It needs DeadLetter (without one RabbitMQ
//     drops such messages): alone it is a *[consumer.ConfigError]. With
//     DeadLetter and 0, the broker's default applies (20 on RabbitMQ 4,
//     none on 3). Without DeadLetter, and on RabbitMQ 4 or later, the
//     queue is declared with no limit (x-delivery-limit -1), as on 3:
//     RabbitMQ 4's default of 20 would drop a message that goes back 20
//     times with nowhere to dead-letter it, and the loop's own retry and
//     dead-letter middleware decide a message's end instead. A queue that
//     exists with the default (declared without the argument, by an earlier
//     CreateSource or another client) is kept, and a warning says it drops.
//   - Retention: x-message-ttl, in milliseconds (at least 1).
//
// Lease is a *[consumer.ConfigError]: a RabbitMQ delivery holds no lease
// that runs out. Partitions is ignored. A queue that exists with the same
// arguments is not an error; with others RabbitMQ refuses it (406 PRECONDITION_FAILED)
// and so does CreateSource.
func (b *Broker) CreateSource(ctx context.Context, name string, cfg consumer.SourceConfig) error {
	if name == "" {
		return consumer.ConfigErrorf("queue", "name must not be empty")
	}
	if cfg.MaxDeliveries < 0 {
		return consumer.ConfigErrorf("SourceConfig.MaxDeliveries", "must be >= 0, got %d", cfg.MaxDeliveries)
	}
	if cfg.MaxDeliveries > 0 && cfg.DeadLetter == "" {
		return consumer.ConfigErrorf("SourceConfig.MaxDeliveries", "needs a DeadLetter queue: past the limit RabbitMQ drops a message that has none")
	}
	if cfg.DeadLetter == name {
		return consumer.ConfigErrorf("SourceConfig.DeadLetter", "must not be the queue itself")
	}
	if cfg.Retention < 0 {
		return consumer.ConfigErrorf("SourceConfig.Retention", "must be >= 0, got %v", cfg.Retention)
	}
	if cfg.Lease != 0 {
		return consumer.ConfigErrorf("SourceConfig.Lease", "RabbitMQ deliveries hold no lease that runs out: a delivery is the consumer's until it is settled or its channel closes")
	}
	q := Queue{Name: name, SingleActiveConsumer: cfg.FIFO, DeliveryLimit: cfg.MaxDeliveries}
	if cfg.DeadLetter != "" {
		q.DeadLetterExchange, q.DeadLetterRoutingKey = "", cfg.DeadLetter
	}
	if cfg.Retention > 0 {
		q.Args = amqp.Table{"x-message-ttl": max(cfg.Retention.Milliseconds(), 1)}
	}
	if cfg.DeadLetter != "" {
		err := b.onChannel(ctx, func(ch *amqp.Channel) error {
			_, err := ch.QueueDeclarePassive(cfg.DeadLetter, true, false, false, false, nil)
			return err
		})
		if isNotFound(err) {
			err = b.onChannel(ctx, func(ch *amqp.Channel) error { return declareQueue(ch, Queue{Name: cfg.DeadLetter}) })
		}
		if err != nil {
			return fmt.Errorf("rabbit: create queue %q: dead-letter queue %q: %w", name, cfg.DeadLetter, err)
		}
	}
	version, err := b.serverVersion(ctx)
	if err != nil {
		return fmt.Errorf("rabbit: create queue %q: %w", name, err)
	}
	unlimited := cfg.DeadLetter == "" && serverMajor(version) >= 4
	if unlimited {
		if q.Args == nil {
			q.Args = amqp.Table{}
		}
		q.Args["x-delivery-limit"] = int64(-1)
	}
	err = b.onChannel(ctx, func(ch *amqp.Channel) error { return declareQueue(ch, q) })
	if unlimited && isInequivalent(err, "x-delivery-limit") {
		// The queue exists with the broker's default limit: keep it.
		delete(q.Args, "x-delivery-limit")
		if err = b.onChannel(ctx, func(ch *amqp.Channel) error { return declareQueue(ch, q) }); err == nil {
			b.log.Warn("rabbit: CreateSource found the quorum queue declared with RabbitMQ's default delivery limit and no dead-letter exchange: a message delivered more than delivery_limit times is dropped (delete the queue and create it again, or give it a DeadLetter)",
				"queue", name, "delivery_limit", defaultDeliveryLimit, "rabbitmq_version", version)
		}
	}
	if err != nil {
		return fmt.Errorf("rabbit: create %w", err)
	}
	return nil
}

// serverVersion is the version the broker of the consuming connection
// announces ("4.0.5"), or "" when it announces none.
func (b *Broker) serverVersion(ctx context.Context) (string, error) {
	if b.isClosed() {
		return "", ErrClosed
	}
	conn, err := b.consConn.get(ctx)
	if err != nil {
		return "", err
	}
	v, _ := conn.Properties["version"].(string)
	return v, nil
}

// isInequivalent reports whether err is the broker's refusal of a
// declaration whose argument arg differs from the existing queue's (406
// PRECONDITION_FAILED, "inequivalent arg").
func isInequivalent(err error, arg string) bool {
	var ae *amqp.Error
	return errors.As(err, &ae) && ae.Code == amqp.PreconditionFailed &&
		strings.Contains(ae.Reason, "inequivalent arg '"+arg+"'")
}

// DeleteSource deletes queue name and its messages ([consumer.Admin]),
// with the delay queues that hold its retries (see [WithRetryDelays]): a
// retry due later is a message of the queue too. A queue that does not
// exist is not an error. Consumers of the queue are cancelled by the broker
// (their drivers report [ErrConsumerCancelled] until it is declared again).
func (b *Broker) DeleteSource(ctx context.Context, name string) error {
	if name == "" {
		return consumer.ConfigErrorf("queue", "name must not be empty")
	}
	queues := []string{name}
	for _, d := range b.cfg.retryDelays {
		queues = append(queues, delayQueueName(name, d))
	}
	var errs []error
	for _, q := range queues {
		// Each on a channel of its own: a refusal closes the channel.
		err := b.onChannel(ctx, func(ch *amqp.Channel) error {
			_, err := ch.QueueDelete(q, false, false, false)
			return err
		})
		if err != nil && !isNotFound(err) {
			errs = append(errs, fmt.Errorf("rabbit: delete queue %q: %w", q, err))
		}
	}
	return errors.Join(errs...)
}

// onChannel runs f on a channel of its own on the consuming connection,
// and closes the channel.
func (b *Broker) onChannel(ctx context.Context, f func(ch *amqp.Channel) error) error {
	if b.isClosed() {
		return ErrClosed
	}
	conn, err := b.consConn.get(ctx)
	if err != nil {
		return err
	}
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open a channel: %w", err)
	}
	defer ch.Close()
	return f(ch)
}

// isNotFound reports whether err is the broker's 404 NOT_FOUND.
func isNotFound(err error) bool {
	var ae *amqp.Error
	return errors.As(err, &ae) && ae.Code == amqp.NotFound
}
