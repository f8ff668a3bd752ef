package dlqcmd

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/cmd/ferry/internal/cli"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
)

// kafkaPeeker is a Kafka broker's Peek (kafka.Broker.Peek).
type kafkaPeeker interface {
	Peek(ctx context.Context, topic, group string, perPartition int) ([]consumer.Message, error)
}

// Peek returns up to limit messages of destination without consuming them:
//
//   - memory: the queue's messages as they are (memory.Broker.Messages);
//   - Kafka: the records read without a consumer group and without
//     committing (kafka.Broker.Peek), from the start of the log, or from
//     group's committed offsets when group is set;
//   - SQS: received, then made visible again at once (visibility changed
//     back to 0). Receiving with a visibility timeout of 0 instead would
//     leave each message visible while the walk goes on, so the next
//     receive could return the same messages again and never reach the
//     others; hiding them for the walk and giving them back at its end
//     reads each once. A peek that dies halfway leaves them hidden only
//     until the queue's visibility timeout (a long poll cut at its end
//     may hide one a few seconds). Each receive counts in the message's
//     ApproximateReceiveCount. On a FIFO queue SQS hands out no message
//     of a group while an earlier one is hidden beyond those of one
//     receive, so a peek may show only the first messages of each group;
//   - RabbitMQ: delivered to a consumer with a prefetch of limit, then
//     nacked with requeue (each goes back to its place in the queue; a
//     quorum queue counts a delivery in x-delivery-count). A peek that dies
//     halfway loses its channel and the broker requeues them the same way.
//
// wait is how long a receive waits for one more message before the walk
// ends (SQS and RabbitMQ).
func Peek(ctx context.Context, b ferry.Broker, destination, group string, limit int, wait time.Duration) ([]consumer.Message, error) {
	if limit <= 0 {
		return nil, nil
	}
	if mb, ok := ferry.Memory(b); ok {
		msgs := mb.Messages(destination)
		if msgs == nil {
			return nil, fmt.Errorf("memory: no queue %q", destination)
		}
		return msgs[:min(len(msgs), limit)], nil
	}
	if k, ok := b.(kafkaPeeker); ok {
		msgs, err := k.Peek(ctx, destination, group, limit)
		if err != nil {
			return nil, err
		}
		return msgs[:min(len(msgs), limit)], nil
	}
	d, err := cli.Driver(ctx, b, destination, "", limit)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	var (
		got     []driver.Message
		settled bool
	)
	giveBack := func() error {
		if settled || len(got) == 0 {
			return nil
		}
		settled = true
		back := make([]driver.Settlement, len(got))
		for i, m := range got {
			back[i] = driver.Settlement{Handle: m.Handle, Action: driver.Return, NotAttempted: true}
		}
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		if err := d.Settle(sctx, back); err != nil {
			return fmt.Errorf("giving the peeked messages back (they come back after their lease): %w", err)
		}
		return nil
	}
	defer giveBack()
	seen := map[string]bool{}
	for len(got) < limit {
		fctx, cancel := context.WithTimeout(ctx, wait)
		batch, err := d.Fetch(fctx, nil, limit-len(got))
		cancel()
		got = append(got, batch...)
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if err != nil && !errors.Is(err, context.DeadlineExceeded) {
			return nil, err
		}
		fresh := 0
		for _, m := range batch {
			if !seen[m.ID] {
				seen[m.ID] = true
				fresh++
			}
		}
		if fresh == 0 {
			break
		}
	}
	out := make([]consumer.Message, 0, len(got))
	seen = map[string]bool{}
	for _, m := range got {
		if seen[m.ID] {
			continue
		}
		seen[m.ID] = true
		out = append(out, consumer.Message{
			ID: m.ID, Key: m.Key, Body: m.Body, Headers: m.Headers, Source: m.Source,
			Lane: m.Lane, Offset: m.Offset, PublishedAt: m.PublishedAt, Deliveries: m.Deliveries,
		})
	}
	if err := giveBack(); err != nil {
		return out, err
	}
	return out, nil
}
