package consumer

import (
	"context"
	"runtime/debug"
)

// Recover turns a panic in the handler into a *PanicError that carries the
// panic value and the stack where it happened. The message then goes the way
// of any failure: Retry runs it again, a breaker counts it, DeadLetter
// dead-letters it when its attempts are spent. The delivery loop recovers
// panics too, but only as the last resort: with Recover innermost, every
// other middleware sees the panic as an error.
func Recover() Middleware {
	return func(next Handler) Handler { return &recoverHandler{next: next} }
}

type recoverHandler struct{ next Handler }

func (h *recoverHandler) Handle(ctx context.Context, m *Message) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &PanicError{Value: v, Stack: debug.Stack()}
		}
	}()
	return h.next.Handle(ctx, m)
}

// Unwrap returns the handler whose panics Recover catches.
func (h *recoverHandler) Unwrap() Handler { return h.next }
