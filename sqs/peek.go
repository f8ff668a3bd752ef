package sqs

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/driverpeek"
)

var _ consumer.Peeker = (*Broker)(nil)

// peekIdle is how long Peek waits for more messages than came so far
// before it takes the read as done: the rest are in flight with another
// consumer, or the queue's count was high (it is approximate).
const peekIdle = 2 * time.Second

// Peek returns up to max of the messages queue (a name or a queue URL)
// holds visible, oldest first as SQS hands them out ([consumer.Peeker]). SQS
// has no read without a lease: Peek receives them, then makes them visible
// again at once (visibility 0). So each peek counts as a receive
// (ApproximateReceiveCount, and towards a redrive policy's
// maxReceiveCount), as any look at an SQS queue does, and messages in
// flight with a consumer are not seen. A max below 1 is a
// *[consumer.ConfigError]; a queue that does not exist is an error wrapping
// [consumer.ErrSourceNotFound].
func (b *Broker) Peek(ctx context.Context, queue string, max int) ([]consumer.Message, error) {
	if max < 1 {
		return nil, consumer.ConfigErrorf("max", "must be >= 1, got %d", max)
	}
	if b.isClosed() {
		return nil, fmt.Errorf("sqs: peek %q: %w", queue, ErrClosed)
	}
	q, err := b.lookUp(ctx, queue)
	if err != nil {
		return nil, err
	}
	last := &lastAttempt{}
	actx := context.WithValue(ctx, lastAttemptKey{}, last)
	attrs, err := b.client.GetQueueAttributes(actx, &awssqs.GetQueueAttributesInput{
		QueueUrl: aws.String(q.url), AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameApproximateNumberOfMessages},
	}, recordAttempts)
	if err != nil {
		return nil, b.callErr("GetQueueAttributes", q.name, err, last.get())
	}
	depth, err := strconv.Atoi(attrs.Attributes[string(types.QueueAttributeNameApproximateNumberOfMessages)])
	if err != nil {
		return nil, fmt.Errorf("sqs: peek %q: the queue's depth: %w", q.name, err)
	}
	if depth == 0 {
		return nil, nil
	}
	d, err := b.Driver(ctx, queue, driver.Config{})
	if err != nil {
		return nil, err
	}
	msgs, err := driverpeek.Peek(ctx, d, min(depth, max), peekIdle)
	if cerr := d.Close(); err == nil && cerr != nil {
		err = cerr
	}
	if errors.Is(err, driverpeek.ErrNotHandedBack) {
		// The read stands: what was not handed back comes back after its
		// lease. Said, not failed.
		b.cfg.logger.Warn("sqs: peek: the messages read were not all handed back; they come back after their lease", "queue", q.name, "err", err)
		err = nil
	}
	if err != nil {
		return nil, fmt.Errorf("sqs: peek %q: %w", q.name, err)
	}
	return msgs, nil
}
