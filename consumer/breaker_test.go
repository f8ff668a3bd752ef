package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/internal/testenv"
)

func mustBreaker(t *testing.T, opts ...BreakerOption) *Breaker {
	t.Helper()
	b, err := NewBreaker(opts...)
	if err != nil {
		t.Fatal(err)
	}
	return b
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
	testenv.WaitFor(t, 20*time.Second, "half-open", func() bool { return b.State() == BreakerHalfOpen })
	if err := h.Handle(context.Background(), &Message{}); err != errDown {
		t.Fatalf("failed trial = %v", err)
	}
	if b.State() != BreakerOpen || b.Opened() != 2 {
		t.Fatalf("state = %s, opened %d after a failed trial; want open, 2", b.State(), b.Opened())
	}
	testenv.WaitFor(t, 20*time.Second, "half-open again", func() bool { return b.State() == BreakerHalfOpen })
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
	testenv.WaitFor(t, 20*time.Second, "half-open", func() bool { return b.State() == BreakerHalfOpen })

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

// One message failing run after run (a poison message, re-run by Retry, by
// the loop in place or by redeliveries) is one piece of evidence, not many:
// only the first run of a message counts as a failure.
func TestBreakerCountsOneMessagesRerunsAsOneFailure(t *testing.T) {
	b := mustBreaker(t, BreakerFailures(3), BreakerOpenFor(time.Hour))
	fail := b.Wrap(HandlerFunc(func(context.Context, *Message) error { return errDown }))
	poison := &Message{ID: "poison", Attempt: 1}
	for ; poison.Attempt <= 50; poison.Attempt++ {
		if err := fail.Handle(context.Background(), poison); err != errDown {
			t.Fatalf("run %d of the poison: %v, want its own error", poison.Attempt, err)
		}
	}
	if b.State() != BreakerClosed {
		t.Fatalf("breaker %s after one message failed 50 runs, want closed", b.State())
	}
	// Two more distinct messages fail: with the poison's first run, three.
	for _, id := range []string{"a", "b"} {
		_ = fail.Handle(context.Background(), &Message{ID: id, Attempt: 1})
	}
	if b.State() != BreakerOpen {
		t.Fatalf("breaker %s after three distinct messages failed, want open", b.State())
	}
}

// A re-run that succeeds is evidence that the dependency works: it resets
// the run of consecutive failures.
func TestBreakerCountsARerunsSuccess(t *testing.T) {
	b := mustBreaker(t, BreakerFailures(2), BreakerFailureRatio(1), BreakerOpenFor(time.Hour))
	fail := b.Wrap(HandlerFunc(func(context.Context, *Message) error { return errDown }))
	ok := b.Wrap(HandlerFunc(func(context.Context, *Message) error { return nil }))
	_ = fail.Handle(context.Background(), &Message{ID: "a", Attempt: 1})
	_ = ok.Handle(context.Background(), &Message{ID: "a", Attempt: 2})
	_ = fail.Handle(context.Background(), &Message{ID: "b", Attempt: 1})
	if b.State() != BreakerClosed {
		t.Fatalf("breaker %s: two failures with a success between them opened it", b.State())
	}
	_ = fail.Handle(context.Background(), &Message{ID: "c", Attempt: 1})
	if b.State() != BreakerOpen {
		t.Fatalf("breaker %s after two failures in a row, want open", b.State())
	}
}

// Half-open, the trial goes to a message that has not failed yet: a re-run
// that comes first is held, and the fresh message after it is the trial.
func TestBreakerHalfOpenTrialIsNotSpentOnAMessageThatFailed(t *testing.T) {
	b := mustBreaker(t, BreakerFailures(1), BreakerOpenFor(400*time.Millisecond))
	calls := map[string]int{}
	h := b.Wrap(HandlerFunc(func(_ context.Context, m *Message) error {
		calls[m.ID]++
		if m.ID == "poison" {
			return errDown
		}
		return nil
	}))
	_ = h.Handle(context.Background(), &Message{ID: "poison", Attempt: 1})
	testenv.WaitFor(t, 20*time.Second, "half-open", func() bool { return b.State() == BreakerHalfOpen })
	err := h.Handle(context.Background(), &Message{ID: "poison", Attempt: 2})
	var held *HeldError
	if !errors.As(err, &held) || calls["poison"] != 1 {
		t.Fatalf("the poison's re-run in half-open = %v after %d calls; want held, not run", err, calls["poison"])
	}
	if err := h.Handle(context.Background(), &Message{ID: "fresh", Attempt: 1}); err != nil || calls["fresh"] != 1 {
		t.Fatalf("a fresh message in half-open = %v (%d calls); want the trial, run", err, calls["fresh"])
	}
	if b.State() != BreakerClosed {
		t.Fatalf("breaker %s after the fresh trial succeeded, want closed", b.State())
	}
}

// Half-open with nothing but re-runs (a Kafka topic whose partitions are all
// held at records that failed in the outage), a re-run becomes the trial
// once the short wait for a fresh one is over, and its failure reopens.
func TestBreakerHalfOpenTrialFallsBackToARerun(t *testing.T) {
	b := mustBreaker(t, BreakerFailures(1), BreakerOpenFor(40*time.Millisecond))
	fail := b.Wrap(HandlerFunc(func(context.Context, *Message) error { return errDown }))
	_ = fail.Handle(context.Background(), &Message{ID: "victim", Attempt: 1})
	testenv.WaitFor(t, 20*time.Second, "half-open", func() bool { return b.State() == BreakerHalfOpen })
	victim := &Message{ID: "victim", Attempt: 2}
	err := fail.Handle(context.Background(), victim)
	var held *HeldError
	if !errors.As(err, &held) {
		t.Fatalf("the re-run at once in half-open = %v, want held", err)
	}
	time.Sleep(held.Delay)
	if err := fail.Handle(context.Background(), victim); err != errDown {
		t.Fatalf("the re-run after the hold = %v, want the trial's own failure", err)
	}
	if b.State() != BreakerOpen || b.Opened() != 2 {
		t.Fatalf("breaker %s, opened %d after the re-run trial failed; want open, 2", b.State(), b.Opened())
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

// On a log (a broker that cannot redeliver), a failed message is held in
// place and its lane waits behind it: an outage on a topic of a single
// partition gives one distinct failing message, yet its re-runs, with
// nothing succeeding meanwhile, open the breaker.
func TestBreakerOpensOnAStuckLaneOfALog(t *testing.T) {
	drv := newScriptLog(false)
	drv.add("0", 20)
	b := mustBreaker(t, BreakerFailures(3), BreakerOpenFor(time.Hour))
	l, err := New(drv, WithRedeliveryBackoff(time.Millisecond, time.Millisecond), WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	stop := runLoop(t, l, b.Wrap(HandlerFunc(func(context.Context, *Message) error { return errDown })))
	testenv.WaitFor(t, 20*time.Second, "the breaker to open", func() bool { return b.State() == BreakerOpen })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

// A poison message held in place on one lane of a log, while the other
// lanes flow: its re-runs are no evidence (others succeed between them),
// and the breaker stays closed.
func TestBreakerStaysClosedForAPoisonOnOneLaneOfALog(t *testing.T) {
	drv := newScriptLog(false)
	drv.add("poisoned", 1)
	drv.add("flowing", 2000)
	b := mustBreaker(t, BreakerFailures(3), BreakerOpenFor(time.Hour))
	// The poison's re-runs are 20-40 ms apart, as a real backoff spaces
	// them (100 ms and up by default): a re-run counts as evidence only
	// when nothing succeeded since the last one, and a loaded machine can
	// stall the flowing lane for a millisecond or two, but not for 60 ms
	// of three re-runs in a row.
	l, err := New(drv, WithConcurrency(2), WithRedeliveryBackoff(20*time.Millisecond, 40*time.Millisecond),
		WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	var poisonRuns atomic.Int32
	stop := runLoop(t, l, b.Wrap(HandlerFunc(func(_ context.Context, m *Message) error {
		if m.Lane == "poisoned" {
			poisonRuns.Add(1)
			return errDown
		}
		time.Sleep(100 * time.Microsecond)
		return nil
	})))
	testenv.WaitFor(t, 20*time.Second, "the flowing lane to be done", func() bool { return l.Stats().Acked == 2000 },
		func() string {
			return fmt.Sprintf("stats %+v, breaker %s opened %d times", l.Stats(), b.State(), b.Opened())
		})
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if poisonRuns.Load() < 5 || b.Opened() != 0 {
		t.Fatalf("the poison ran %d times and the breaker opened %d times; want several runs and none", poisonRuns.Load(), b.Opened())
	}
}

// While a dependency is down for many of the breaker's open periods, the
// half-open trials go round the held messages instead of falling on the
// same one each time: a message whose trial failed waits behind the others
// held for the breaker. Unordered messages of a log, retried in place, all
// wait in the loop, and the first to wake took every trial: with a budget
// of 5, it was dead-lettered while the others were held, though every
// message was good.
func TestHalfOpenTrialsGoRoundTheHeldMessages(t *testing.T) {
	drv := newScriptLog(false)
	drv.add("", 30)
	b := mustBreaker(t, BreakerFailures(3), BreakerOpenFor(40*time.Millisecond))
	pub := &recordingPublisher{}
	dl, err := NewDeadLetter(pub, "dlq", DeadLetterMaxAttempts(5))
	if err != nil {
		t.Fatal(err)
	}
	l, err := New(drv, WithConcurrency(4), WithOrdering(Unordered), WithRedeliveryBackoff(10*time.Millisecond, 20*time.Millisecond),
		WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	var down atomic.Bool
	down.Store(true)
	stop := runLoop(t, l, Chain(HandlerFunc(func(_ context.Context, m *Message) error {
		if down.Load() {
			return errDown
		}
		return nil
	}), dl.Wrap, b.Wrap))
	testenv.WaitFor(t, 10*time.Second, "the breaker to open", func() bool { return b.Opened() > 0 })
	time.Sleep(1500 * time.Millisecond) // some 30 open periods, each ending in a trial
	down.Store(false)
	testenv.WaitFor(t, 20*time.Second, "the 30 messages acked (dead-lettered ones too)", func() bool { return l.Stats().Acked == 30 },
		func() string { return fmt.Sprintf("stats %+v, breaker opened %d times", l.Stats(), b.Opened()) })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if n := dl.Count(); n != 0 {
		t.Errorf("%d good messages dead-lettered during the outage (the breaker opened %d times); its trials fell on too few of them", n, b.Opened())
	}
}
