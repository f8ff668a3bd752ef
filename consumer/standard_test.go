package consumer

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"
)

func quietDLQ() StandardOption {
	return StandardDeadLetter(DeadLetterLogger(slog.New(slog.DiscardHandler)))
}

func TestStandardRetriesPanicsCountsThemAndDeadLettersThem(t *testing.T) {
	pub := &recordingPublisher{}
	st, err := Standard(pub, "dlq", quietDLQ(), StandardDeadLetter(DeadLetterMaxAttempts(3)),
		StandardRetry(RetryAttempts(3)), StandardBreaker(BreakerFailures(100)))
	if err != nil {
		t.Fatal(err)
	}
	var slept []time.Duration
	noSleep(st.Retry, &slept)
	runs := 0
	h := st.Wrap(HandlerFunc(func(context.Context, *Message) error { runs++; panic("boom") }))
	if err := h.Handle(context.Background(), &Message{ID: "p", Attempt: 1}); err != nil {
		t.Fatalf("Handle = %v, want nil (dead-lettered)", err)
	}
	if runs != 3 || st.DeadLetter.Count() != 1 || pub.got[0].Headers[HeaderDLQErrorKind] != "panic" {
		t.Errorf("runs %d, dead-lettered %d, headers %v", runs, st.DeadLetter.Count(), pub.got)
	}
}

// A poison message whose handler returns a plain error (a bug, a
// constraint violation) fails every run: its re-runs are no evidence of an
// outage, so it spends its budget and is dead-lettered while the breaker
// stays closed; failures of distinct messages still open it.
func TestStandardPlainErrorPoisonIsDeadLetteredWithoutOpeningTheBreaker(t *testing.T) {
	pub := &recordingPublisher{}
	st, err := Standard(pub, "dlq", quietDLQ(), StandardDeadLetter(DeadLetterMaxAttempts(10)),
		StandardRetry(RetryAttempts(10)), StandardBreaker(BreakerFailures(2), BreakerOpenFor(time.Hour)))
	if err != nil {
		t.Fatal(err)
	}
	var slept []time.Duration
	noSleep(st.Retry, &slept)
	calls := 0
	h := st.Wrap(HandlerFunc(func(context.Context, *Message) error { calls++; return errDown }))
	if err := h.Handle(context.Background(), &Message{ID: "poison", Attempt: 1}); err != nil {
		t.Fatalf("err = %v after %d calls; want nil (dead-lettered)", err, calls)
	}
	if calls != 10 || st.DeadLetter.Count() != 1 || st.Breaker.State() != BreakerClosed || st.Breaker.Opened() != 0 {
		t.Fatalf("calls %d, dead-lettered %d, breaker %s opened %d times; want 10, 1, closed, 0",
			calls, st.DeadLetter.Count(), st.Breaker.State(), st.Breaker.Opened())
	}
	// An outage fails every message: the second one's first failure opens it.
	err = h.Handle(context.Background(), &Message{ID: "victim", Attempt: 1})
	if !errors.Is(err, ErrHeld) || st.Breaker.State() != BreakerOpen {
		t.Fatalf("second failing message: err = %v, breaker %s; want a hold, open", err, st.Breaker.State())
	}
	if st.DeadLetter.Count() != 1 {
		t.Errorf("dead-lettered %d, want only the poison", st.DeadLetter.Count())
	}
}

func TestStandardPanickingPoisonDoesNotOpenTheBreaker(t *testing.T) {
	st, err := Standard(&recordingPublisher{}, "dlq", quietDLQ(), StandardBreaker(BreakerFailures(1)))
	if err != nil {
		t.Fatal(err)
	}
	var slept []time.Duration
	noSleep(st.Retry, &slept)
	h := st.Wrap(HandlerFunc(func(_ context.Context, m *Message) error {
		if m.ID == "poison" {
			panic("nil map")
		}
		return nil
	}))
	for attempt := 1; attempt <= 2; attempt++ {
		_ = h.Handle(context.Background(), &Message{ID: "poison", Attempt: attempt})
	}
	if err := h.Handle(context.Background(), &Message{ID: "good", Attempt: 1}); err != nil {
		t.Fatalf("the good message after a panicking poison one: %v (breaker %s)", err, st.Breaker.State())
	}
}

func TestStandardSharesABreaker(t *testing.T) {
	b := mustBreaker(t)
	st, err := Standard(&recordingPublisher{}, "dlq", StandardUseBreaker(b))
	if err != nil || st.Breaker != b {
		t.Fatalf("Standard = %v, %v", st, err)
	}
	if _, err := Standard(&recordingPublisher{}, "dlq", StandardUseBreaker(b), StandardBreaker(BreakerFailures(2))); err == nil {
		t.Error("a shared breaker with breaker options was accepted")
	}
}

func TestStandardRejectsBadConfigNamingTheField(t *testing.T) {
	for field, f := range map[string]func() error{
		"DeadLetter.Publisher":   func() error { _, err := Standard(nil, "dlq"); return err },
		"DeadLetter.Destination": func() error { _, err := Standard(&recordingPublisher{}, ""); return err },
		"Retry.Attempts": func() error {
			_, err := Standard(&recordingPublisher{}, "q", StandardRetry(RetryAttempts(0)))
			return err
		},
		"Breaker.Failures": func() error {
			_, err := Standard(&recordingPublisher{}, "q", StandardBreaker(BreakerFailures(0)))
			return err
		},
		"Standard.Timeout": func() error { _, err := Standard(&recordingPublisher{}, "q", StandardTimeout(-1)); return err },
		"Standard.Breaker": func() error { _, err := Standard(&recordingPublisher{}, "q", StandardUseBreaker(nil)); return err },
	} {
		var ce *ConfigError
		if err := f(); !errors.As(err, &ce) || ce.Field != field {
			t.Errorf("%s: err = %v, want a ConfigError naming it", field, err)
		}
	}
}
