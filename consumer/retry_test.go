package consumer

import (
	"context"
	"errors"
	"testing"
	"time"
)

var errDown = errors.New("dependency down")

// noSleep makes a Retry record its in-process delays instead of sleeping.
func noSleep(r *Retry, slept *[]time.Duration) {
	r.sleep = func(ctx context.Context, d time.Duration) error {
		*slept = append(*slept, d)
		return ctx.Err()
	}
}

func mustRetry(t *testing.T, opts ...RetryOption) *Retry {
	t.Helper()
	r, err := NewRetry(opts...)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestRetryRunsAgainUntilTheHandlerSucceeds(t *testing.T) {
	r := mustRetry(t)
	var slept []time.Duration
	noSleep(r, &slept)
	runs := 0
	h := r.Wrap(HandlerFunc(func(context.Context, *Message) error {
		runs++
		if runs < 3 {
			return errDown
		}
		return nil
	}))
	if err := h.Handle(context.Background(), &Message{Attempt: 1}); err != nil {
		t.Fatalf("Handle = %v, want nil", err)
	}
	if runs != 3 || len(slept) != 2 {
		t.Errorf("runs = %d, sleeps = %d; want 3 and 2", runs, len(slept))
	}
}

func TestRetryGivesTheMessageBackWithAGrowingJitteredDelay(t *testing.T) {
	r := mustRetry(t, RetryAttempts(3), RetryInitial(10*time.Millisecond), RetryMaxInterval(time.Second), RetryRedeliveryMax(time.Hour))
	var slept []time.Duration
	noSleep(r, &slept)
	runs := 0
	h := r.Wrap(HandlerFunc(func(context.Context, *Message) error { runs++; return errDown }))
	for attempt := 1; attempt <= 4; attempt++ {
		runs = 0
		// The runs of the deliveries before this one were counted.
		err := h.Handle(context.Background(), &Message{Attempt: (attempt-1)*3 + 1, Deliveries: attempt})
		var ra *RetryAfterError
		if !errors.As(err, &ra) || !errors.Is(err, errDown) {
			t.Fatalf("attempt %d: Handle = %v, want RetryAfter wrapping errDown", attempt, err)
		}
		if runs != 3 {
			t.Errorf("attempt %d: runs = %d, want 3", attempt, runs)
		}
		step := r.b.step(attempt*3, time.Hour)
		if ra.Delay < step/2 || ra.Delay > step {
			t.Errorf("attempt %d: redelivery delay %s outside [%s, %s]", attempt, ra.Delay, step/2, step)
		}
		if ra.Delay <= 0 {
			t.Errorf("attempt %d: redelivery delay %s comes back immediately", attempt, ra.Delay)
		}
	}
	for i, d := range slept {
		run := i%2 + 1
		if d < 0 || d >= r.b.step(run, r.b.max) {
			t.Errorf("in-process delay %s after run %d outside [0, %s)", d, run, r.b.step(run, r.b.max))
		}
	}
}

func TestRetryInProcessDelaysAreSpread(t *testing.T) {
	r := mustRetry(t, RetryAttempts(2), RetryInitial(100*time.Millisecond))
	var slept []time.Duration
	noSleep(r, &slept)
	h := r.Wrap(HandlerFunc(func(context.Context, *Message) error { return errDown }))
	for range 10000 {
		_ = h.Handle(context.Background(), &Message{Attempt: 1})
	}
	if chi := chiSquareUniform(slept, 0, 100*time.Millisecond, 10); chi > chiSquareLimit {
		t.Errorf("in-process delays are not spread over [0, 100ms): chi-square %.1f", chi)
	}
}

func TestRetryStopsAtOnce(t *testing.T) {
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	cases := []struct {
		name string
		ctx  context.Context
		err  error
	}{
		{"permanent", context.Background(), Permanent(errDown)},
		{"held", context.Background(), Hold(errDown, time.Second)},
		{"retry after", context.Background(), RetryAfter(errDown, time.Second)},
		{"dead-letter failed", context.Background(), &DeadLetterError{Err: errDown}},
		{"cancelled context", canceled, errDown},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := mustRetry(t)
			var slept []time.Duration
			noSleep(r, &slept)
			runs := 0
			h := r.Wrap(HandlerFunc(func(context.Context, *Message) error { runs++; return c.err }))
			if err := h.Handle(c.ctx, &Message{Attempt: 1}); err != c.err {
				t.Errorf("Handle = %v, want the handler's error unchanged", err)
			}
			if runs != 1 || len(slept) != 0 {
				t.Errorf("runs = %d, sleeps = %d; want 1 and 0", runs, len(slept))
			}
		})
	}
}

