package ferrytest

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ferrymq/ferry/consumer"
)

// ErrNotDeadLetter is wrapped by the error of [ParseDeadLetter] for a message
// that carries no dead-letter story.
var ErrNotDeadLetter = errors.New("ferrytest: not a dead-lettered message")

// DeadLetter is a message read from a dead-letter destination, with the
// story [consumer.DeadLetter] wrote in its ferry-dlq-* headers.
type DeadLetter struct {
	// Message is the message as it is in the dead-letter queue: the
	// original body and key, the original headers and the ferry-dlq-*
	// ones.
	Message consumer.Message
	// Source is the topic or queue the message came from.
	Source string
	// MessageID is the broker's id of the original message.
	MessageID string
	// Key is the original message's key.
	Key string
	// Lane is the original lane (Kafka partition, SQS FIFO group), if any.
	Lane string
	// Offset is the original offset in its lane, -1 where there is none.
	Offset int64
	// Reason is consumer.DLQReasonPermanent or consumer.DLQReasonMaxAttempts.
	Reason string
	// Attempts is how many times the handler ran.
	Attempts int
	// Deliveries is how many times the broker delivered the message.
	Deliveries int
	// UnseenDeliveries is how many deliveries were counted as runs
	// without being seen (0 when every run was counted).
	UnseenDeliveries int
	// Error is the text of the last error.
	Error string
	// ErrorKind is "permanent", "panic", "timeout" or "error".
	ErrorKind string
	// ErrorType is the Go type of the innermost error of the last error.
	ErrorType string
	// FirstFailure and LastFailure are the times of the first and last
	// failure.
	FirstFailure, LastFailure time.Time
	// PublishedAt is when the broker took the original message, where it
	// says so.
	PublishedAt time.Time
	// Consumer is the name of the consumer that gave up.
	Consumer string
	// Host is the host name of the process that gave up.
	Host string
}

// ParseDeadLetter reads the story of a dead-lettered message from its
// headers ([consumer.HeaderDLQSource] and the others). It fails, wrapping
// [ErrNotDeadLetter], when the message has no [consumer.HeaderDLQReason], and
// names the header when one holds a malformed number or time.
func ParseDeadLetter(m consumer.Message) (DeadLetter, error) {
	h := m.Headers
	d := DeadLetter{
		Message:   m,
		Source:    h[consumer.HeaderDLQSource],
		MessageID: h[consumer.HeaderDLQMessageID],
		Key:       h[consumer.HeaderDLQKey],
		Lane:      h[consumer.HeaderDLQLane],
		Offset:    -1,
		Reason:    h[consumer.HeaderDLQReason],
		Error:     h[consumer.HeaderDLQError],
		ErrorKind: h[consumer.HeaderDLQErrorKind],
		ErrorType: h[consumer.HeaderDLQErrorType],
		Consumer:  h[consumer.HeaderDLQConsumer],
		Host:      h[consumer.HeaderDLQHost],
	}
	if d.Reason == "" {
		return d, fmt.Errorf("%w: message %q has no %s header", ErrNotDeadLetter, m.ID, consumer.HeaderDLQReason)
	}
	var errs []error
	num := func(name string, dst *int) {
		if v, ok := h[name]; ok {
			n, err := strconv.Atoi(v)
			if err != nil {
				errs = append(errs, fmt.Errorf("ferrytest: header %s of message %q: %w", name, m.ID, err))
			}
			*dst = n
		}
	}
	at := func(name string, dst *time.Time) {
		if v, ok := h[name]; ok {
			t, err := time.Parse(time.RFC3339Nano, v)
			if err != nil {
				errs = append(errs, fmt.Errorf("ferrytest: header %s of message %q: %w", name, m.ID, err))
			}
			*dst = t
		}
	}
	if v, ok := h[consumer.HeaderDLQOffset]; ok {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			errs = append(errs, fmt.Errorf("ferrytest: header %s of message %q: %w", consumer.HeaderDLQOffset, m.ID, err))
		}
		d.Offset = n
	}
	num(consumer.HeaderDLQAttempts, &d.Attempts)
	num(consumer.HeaderDLQDeliveries, &d.Deliveries)
	num(consumer.HeaderDLQUnseenDeliveries, &d.UnseenDeliveries)
	at(consumer.HeaderDLQFirstFailure, &d.FirstFailure)
	at(consumer.HeaderDLQLastFailure, &d.LastFailure)
	at(consumer.HeaderDLQPublishedAt, &d.PublishedAt)
	return d, errors.Join(errs...)
}

// Peek returns the messages the queue holds, oldest first (a Kafka topic's
// by record timestamp across partitions), and leaves them there, through
// the broker's [consumer.Peeker]: a Kafka topic is read in no consumer group, from
// each partition's start to its end offset as the call began (when the
// partitions not yet read stop moving for 5 s, it fails with
// [kafka.ErrPeekShort], except on a compacted topic, where what came is
// returned); an SQS or RabbitMQ queue's messages are received and handed
// back at once, which counts as one more delivery of each
// (ApproximateReceiveCount, x-delivery-count), as any look at such a queue
// does; the memory broker's are copied. Messages a consumer holds at the time are not in it (except
// on the memory broker). When ctx has no deadline, [DefaultTimeout] bounds it.
func (q *Queue) Peek(ctx context.Context) ([]consumer.Message, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, DefaultTimeout)
		defer cancel()
	}
	ms, err := q.b.admin.peek(ctx, q)
	if err != nil {
		return nil, fmt.Errorf("ferrytest: read %s %q: %w", q.b.Kind, q.Name, err)
	}
	return ms, nil
}

// DeadLetters reads the queue with Peek, as a dead-letter destination, and
// returns each message with its story. The messages stay in the queue, to
// be read again or redriven. A message without a story is an error wrapping
// ErrNotDeadLetter.
func (q *Queue) DeadLetters(ctx context.Context) ([]DeadLetter, error) {
	ms, err := q.Peek(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]DeadLetter, 0, len(ms))
	var errs []error
	for _, m := range ms {
		d, err := ParseDeadLetter(m)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		out = append(out, d)
	}
	return out, errors.Join(errs...)
}
