package rabbit

import (
	"context"
	"errors"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/driverpeek"
)

var _ consumer.Peeker = (*Broker)(nil)

// peekIdle is how long Peek waits for more deliveries than came so far
// before it takes the read as done: the rest are unacked with another
// consumer, or Peek is a standby of a single-active-consumer queue.
const peekIdle = 2 * time.Second

// requeueWait bounds how long Peek waits for the broker to count what it
// handed back as ready again.
const requeueWait = 5 * time.Second

// Peek returns up to max of the ready messages of queue, oldest first
// ([consumer.Peeker]). AMQP has no read without a delivery: Peek consumes
// them without acking, on a driver of its own with a prefetch of the
// whole read, then hands them back (basic.nack with requeue), and waits
// (a little) until the queue counts them again, so that a read right
// after this one finds them. They are delivered again with their delivery
// count one higher on a quorum queue, as after any look at a queue, which
// counts towards a delivery limit. Messages unacked with a consumer are
// not seen, nor anything of a single-active-consumer queue another
// consumer is active on. A max below 1 is a *[consumer.ConfigError]; a queue
// that does not exist is an error wrapping [consumer.ErrSourceNotFound].
func (b *Broker) Peek(ctx context.Context, queue string, max int) ([]consumer.Message, error) {
	if max < 1 {
		return nil, consumer.ConfigErrorf("max", "must be >= 1, got %d", max)
	}
	depth, err := b.depth(ctx, queue)
	if errors.Is(err, driverpeek.ErrNotHandedBack) {
		// The read stands: what was not handed back comes back after its
		// lease. Said, not failed.
		b.log.Warn("rabbit: peek: the messages read were not all handed back; they come back after their lease", "queue", queue, "err", err)
		err = nil
	}
	if err != nil {
		return nil, fmt.Errorf("rabbit: peek %q: %w", queue, err)
	}
	if depth == 0 {
		return nil, nil
	}
	// The prefetch must hold the whole read: nothing is settled until it
	// is all read, and the broker pushes no more than the prefetch of
	// unacked deliveries.
	want := min(depth, max, 65535)
	d, err := b.Driver(ctx, queue, driver.Config{MaxInFlight: want})
	if err != nil {
		return nil, err
	}
	msgs, err := driverpeek.Peek(ctx, d, want, peekIdle)
	if cerr := d.Close(); err == nil && cerr != nil {
		err = cerr
	}
	if err != nil {
		return nil, fmt.Errorf("rabbit: peek %q: %w", queue, err)
	}
	// The broker requeues what was handed back on its own time.
	for wait := time.Now().Add(requeueWait); time.Now().Before(wait) && ctx.Err() == nil; {
		if n, err := b.depth(ctx, queue); err != nil || n >= len(msgs) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	return msgs, nil
}

// depth returns how many ready messages queue holds.
func (b *Broker) depth(ctx context.Context, queue string) (int, error) {
	var n int
	err := b.onChannel(ctx, func(ch *amqp.Channel) error {
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		n = q.Messages
		return err
	})
	if isNotFound(err) {
		return 0, fmt.Errorf("%w: %w", consumer.ErrSourceNotFound, err)
	}
	return n, err
}
