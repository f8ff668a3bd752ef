package rabbit

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
)

// Delayed publish (Message.NotBefore) without a plugin: the delayed-message
// exchange is archived and cannot run on RabbitMQ 4.3. A delayed message
// passes through levels of delay, one per bit of its delay in seconds, as
// NServiceBus's RabbitMQ transport does it: level n is a topic exchange and
// a quorum queue whose messages expire after 2^n seconds and are then
// dead-lettered to level n-1. The routing key spells the delay in bits,
// highest level first, then names the destination: at each level, a
// message whose bit is set waits in the level's queue, and one whose bit
// is clear goes on to the next level at once, so it waits exactly its
// delay in all, to the second, and every queue holds messages of one TTL
// (which RabbitMQ expires only at a queue's head, in order). Past level 0,
// the delivery exchange routes it to its queue, bound to it by the hash of
// the queue's name.
//
// The levels are durable quorum queues that dead-letter at least once
// (x-dead-letter-strategy at-least-once, which needs x-overflow
// reject-publish): a message is in a level's queue or the next until its
// destination queue takes it, node failures included.

// scheduleLevels is how many levels there are: delays up to 2^28-1 seconds
// (about eight and a half years), as NServiceBus has them.
const scheduleLevels = 28

// MaxDelay is the longest a message can be held before its queue gets it
// (Message.NotBefore): 2^28-1 seconds, about eight and a half years.
const MaxDelay = (1<<scheduleLevels - 1) * time.Second

// scheduleDeliver is the exchange past level 0, which routes a message to
// its destination queue.
const scheduleDeliver = "ferry.delay.deliver"

// scheduleOrphans is the fanout exchange and the quorum queue that take a
// delayed message whose queue is gone when its time comes: the alternate
// exchange of scheduleDeliver. Without it, a level's at-least-once
// dead-lettering keeps such a message and retries it for ever, and 32 of
// them (its worker's prefetch) stop every later message of the level, for
// every queue of the vhost (RabbitMQ PR 14961; reproduced on 3.10 and 4.0).
const scheduleOrphans = "ferry.delay.orphans"

// scheduleExchangePrefix starts the name of every exchange of delayed
// publish; scheduleLevelPrefix, of every level's exchange and queue.
const (
	scheduleExchangePrefix = "ferry.delay."
	scheduleLevelPrefix    = "ferry.delay.level."
)

// scheduleLevel is the name of level n's exchange and queue.
func scheduleLevel(n int) string { return fmt.Sprintf("%s%02d", scheduleLevelPrefix, n) }

// scheduleWord is the last word of a delayed message's routing key and of
// its queue's binding to scheduleDeliver: a hash of the queue's name, one
// word whatever dots the name holds (a binding "#.name" would also take the
// messages of every queue whose name ends in ".name").
func scheduleWord(queue string) string {
	h := sha256.Sum256([]byte(queue))
	return hex.EncodeToString(h[:16])
}

// scheduleRoute is where a message held for delay (whole seconds, 1 to
// MaxDelay) to queue is published: the top level's exchange, with a routing
// key of one word per level from the top, "1" where the delay has that bit,
// then the queue's word.
func scheduleRoute(delay time.Duration, queue string) (exchange, routingKey string) {
	secs := int64(delay / time.Second)
	var b strings.Builder
	for n := scheduleLevels - 1; n >= 0; n-- {
		if secs>>n&1 == 1 {
			b.WriteString("1.")
		} else {
			b.WriteString("0.")
		}
	}
	b.WriteString(scheduleWord(queue))
	return scheduleLevel(scheduleLevels - 1), b.String()
}

// scheduleDelay is how long a message due at notBefore is held when
// published at now: whole seconds, rounded up, so that it is never early.
func scheduleDelay(notBefore, now time.Time) time.Duration {
	d := notBefore.Sub(now)
	return (d + time.Second - 1) / time.Second * time.Second
}