func TestRetryCancelledDuringBackoffStopsAtOnce(t *testing.T) {
	r := mustRetry(t, RetryInitial(time.Hour), RetryMaxInterval(time.Hour), RetryMaxElapsed(10*time.Hour), RetryJitter(false))
	ctx, cancel := context.WithCancel(context.Background())
	runs := 0
	h := r.Wrap(HandlerFunc(func(context.Context, *Message) error {
		runs++
		time.AfterFunc(time.Millisecond, cancel)
		return errDown
	}))
	// Without honouring the cancellation, this would sleep an hour.
	if err := h.Handle(ctx, &Message{Attempt: 1}); !errors.Is(err, errDown) {
		t.Errorf("Handle = %v, want errDown", err)
	}
	if runs != 1 {
		t.Errorf("runs = %d, want 1", runs)
	}
}

func TestRetryMaxElapsedBoundsTheTimeInProcess(t *testing.T) {
	r := mustRetry(t, RetryAttempts(10), RetryInitial(time.Hour), RetryMaxInterval(time.Hour), RetryMaxElapsed(time.Minute), RetryJitter(false))
	var slept []time.Duration
	noSleep(r, &slept)
	runs := 0
	h := r.Wrap(HandlerFunc(func(context.Context, *Message) error { runs++; return errDown }))
	err := h.Handle(context.Background(), &Message{Attempt: 1})
	var ra *RetryAfterError
	if !errors.As(err, &ra) {
		t.Fatalf("Handle = %v, want RetryAfter", err)
	}
	if runs != 1 || len(slept) != 0 {
		t.Errorf("runs = %d, sleeps = %d; want 1 and 0: an hour's backoff exceeds the minute's bound", runs, len(slept))
	}
}

// MaxElapsed counts from when the first run began, its own duration
// included, whether Retry reads the clock itself or, with a Timeout below
// (Standard's order: breakers between), takes the run's start from it.
func TestRetryMaxElapsedCountsTheFirstRunsDuration(t *testing.T) {
	br, err := NewBreaker()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name  string
		below []Middleware
		timed bool
	}{
		{"bare", nil, false},
		{"timeout-below", []Middleware{Timeout(time.Hour)}, true},
		{"breaker-and-timeout-below", []Middleware{br.Wrap, Timeout(time.Hour)}, true},
		{"recover-then-timeout", []Middleware{Recover(), Timeout(time.Hour)}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := mustRetry(t, RetryAttempts(10), RetryInitial(time.Millisecond), RetryMaxInterval(time.Millisecond), RetryMaxElapsed(30*time.Millisecond), RetryJitter(false))
			var slept []time.Duration
			noSleep(r, &slept)
			runs := 0
			h := Chain(HandlerFunc(func(context.Context, *Message) error {
				runs++
				time.Sleep(40 * time.Millisecond) // the first run alone outlasts MaxElapsed
				return errDown
			}), append([]Middleware{r.Wrap}, c.below...)...)
			if got := h.(*retryHandler).timed; got != c.timed {
				t.Fatalf("timed = %v, want %v", got, c.timed)
			}
			err := h.Handle(context.Background(), &Message{Attempt: 1})
			var ra *RetryAfterError
			if !errors.As(err, &ra) {
				t.Fatalf("Handle = %v, want RetryAfter", err)
			}
			if runs != 1 {
				t.Errorf("runs = %d, want 1: a run of 40ms leaves no room in a 30ms bound", runs)
			}
		})
	}
}

func TestRetryPassesPanicsAndTimeoutsToAnotherRun(t *testing.T) {
	r := mustRetry(t)
	var slept []time.Duration
	noSleep(r, &slept)
	runs := 0
	h := Chain(HandlerFunc(func(context.Context, *Message) error {
		runs++
		if runs == 1 {
			panic("boom")
		}
		return nil
	}), r.Wrap, Recover())
	if err := h.Handle(context.Background(), &Message{Attempt: 1}); err != nil || runs != 2 {
		t.Errorf("Handle = %v after %d runs, want nil after 2", err, runs)
	}
}

func TestNewRetryRejectsBadConfigNamingTheField(t *testing.T) {
	cases := map[string]RetryOption{
		"Retry.Attempts":      RetryAttempts(0),
		"Retry.Initial":       RetryInitial(0),
		"Retry.Multiplier":    RetryMultiplier(0.5),
		"Retry.MaxInterval":   RetryMaxInterval(-1),
		"Retry.MaxElapsed":    RetryMaxElapsed(0),
		"Retry.RedeliveryMax": RetryRedeliveryMax(0),
	}
	for field, opt := range cases {
		_, err := NewRetry(opt)
		var ce *ConfigError
		if !errors.As(err, &ce) || ce.Field != field || !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("%s: err = %v, want a ConfigError naming it", field, err)
		}
	}
	_, err := NewRetry(RetryInitial(time.Second), RetryMaxInterval(time.Millisecond))
	var ce *ConfigError
	if !errors.As(err, &ce) || ce.Field != "Retry.MaxInterval" {
		t.Errorf("MaxInterval below Initial: err = %v", err)
	}
}
