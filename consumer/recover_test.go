package consumer

import (
	"context"
	"errors"
	"strings"
	"testing"
)

func panicsWith(v any) Handler {
	return HandlerFunc(func(context.Context, *Message) error { panic(v) })
}

func TestRecoverTurnsAPanicIntoAPanicErrorWithItsStack(t *testing.T) {
	err := Recover()(panicsWith("boom")).Handle(context.Background(), &Message{})
	var p *PanicError
	if !errors.As(err, &p) || p.Value != "boom" {
		t.Fatalf("err = %v, want a PanicError of boom", err)
	}
	if !strings.Contains(string(p.Stack), "panicsWith") {
		t.Errorf("stack does not show where the panic happened:\n%s", p.Stack)
	}
}

func TestRecoverKeepsAPanickedErrorReachable(t *testing.T) {
	err := Recover()(panicsWith(errDown)).Handle(context.Background(), &Message{})
	if !errors.Is(err, errDown) {
		t.Errorf("err = %v, want it to unwrap to the panic's error", err)
	}
}

func TestRecoverPassesResultsThrough(t *testing.T) {
	h := Recover()(HandlerFunc(func(context.Context, *Message) error { return errDown }))
	if err := h.Handle(context.Background(), &Message{}); err != errDown {
		t.Errorf("err = %v", err)
	}
}
