package consumer

import (
	"context"
	"fmt"
	"time"
)

// TimeoutError is the failure of a handler that returned after its deadline
// (set by Timeout). errors.Is(err, context.DeadlineExceeded) is true for it.
type TimeoutError struct {
	// Timeout is the deadline the handler had.
	Timeout time.Duration
	// Err is what the handler returned, possibly nil.
	Err error
}

func (e *TimeoutError) Error() string {
	if e.Err == nil {
		return fmt.Sprintf("ferry: handler exceeded its %s timeout", e.Timeout)
	}
	return fmt.Sprintf("ferry: handler exceeded its %s timeout: %v", e.Timeout, e.Err)
}

// Unwrap returns the handler's own error.
func (e *TimeoutError) Unwrap() error { return e.Err }

// Is reports whether target is context.DeadlineExceeded.
func (e *TimeoutError) Is(target error) bool { return target == context.DeadlineExceeded }

// Timeout gives each run of the handler a deadline of d through its context.
// A handler that honours its context returns soon after; whatever it returns
// after the deadline, even nil, is a failure (*TimeoutError, which matches
// context.DeadlineExceeded), so the message is returned and runs again: the
// work it did may be incomplete, and at-least-once delivery with an
// idempotent handler makes running it again safe. Timeout does not abandon
// the handler: the message is settled when the handler returns. A deadline
// that ran out on an outer context (not this one) is not Timeout's failure,
// and the handler's result passes through; so does the nil of a DeadLetter
// inside Timeout that dead-lettered the message. d <= 0 sets no deadline.
func Timeout(d time.Duration) Middleware {
	return func(next Handler) Handler {
		if d <= 0 {
			return next
		}
		return &timeoutHandler{d: d, next: next}
	}
}

type timeoutHandler struct {
	d    time.Duration
	next Handler
}

func (h *timeoutHandler) Handle(ctx context.Context, m *Message) error {
	ctx, rec := withRecord(ctx)
	tctx := withLazyDeadline(ctx, h.d)
	rec.runStart = tctx.start
	err := h.next.Handle(tctx, m)
	expired := tctx.expired()
	tctx.release()
	if expired && !(err == nil && rec.deadLettered) {
		return &TimeoutError{Timeout: h.d, Err: err}
	}
	return err
}

// Unwrap returns the handler that runs under the deadline.
func (h *timeoutHandler) Unwrap() Handler { return h.next }
