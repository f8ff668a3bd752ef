package dlqcmd

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/cmd/ferry/internal/cli"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/driverpeek"
	"github.com/ferrymq/ferry/kafka"
)

// PeekOptions says what Peek reads.
type PeekOptions struct {
	// Limit is the most messages returned (at least 1).
	Limit int
	// Wait is how long a receive waits for one more message before the
	// walk ends (SQS and RabbitMQ; default 2s).
	Wait time.Duration
	// Group is, on Kafka, the consumer group past whose committed offsets
	// the read begins. When empty, and FromStart is not set, it is
	// DefaultGroup when that group committed on the topic: what a redrive
	// would still move.
	Group string
	// FromStart reads a Kafka topic from the log start.
	FromStart bool
}

// Peeked is what Peek read.
type Peeked struct {
	Messages []consumer.Message
	// Total is how many messages the destination holds (on Kafka: past
	// the offsets the read began at), as the broker counts them.
	Total Count
	// Group is, on Kafka, the group past whose committed offsets the read
	// began ("" for the log start).
	Group string
	// From says, on Kafka, where the read began and why, partition by
	// partition; "" elsewhere.
	From string
}

// Peek returns up to o.Limit messages of destination without consuming
// them, and how many it holds:
//
//   - memory: the queue's messages as they are (memory.Broker.Messages);
//   - Kafka: the records read without a consumer group and without
//     committing (kafka.Broker.PeekGroup), past the committed offsets of
//     o.Group (by default the redrive's, when it has any), or from the log
//     start; counted by offsets;
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
//     receive, so a peek may show only the first messages of each group.
//     The count is SQS's approximate one;
//   - RabbitMQ: delivered to a consumer with a prefetch of the limit,
//     then nacked with requeue (each goes back to its place in the queue;
//     a quorum queue counts a delivery in x-delivery-count). A peek that
//     dies halfway loses its channel and the broker requeues them the same
//     way. The count is of the ready messages before the walk: another
//     consumer's unacked ones are not in it.
func Peek(ctx context.Context, b ferry.Broker, destination string, o PeekOptions) (Peeked, error) {
	limit, wait := o.Limit, o.Wait
	if limit <= 0 {
		return Peeked{}, nil
	}
	if wait <= 0 {
		wait = 2 * time.Second
	}
	if mb, ok := ferry.Memory(b); ok {
		msgs := mb.Messages(destination)
		if msgs == nil {
			return Peeked{}, fmt.Errorf("memory: no queue %q", destination)
		}
		return Peeked{Messages: msgs[:min(len(msgs), limit)], Total: Count{N: int64(len(msgs))}}, nil
	}
	if k, ok := b.(*kafka.Broker); ok {
		return peekKafka(ctx, k, destination, o)
	}
	kind := cli.Kind(b)
	d, err := cli.Driver(ctx, b, destination, "", limit)
	if err != nil {
		return Peeked{}, err
	}
	defer d.Close()
	// Counted before the walk takes any: on RabbitMQ what the walk holds
	// is not ready, and what it gives back may take a moment to count.
	total := unknown(fmt.Sprintf("a %s broker does not count its messages", kind))
	if lr, ok := d.(driver.LagReporter); ok {
		lctx, cancel := context.WithTimeout(ctx, opTimeout)
		l, err := lr.Lag(lctx)
		cancel()
		if err != nil {
			return Peeked{}, fmt.Errorf("counting the messages: %w", err)
		}
		total = Count{N: l.Messages + max(l.InFlight, 0), Approx: l.Approximate}
	}
	msgs, err := driverpeek.Peek(ctx, d, limit, wait)
	if errors.Is(err, driverpeek.ErrNotHandedBack) {
		// What was read stands; what was not handed back comes back after
		// its lease. A WARN line on stderr says so.
		slog.Warn("ferry dlq peek: the messages read were not all handed back; they come back after their lease", "destination", destination, "err", err)
		err = nil
	}
	if err != nil {
		return Peeked{}, err
	}
	return Peeked{Messages: msgs, Total: total}, nil
}

// peekKafka is Peek on Kafka.
func peekKafka(ctx context.Context, k *kafka.Broker, topic string, o PeekOptions) (Peeked, error) {
	group, why := o.Group, "past the committed offsets of group "+strconv.Quote(o.Group)
	if group == "" && !o.FromStart {
		has, err := hasCommits(ctx, k.Admin(), topic, DefaultGroup)
		if err != nil {
			return Peeked{}, fmt.Errorf("committed offsets of group %q: %w", DefaultGroup, err)
		}
		if has {
			group = DefaultGroup
			why = fmt.Sprintf("past the committed offsets of group %q, the redrive's: what a redrive would still move (--from-start reads the whole log)", DefaultGroup)
		}
	}
	if group == "" {
		why = "from the log start"
	}
	ranges, err := kafkaRanges(ctx, k.Admin(), topic, group)
	if err != nil {
		return Peeked{}, fmt.Errorf("offsets: %w", err)
	}
	msgs, err := k.PeekGroup(ctx, topic, group, o.Limit)
	if err != nil {
		return Peeked{}, err
	}
	var n int64
	parts := make([]string, 0, len(ranges))
	for _, r := range ranges {
		n += r.end - r.from
		parts = append(parts, fmt.Sprintf("%d: %d..%d", r.partition, r.from, r.end))
	}
	const shownParts = 8
	if len(parts) > shownParts {
		parts = append(parts[:shownParts], fmt.Sprintf("and %d more", len(parts)-shownParts))
	}
	from := fmt.Sprintf("reading %s %s; offsets per partition (from..end): %s", topic, why, strings.Join(parts, ", "))
	return Peeked{Messages: msgs[:min(len(msgs), o.Limit)], Total: Count{N: n}, Group: group, From: from}, nil
}
