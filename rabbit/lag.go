package rabbit

import (
	"context"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer/driver"
)

// lagTimeout bounds Lag when its context has no deadline.
const lagTimeout = 10 * time.Second

// Lag reports the queue's ready messages (Messages, from a passive declare)
// and this driver's deliveries not yet settled (InFlight): those the broker
// pushed ahead that Fetch has not taken yet (the prefetch) and those the
// loop holds (running, queued behind their key, waiting for their
// settlement). Messages plus InFlight, the loop's Health.Lag, is what is
// not yet done: the queue's ready and unacked messages when this is its
// only consumer. The broker's AMQP interface tells neither the other
// consumers' unacked count nor the age of the oldest message.
func (d *queueDriver) Lag(ctx context.Context) (driver.Lag, error) {
	ready, _, err := d.b.queueDepth(ctx, d.queue)
	if err != nil {
		return driver.Lag{}, err
	}
	l := driver.Lag{Messages: int64(ready), InFlight: 0}
	d.mu.Lock()
	s := d.cur
	d.mu.Unlock()
	if s != nil {
		s.mu.Lock()
		l.InFlight = int64(s.open)
		s.mu.Unlock()
		l.InFlight += int64(len(s.deliveries))
	}
	return l, nil
}

// queueDepth returns the ready messages and consumers of queue, asked on
// the consuming connection (an alarm blocks only publishing connections).
// Bounded by ctx (or lagTimeout when ctx has no deadline): the channel's
// methods take no context.
func (b *Broker) queueDepth(ctx context.Context, queue string) (int, int, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, lagTimeout)
		defer cancel()
	}
	conn, err := b.consConn.get(ctx)
	if err != nil {
		return 0, 0, err
	}
	var q amqp.Queue
	err = withContext(ctx, func() error {
		ch, err := conn.Channel()
		if err != nil {
			return err
		}
		defer closeChannel(ch)
		q, err = ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		return err
	})
	if err != nil {
		return 0, 0, fmt.Errorf("rabbit: depth of %q: %w", queue, err)
	}
	return q.Messages, q.Consumers, nil
}
