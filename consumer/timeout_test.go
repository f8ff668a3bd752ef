package consumer

import (
	"context"
	"errors"
	"testing"
	"time"
)

func TestTimeoutGivesTheHandlerADeadline(t *testing.T) {
	h := Timeout(5 * time.Millisecond)(HandlerFunc(func(ctx context.Context, _ *Message) error {
		if _, ok := ctx.Deadline(); !ok {
			t.Error("no deadline on the handler's context")
		}
		<-ctx.Done()
		return ctx.Err()
	}))
	err := h.Handle(context.Background(), &Message{})
	var te *TimeoutError
	if !errors.As(err, &te) || !errors.Is(err, context.DeadlineExceeded) || te.Timeout != 5*time.Millisecond {
		t.Fatalf("err = %v, want a TimeoutError matching DeadlineExceeded", err)
	}
}

func TestTimeoutFailsAHandlerThatReturnsNilTooLate(t *testing.T) {
	h := Timeout(time.Millisecond)(HandlerFunc(func(ctx context.Context, _ *Message) error {
		<-ctx.Done()
		return nil
	}))
	if err := h.Handle(context.Background(), &Message{}); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("err = %v, want a timeout failure", err)
	}
}

func TestTimeoutLeavesAFastHandlerAlone(t *testing.T) {
	h := Timeout(time.Hour)(HandlerFunc(func(ctx context.Context, _ *Message) error { return errDown }))
	if err := h.Handle(context.Background(), &Message{}); err != errDown {
		t.Errorf("err = %v, want errDown", err)
	}
}

func TestTimeoutIsNotBlamedForAnOuterCancellation(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	h := Timeout(time.Hour)(HandlerFunc(func(ctx context.Context, _ *Message) error {
		cancel()
		<-ctx.Done()
		return ctx.Err()
	}))
	if err := h.Handle(ctx, &Message{}); err != context.Canceled {
		t.Errorf("err = %v, want context.Canceled unchanged", err)
	}
}

func TestTimeoutZeroSetsNoDeadline(t *testing.T) {
	h := Timeout(0)(HandlerFunc(func(ctx context.Context, _ *Message) error {
		if _, ok := ctx.Deadline(); ok {
			return errors.New("deadline set")
		}
		return nil
	}))
	if err := h.Handle(context.Background(), &Message{}); err != nil {
		t.Error(err)
	}
}
