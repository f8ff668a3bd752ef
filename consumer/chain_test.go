package consumer

import (
	"context"
	"errors"
	"testing"
	"time"
)

// A handler that would panic on every delivery is refused where it is
// given: Run returns a *ConfigError and runs nothing.
func TestRunRefusesNilHandlersAnywhereInTheChain(t *testing.T) {
	retry, err := NewRetry()
	if err != nil {
		t.Fatal(err)
	}
	var nilFunc HandlerFunc
	var nilJSON func(context.Context, struct{}, *Message) error
	for name, h := range map[string]Handler{
		"nil":                     nil,
		"nil HandlerFunc":         nilFunc,
		"JSON of nil":             JSON(nilJSON),
		"Retry around nil":        retry.Wrap(nil),
		"Recover around nil func": Recover()(nilFunc),
		"Timeout around JSON nil": Timeout(time.Second)(JSON(nilJSON)),
	} {
		drv := newScriptLog(true)
		drv.add("", 1)
		l, err := New(drv)
		if err != nil {
			t.Fatal(err)
		}
		err = l.Run(context.Background(), h)
		var ce *ConfigError
		if !errors.As(err, &ce) || ce.Field != "Handler" {
			t.Errorf("%s: Run = %v, want a *ConfigError for Handler", name, err)
		}
		if l.Stats().Fetched != 0 {
			t.Errorf("%s: fetched %d before refusing", name, l.Stats().Fetched)
		}
	}
}

// A Stack literal with only some parts wraps with those parts.
func TestStackLiteralWithNilPartsWrapsWithTheOthers(t *testing.T) {
	retry, err := NewRetry(RetryAttempts(2), RetryInitial(time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	runs := 0
	h := (&Stack{Retry: retry}).Wrap(HandlerFunc(func(context.Context, *Message) error {
		runs++
		return errors.New("down")
	}))
	var ra *RetryAfterError
	if err := h.Handle(context.Background(), &Message{Attempt: 1}); !errors.As(err, &ra) || runs != 2 {
		t.Fatalf("Handle = %v after %d runs, want Retry's give-back after 2", err, runs)
	}
	if err := (&Stack{}).Wrap(HandlerFunc(func(context.Context, *Message) error { return nil })).Handle(context.Background(), &Message{}); err != nil {
		t.Fatal(err)
	}
}

// TestInspectFindsTheChainsMiddleware: Inspect returns the breakers,
// retries and dead letters of a chain, outermost first, and refuses what
// Run refuses.
func TestInspectFindsTheChainsMiddleware(t *testing.T) {
	pub := &recordingPublisher{}
	stack, err := Standard(pub, "orders-dlq")
	if err != nil {
		t.Fatal(err)
	}
	p, err := Inspect(stack.Wrap(HandlerFunc(func(context.Context, *Message) error { return nil })))
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Breakers) != 1 || p.Breakers[0] != stack.Breaker || len(p.Retries) != 1 || p.Retries[0] != stack.Retry ||
		len(p.DeadLetters) != 1 || p.DeadLetters[0] != stack.DeadLetter {
		t.Errorf("Inspect(Standard) = %+v; want its Breaker, Retry and DeadLetter", p)
	}
	if _, err := Inspect(stack.Wrap(nil)); !errors.Is(err, ErrInvalidConfig) {
		t.Errorf("Inspect of a chain around nil: %v, want a configuration error", err)
	}
}
