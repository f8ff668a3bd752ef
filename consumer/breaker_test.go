package consumer

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

func mustBreaker(t *testing.T, opts ...BreakerOption) *Breaker {
	t.Helper()
	b, err := NewBreaker(opts...)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// waitFor polls cond for up to 20s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func TestBreakerOpensAfterFailuresAndHoldsWithoutCallingTheHandler(t *testing.T) {
	var changes []string
	b := mustBreaker(t, BreakerFailures(3), BreakerOpenFor(time.Hour),
		BreakerOnStateChange(func(from, to BreakerState) { changes = append(changes, from.String()+">"+to.String()) }))
	calls := 0
	h := b.Wrap(HandlerFunc(func(context.Context, *Message) error { calls++; return errDown }))
	for i := range 3 {
		if b.State() != BreakerClosed {
			t.Fatalf("state after %d failures = %s, want closed", i, b.State())
		}
		if err := h.Handle(context.Background(), &Message{}); err != errDown {
			t.Fatalf("Handle = %v, want errDown", err)
		}
	}
	if b.State() != BreakerOpen || b.Opened() != 1 {
		t.Fatalf("state = %s, opened = %d; want open, 1", b.State(), b.Opened())
	}
	err := h.Handle(context.Background(), &Message{})
	var held *HeldError
	if !errors.As(err, &held) || !errors.Is(err, ErrBreakerOpen) || !errors.Is(err, ErrHeld) {
		t.Fatalf("Handle while open = %v, want a Hold of ErrBreakerOpen", err)
	}
	if held.Delay <= 50*time.Minute || held.Delay > time.Hour {
		t.Errorf("hold delay = %s, want the open period left (about an hour)", held.Delay)
	}
	if calls != 3 || b.Held() != 1 {
		t.Errorf("calls = %d, held = %d; want 3, 1", calls, b.Held())
	}
	if len(changes) != 1 || changes[0] != "closed>open" {
		t.Errorf("state changes = %v", changes)
	}
}

func TestBreakerIsNotOpenedByPermanentErrors(t *testing.T) {
	b := mustBreaker(t, BreakerFailures(2), BreakerOpenFor(time.Hour))
	h := b.Wrap(HandlerFunc(func(context.Context, *Message) error { return Permanent(errDown) }))
	for range 100 {
		if err := h.Handle(context.Background(), &Message{}); !IsPermanent(err) {
			t.Fatalf("Handle = %v, want the permanent error", err)
		}
	}
	c := HandlerFunc(func(context.Context, *Message) error { return context.Canceled })
	for range 100 {
		_ = b.Wrap(c).Handle(context.Background(), &Message{})
	}
	if b.State() != BreakerClosed {
		t.Errorf("state = %s after permanent and cancelled errors, want closed", b.State())
	}
}

func TestBreakerCountsOnlyTheErrorsItIsTold(t *testing.T) {
	errBadRequest := errors.New("400")
	b := mustBreaker(t, BreakerFailures(2), BreakerOpenFor(time.Hour),
		BreakerCounts(func(err error) bool { return errors.Is(err, errDown) }))
	bad := b.Wrap(HandlerFunc(func(context.Context, *Message) error { return errBadRequest }))
	for range 10 {
		_ = bad.Handle(context.Background(), &Message{})
	}
	if b.State() != BreakerClosed {
		t.Fatalf("state = %s after uncounted errors, want closed", b.State())
	}
	down := b.Wrap(HandlerFunc(func(context.Context, *Message) error { return errDown }))
	_ = down.Handle(context.Background(), &Message{})
	_ = down.Handle(context.Background(), &Message{})
	if b.State() != BreakerOpen {
		t.Errorf("state = %s after counted errors, want open", b.State())
	}
}

func TestBreakerTrialClosesItOrOpensItAgain(t *testing.T) {
	b := mustBreaker(t, BreakerFailures(1), BreakerOpenFor(20*time.Millisecond))
	fail := true
	calls := 0
	h := b.Wrap(HandlerFunc(func(context.Context, *Message) error {
		calls++
		if fail {
			return errDown
		}
		return nil
	}))
	_ = h.Handle(context.Background(), &Message{})
	waitFor(t, "half-open", func() bool { return b.State() == BreakerHalfOpen })
	if err := h.Handle(context.Background(), &Message{}); err != errDown {
		t.Fatalf("failed trial = %v", err)
	}
	if b.State() != BreakerOpen || b.Opened() != 2 {
		t.Fatalf("state = %s, opened %d after a failed trial; want open, 2", b.State(), b.Opened())
	}
	waitFor(t, "half-open again", func() bool { return b.State() == BreakerHalfOpen })
	fail = false
	if err := h.Handle(context.Background(), &Message{}); err != nil {
		t.Fatalf("good trial = %v", err)
	}
	if b.State() != BreakerClosed || calls != 3 {
		t.Errorf("state = %s, calls %d after a good trial; want closed, 3", b.State(), calls)
	}
}

