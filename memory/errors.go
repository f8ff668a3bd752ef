package memory

import (
	"errors"
)

// Errors returned by the broker. Match them with errors.Is.
var (
	// ErrClosed is returned by every call on a closed Broker or driver. A
	// Fetch wraps it with driver.Fatal, so a consumer.Loop's Run ends.
	ErrClosed = errors.New("memory: broker closed")

	// ErrStaleHandle is returned by Settle and Extend for a delivery whose
	// lease ran out (the message is, or will be, delivered again under a new
	// handle) or that was already settled. The rest of the batch is still
	// applied.
	ErrStaleHandle = errors.New("memory: stale delivery handle")

	// ErrInvalidHandle is returned by Settle and Extend for a handle that did
	// not come from this queue's Fetch.
	ErrInvalidHandle = errors.New("memory: invalid delivery handle")

	// ErrQueueNotFound is returned for a queue that does not exist when the
	// broker does not create queues on first use (see WithAutoCreate).
	ErrQueueNotFound = errors.New("memory: queue not found")

	// ErrQueueExists is returned by CreateQueue for a name already taken by a
	// queue with a different configuration.
	ErrQueueExists = errors.New("memory: queue exists with a different configuration")

	// ErrInvalidMessage is the reason, inside a *consumer.PublishError, for a
	// message a queue cannot take (a FIFO message without a Key).
	ErrInvalidMessage = errors.New("memory: invalid message")

	// ErrNotSent is the reason, inside a *consumer.PublishError, for a
	// message not published because an earlier message of its key in the
	// same call was refused: publishing it would let it overtake that one.
	ErrNotSent = errors.New("memory: not sent: an earlier message of its key failed")
)
