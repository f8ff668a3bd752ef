package consumer

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// ErrPermanent matches, through errors.Is, every error made by Permanent.
var ErrPermanent = errors.New("permanent error")

// ErrRetryAfter matches, through errors.Is, every error made by RetryAfter.
var ErrRetryAfter = errors.New("retry after a delay")

// ErrHeld matches, through errors.Is, every error made by Hold.
var ErrHeld = errors.New("message held")

// ErrDeferred matches, through errors.Is, every error made by Defer.
var ErrDeferred = errors.New("message deferred")

// permanentError marks a failure that no retry can fix, such as a body that
// does not decode. The message goes to the dead-letter destination at once.
type permanentError struct{ err error }

// Permanent marks err as permanent: the message is never retried and goes to
// the dead-letter destination with err as its reason. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	var p *permanentError
	if errors.As(err, &p) {
		return err
	}
	return &permanentError{err: err}
}

func (e *permanentError) Error() string { return "permanent: " + e.err.Error() }

// Unwrap returns the marked error.
func (e *permanentError) Unwrap() error { return e.err }

// Is reports whether target is ErrPermanent.
func (e *permanentError) Is(target error) bool { return target == ErrPermanent }

// IsPermanent reports whether err, or an error it wraps, is permanent.
func IsPermanent(err error) bool { return errors.Is(err, ErrPermanent) }

// RetryAfterError asks for the message to be delivered again no sooner than
// Delay from now.
type RetryAfterError struct {
	Err   error
	Delay time.Duration
}

// RetryAfter returns the message to the broker to be delivered again no
// sooner than d from now: SQS changes its visibility, RabbitMQ routes it
// through a delay queue, Kafka runs it again in place after d (holding its
// partition). RetryAfter(nil, d) is nil.
func RetryAfter(err error, d time.Duration) error {
	if err == nil {
		return nil
	}
	if d < 0 {
		d = 0
	}
	return &RetryAfterError{Err: err, Delay: d}
}

func (e *RetryAfterError) Error() string {
	return "retry after " + e.Delay.String() + ": " + e.Err.Error()
}

// Unwrap returns the underlying error.
func (e *RetryAfterError) Unwrap() error { return e.Err }

// Is reports whether target is ErrRetryAfter.
func (e *RetryAfterError) Is(target error) bool { return target == ErrRetryAfter }

// IsRetryAfter reports whether err, or an error it wraps, was made by
// RetryAfter. errors.As with a *RetryAfterError gives its Delay.
func IsRetryAfter(err error) bool { return errors.Is(err, ErrRetryAfter) }

// DeferredError says the handler did not run because the message waits on
// something else; see Defer.
type DeferredError struct {
	Err   error
	Delay time.Duration
}

// Defer says the handler did not run: the message waits on something else,
// such as a duplicate of it that another worker is handling right now. The
// delivery loop keeps the message (extending its lease) and runs it again
// no sooner than d from now, without returning it to the broker, so a broker
// that counts deliveries (SQS, RabbitMQ quorum queues) counts no attempt
// either; fetching goes on. DeadLetter spends none of the message's
// attempts on it, Retry does not retry it in process, and a Breaker does not
// count it. Defer(nil, d) is nil.
func Defer(err error, d time.Duration) error {
	if err == nil {
		return nil
	}
	if d < 0 {
		d = 0
	}
	return &DeferredError{Err: err, Delay: d}
}

func (e *DeferredError) Error() string {
	return "deferred for " + e.Delay.String() + ": " + e.Err.Error()
}

// Unwrap returns the underlying error.
func (e *DeferredError) Unwrap() error { return e.Err }

// Is reports whether target is ErrDeferred.
func (e *DeferredError) Is(target error) bool { return target == ErrDeferred }

// IsDeferred reports whether err, or an error it wraps, was made by Defer.
func IsDeferred(err error) bool { return errors.Is(err, ErrDeferred) }

// HeldError says the handler was not run at all, because something it
// depends on is known to be down (an open circuit breaker). The delivery loop
// keeps the message, keeps its lease, does not count an attempt, pauses
// fetching for Delay and then runs the message again.
type HeldError struct {
	Err   error
	Delay time.Duration
}

// Hold tells the delivery loop that the message was not attempted: keep it,
// pause fetching for d, then run it again. A held message never counts as an
// attempt and never reaches the dead-letter destination. Hold(nil, d) is nil.
func Hold(err error, d time.Duration) error {
	if err == nil {
		return nil
	}
	if d <= 0 {
		d = time.Millisecond
	}
	return &HeldError{Err: err, Delay: d}
}

func (e *HeldError) Error() string { return "held for " + e.Delay.String() + ": " + e.Err.Error() }

// Unwrap returns the underlying error.
func (e *HeldError) Unwrap() error { return e.Err }

// Is reports whether target is ErrHeld.
func (e *HeldError) Is(target error) bool { return target == ErrHeld }

// IsHeld reports whether err, or an error it wraps, was made by Hold.
func IsHeld(err error) bool { return errors.Is(err, ErrHeld) }

// PanicError is what a handler's panic becomes: the message is returned for
// redelivery like after any other failure, and the process carries on.
type PanicError struct {
	Value any
	Stack []byte
}

func (e *PanicError) Error() string { return fmt.Sprintf("handler panicked: %v", e.Value) }

// Unwrap returns the panic value when it is an error.
func (e *PanicError) Unwrap() error {
	if err, ok := e.Value.(error); ok {
		return err
	}
	return nil
}

// The reasons a Publisher refuses a message's [Message.NotBefore], wrapped
// in its *[PublishError].
var (
	// ErrDelayNotSupported: the broker cannot hold a message until a later
	// time (Kafka has no delay; an SQS FIFO queue delays only as a whole; a
	// RabbitMQ exchange would lose its routing through the delay levels).
	ErrDelayNotSupported = errors.New("delayed publish not supported")

	// ErrDelayTooLong: the message's NotBefore is further away than the
	// broker can hold a message (15 minutes on SQS, rabbit.MaxDelay on
	// RabbitMQ).
	ErrDelayTooLong = errors.New("delay too long")
)

// PublishError reports the messages of one Publish call that the broker did
// not take. The other messages of the call were published.
type PublishError struct {
	// Failed lists each failed message by its index in the Publish call.
	Failed []FailedMessage
}

// FailedMessage is one message a Publish call could not deliver.
type FailedMessage struct {
	Index int
	Err   error
}

func (e *PublishError) Error() string {
	var b strings.Builder
	b.WriteString("publish: ")
	b.WriteString(strconv.Itoa(len(e.Failed)))
	b.WriteString(" message(s) failed")
	for i, f := range e.Failed {
		if i == 3 {
			b.WriteString("; ...")
			break
		}
		b.WriteString("; #")
		b.WriteString(strconv.Itoa(f.Index))
		b.WriteString(": ")
		b.WriteString(f.Err.Error())
	}
	return b.String()
}

// Unwrap returns the errors of the failed messages, so errors.Is and
// errors.As see each of them.
func (e *PublishError) Unwrap() []error {
	errs := make([]error, len(e.Failed))
	for i, f := range e.Failed {
		errs[i] = f.Err
	}
	return errs
}
