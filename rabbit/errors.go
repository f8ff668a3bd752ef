package rabbit

import (
	"errors"
)

// Errors of the package. Match them with errors.Is; an error the broker sent
// (a channel or connection closed by it) is also an *amqp091.Error, reached
// with errors.As.
var (
	// ErrClosed is returned by every call on a closed Broker or Driver. A
	// Fetch wraps it with driver.Fatal, so a consumer.Loop's Run ends.
	ErrClosed = errors.New("rabbit: broker closed")

	// ErrUnroutable is the reason for a message the broker returned because
	// no queue was bound to take it (published mandatory).
	ErrUnroutable = errors.New("rabbit: message unroutable")

	// ErrNacked is the reason for a message the broker refused (a negative
	// publisher confirm).
	ErrNacked = errors.New("rabbit: message nacked by the broker")

	// ErrBlocked is returned, with the context's error, by a Publish whose
	// context ended while the broker blocked the connection (a memory or
	// disk alarm).
	ErrBlocked = errors.New("rabbit: broker blocked the connection")

	// ErrNotConfirmed is the reason for a message whose channel closed before
	// the broker confirmed it, the broker not having refused it (that is
	// ErrRefused): the connection was lost or closed. It may or may not have
	// been taken.
	ErrNotConfirmed = errors.New("rabbit: channel closed before the publish was confirmed")

	// ErrEarlierFailed is the reason for a message not published because an
	// earlier message of the same key in the same call failed.
	ErrEarlierFailed = errors.New("rabbit: not published: an earlier message of the same key failed")

	// ErrStaleDelivery is returned by Settle for a delivery of a channel that
	// closed: the broker requeued it, and it is not acked on another channel.
	ErrStaleDelivery = errors.New("rabbit: delivery of a closed channel")

	// ErrInvalidHandle is returned by Settle for a handle that did not come
	// from this driver.
	ErrInvalidHandle = errors.New("rabbit: invalid delivery handle")

	// ErrConsumerCancelled is reported by Fetch when the broker cancelled the
	// consumer (the queue was deleted); consuming resumes once the queue is
	// declared again.
	ErrConsumerCancelled = errors.New("rabbit: consumer cancelled by the broker")
)