// levelPattern is the binding key that matches, at level n, routing keys
// whose bit for n is bit.
func levelPattern(n int, bit string) string {
	return strings.Repeat("*.", scheduleLevels-1-n) + bit + ".#"
}

// schedule declares the levels of delayed publish once per consuming
// connection (which an alarm does not block).
type schedule struct {
	turn   chan struct{}    // held while the levels are checked or declared; made by newBroker
	levels *amqp.Connection // the connection the levels were declared on; under turn
}

// forget makes the next delayed publish declare the levels again (one of
// them was found gone).
func (s *schedule) forget() {
	s.turn <- struct{}{}
	s.levels = nil
	<-s.turn
}

// prepareSchedule declares the levels, when not done on this connection
// yet, and the binding of queue to the delivery exchange. A queue that does
// not exist fails it (404, [consumer.ErrSourceNotFound]): a delayed message
// would have nowhere to go. A user that may not declare the levels (403)
// uses them where they exist; the refusal is an [ErrRefused].
func (b *Broker) prepareSchedule(ctx context.Context, queue string) error {
	conn, err := b.consConn.get(ctx)
	if err != nil {
		return err
	}
	s := &b.sched
	select {
	case s.turn <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	if s.levels != conn {
		version, _ := conn.Properties["version"].(string)
		err := withContext(ctx, func() error {
			ch, err := conn.Channel()
			if err != nil {
				return err
			}
			defer closeChannel(ch)
			// No delivery limit on the orphans where RabbitMQ 4 would
			// set one (20): each look (ferry dlq peek) is a delivery,
			// and a message past the limit would be dropped.
			unlimited := serverMajor(version) >= 4
			err = declareLevels(ch, unlimited)
			if unlimited && isInequivalent(err, "x-delivery-limit") {
				// The orphans exist with the default limit: keep them.
				ch2, err2 := conn.Channel()
				if err2 != nil {
					return err2
				}
				defer closeChannel(ch2)
				if err = declareLevels(ch2, false); err == nil {
					b.log.Warn("ferry/rabbit: the queue "+scheduleOrphans+" has RabbitMQ's default delivery limit: a message looked at (ferry dlq peek) more than delivery_limit times is dropped; delete the queue once it is empty, and Ferry declares it without one",
						"delivery_limit", defaultDeliveryLimit, "rabbitmq_version", version)
				}
			}
			var ae *amqp.Error
			if errors.As(err, &ae) && ae.Code == amqp.AccessRefused && levelsExist(conn) == nil {
				return nil
			}
			return err
		})
		if err != nil {
			<-s.turn
			err = refused(err)
			hint := ""
			if errors.Is(err, ErrRefused) {
				hint = " (the user needs to configure " + scheduleExchangePrefix + "*, or an administrator to declare them as Ferry does)"
			}
			return fmt.Errorf("rabbit: declare the delay levels%s: %w", hint, err)
		}
		s.levels = conn
		b.watchOrphans()
	}
	<-s.turn
	// The binding is declared on every call (a round trip): a queue deleted
	// and declared again since the last call lost it, and its delayed
	// messages would reach no queue.
	err = withContext(ctx, func() error {
		ch, err := conn.Channel()
		if err != nil {
			return err
		}
		defer closeChannel(ch)
		return ch.QueueBind(queue, "#."+scheduleWord(queue), scheduleDeliver, false, nil)
	})
	if isNotFound(err) {
		return fmt.Errorf("rabbit: bind queue %q to the delivery of delayed messages: %w: %w", queue, consumer.ErrSourceNotFound, err)
	}
	if err != nil {
		return fmt.Errorf("rabbit: bind queue %q to the delivery of delayed messages: %w", queue, refused(err))
	}
	return nil
}

// declareLevels declares the orphans (with no delivery limit when
// unlimitedOrphans: RabbitMQ 4), the delivery exchange and every level: its
// exchange, its queue, the binding of the queue for messages with the
// level's bit set, and the binding to the next level for those without.
func declareLevels(ch *amqp.Channel, unlimitedOrphans bool) error {
	if err := declareOrphans(ch, unlimitedOrphans); err != nil {
		return err
	}
	if err := ch.ExchangeDeclare(scheduleDeliver, amqp.ExchangeTopic, true, false, false, false,
		amqp.Table{"alternate-exchange": scheduleOrphans}); err != nil {
		return fmt.Errorf("exchange %q: %w", scheduleDeliver, err)
	}
	next := scheduleDeliver
	for n := range scheduleLevels {
		name := scheduleLevel(n)
		if err := ch.ExchangeDeclare(name, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
			return fmt.Errorf("exchange %q: %w", name, err)
		}
		if _, err := ch.QueueDeclare(name, true, false, false, false, amqp.Table{
			"x-queue-type":           "quorum",
			"x-message-ttl":          int64(1<<n) * 1000,
			"x-dead-letter-exchange": next,
			"x-dead-letter-strategy": "at-least-once",
			"x-overflow":             "reject-publish",
		}); err != nil {
			return fmt.Errorf("queue %q: %w", name, err)
		}
		if err := ch.QueueBind(name, levelPattern(n, "1"), name, false, nil); err != nil {
			return fmt.Errorf("bind queue %q: %w", name, err)
		}
		if err := ch.ExchangeBind(next, levelPattern(n, "0"), name, false, nil); err != nil {
			return fmt.Errorf("bind exchange %q to %q: %w", name, next, err)
		}
		next = name
	}
	return nil
}

// declareOrphans declares the orphans' exchange and queue, and binds them.
func declareOrphans(ch *amqp.Channel, unlimited bool) error {
	if err := ch.ExchangeDeclare(scheduleOrphans, amqp.ExchangeFanout, true, false, false, false, nil); err != nil {
		return fmt.Errorf("exchange %q: %w", scheduleOrphans, err)
	}
	args := amqp.Table{"x-queue-type": "quorum"}
	if unlimited {
		args["x-delivery-limit"] = int64(-1)
	}
	if _, err := ch.QueueDeclare(scheduleOrphans, true, false, false, false, args); err != nil {
		return fmt.Errorf("queue %q: %w", scheduleOrphans, err)
	}
	if err := ch.QueueBind(scheduleOrphans, "", scheduleOrphans, false, nil); err != nil {
		return fmt.Errorf("bind queue %q: %w", scheduleOrphans, err)
	}
	return nil
}

// levelsExist reports whether the orphans, the delivery exchange and every
// level's exchange and queue exist, declared passively (which takes no
// configure permission): a user that may not declare them can use levels
// an administrator declared. Bindings cannot be checked so; they are taken
// to be there.
func levelsExist(conn *amqp.Connection) error {
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer closeChannel(ch)
	if err := ch.ExchangeDeclarePassive(scheduleDeliver, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
		return err
	}
	if _, err := ch.QueueDeclarePassive(scheduleOrphans, true, false, false, false, nil); err != nil {
		return err
	}
	for n := range scheduleLevels {
		if err := ch.ExchangeDeclarePassive(scheduleLevel(n), amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
			return err
		}
		if _, err := ch.QueueDeclarePassive(scheduleLevel(n), true, false, false, false, nil); err != nil {
			return err
		}
	}
	return nil
}

// refused wraps err in [ErrRefused] when it is the broker's refusal (403
// ACCESS_REFUSED, 406 PRECONDITION_FAILED), as a refused publish is.
func refused(err error) error {
	var ae *amqp.Error
	if errors.As(err, &ae) && (ae.Code == amqp.AccessRefused || ae.Code == amqp.PreconditionFailed) {
		return fmt.Errorf("%w: %w", ErrRefused, err)
	}
	return err
}