func TestBreakerHalfOpenLetsOnlyTheTrialsThrough(t *testing.T) {
	b := mustBreaker(t, BreakerFailures(1), BreakerOpenFor(20*time.Millisecond), BreakerTrials(1))
	_ = b.Wrap(HandlerFunc(func(context.Context, *Message) error { return errDown })).Handle(context.Background(), &Message{})
	waitFor(t, "half-open", func() bool { return b.State() == BreakerHalfOpen })

	inTrial, release := make(chan struct{}), make(chan struct{})
	trial := b.Wrap(HandlerFunc(func(context.Context, *Message) error { close(inTrial); <-release; return nil }))
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = trial.Handle(context.Background(), &Message{}) }()
	<-inTrial
	called := false
	err := b.Wrap(HandlerFunc(func(context.Context, *Message) error { called = true; return nil })).Handle(context.Background(), &Message{})
	var held *HeldError
	if !errors.As(err, &held) || called {
		t.Errorf("second call in half-open = %v (handler called %v), want held", err, called)
	}
	close(release)
	wg.Wait()
	if b.State() != BreakerClosed {
		t.Errorf("state = %s after the trial succeeded, want closed", b.State())
	}
}

func TestBreakerPassesHandlerErrorsThatLookLikeItsOwn(t *testing.T) {
	// A handler that returns another breaker's hold is not held by this one.
	b := mustBreaker(t)
	inner := Hold(ErrBreakerOpen, time.Second)
	err := b.Wrap(HandlerFunc(func(context.Context, *Message) error { return inner })).Handle(context.Background(), &Message{})
	if err != inner || b.Held() != 0 {
		t.Errorf("err = %v, held = %d; want the inner hold unchanged and 0", err, b.Held())
	}
}

func TestNewBreakerRejectsBadConfigNamingTheField(t *testing.T) {
	cases := map[string]BreakerOption{
		"Breaker.Name":     BreakerName(""),
		"Breaker.Failures": BreakerFailures(0),
		"Breaker.OpenFor":  BreakerOpenFor(0),
		"Breaker.Trials":   BreakerTrials(0),
		"Breaker.Counts":   BreakerCounts(nil),
	}
	for field, opt := range cases {
		_, err := NewBreaker(opt)
		var ce *ConfigError
		if !errors.As(err, &ce) || ce.Field != field {
			t.Errorf("%s: err = %v, want a ConfigError naming it", field, err)
		}
	}
}

func TestBreakerStateString(t *testing.T) {
	for s, want := range map[BreakerState]string{BreakerClosed: "closed", BreakerHalfOpen: "half-open", BreakerOpen: "open", 9: "BreakerState(9)"} {
		if s.String() != want {
			t.Errorf("%d.String() = %q, want %q", s, s.String(), want)
		}
	}
}

// A dependency that has gone down fails new calls fast while its last slow
// calls still succeed: the successes break every run of consecutive
// failures, and the failure ratio opens the breaker all the same.
func TestBreakerOpensOnFailureRatioWhenSlowSuccessesInterleave(t *testing.T) {
	b, err := NewBreaker(BreakerFailures(5), BreakerOpenFor(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	fail := b.Wrap(HandlerFunc(func(context.Context, *Message) error { return errors.New("503") }))
	ok := b.Wrap(HandlerFunc(func(context.Context, *Message) error { return nil }))
	for i := 0; i < 4; i++ {
		_ = fail.Handle(context.Background(), &Message{})
		_ = fail.Handle(context.Background(), &Message{})
		if b.State() == BreakerOpen {
			return
		}
		_ = ok.Handle(context.Background(), &Message{}) // a slow call from before the outage returns
	}
	t.Fatalf("breaker %s after 8 failures and 4 successes", b.State())
}

func TestBreakerStaysClosedForARareFailureAmongSuccesses(t *testing.T) {
	b, err := NewBreaker(BreakerFailures(5))
	if err != nil {
		t.Fatal(err)
	}
	fail := b.Wrap(HandlerFunc(func(context.Context, *Message) error { return errors.New("503") }))
	ok := b.Wrap(HandlerFunc(func(context.Context, *Message) error { return nil }))
	for i := 0; i < 10; i++ {
		_ = fail.Handle(context.Background(), &Message{})
		for j := 0; j < 3; j++ {
			_ = ok.Handle(context.Background(), &Message{})
		}
	}
	if b.State() != BreakerClosed {
		t.Fatalf("breaker %s with 10 failures among 40 calls (25%%)", b.State())
	}
	if _, err := NewBreaker(BreakerFailureRatio(0)); err == nil {
		t.Fatal("a failure ratio of 0 was accepted")
	}
	if _, err := NewBreaker(BreakerWindow(0)); err == nil {
		t.Fatal("a window of 0 was accepted")
	}
}
