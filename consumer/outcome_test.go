package consumer

import (
	"errors"
	"fmt"
	"testing"
	"time"
)

// Every outcome is told apart the same way: by its sentinel through
// errors.Is, or by its IsX function, also when a layer above wrapped it, and
// never mistaken for another outcome.
func TestEachOutcomeMatchesItsOwnSentinelAndNoOther(t *testing.T) {
	base := errors.New("downstream 503")
	outcomes := []struct {
		name     string
		err      error
		sentinel error
		is       func(error) bool
	}{
		{"Permanent", Permanent(base), ErrPermanent, IsPermanent},
		{"RetryAfter", RetryAfter(base, time.Second), ErrRetryAfter, IsRetryAfter},
		{"Hold", Hold(base, time.Second), ErrHeld, IsHeld},
		{"Defer", Defer(base, time.Second), ErrDeferred, IsDeferred},
	}
	for _, made := range outcomes {
		wrapped := fmt.Errorf("handling order 7: %w", made.err)
		for _, asked := range outcomes {
			want := asked.name == made.name
			if got := errors.Is(wrapped, asked.sentinel); got != want {
				t.Errorf("errors.Is(%s, %v) = %v, want %v", made.name, asked.sentinel, got, want)
			}
			if got := asked.is(wrapped); got != want {
				t.Errorf("Is%s-style check of %s = %v, want %v", asked.name, made.name, got, want)
			}
		}
		if !errors.Is(wrapped, base) {
			t.Errorf("%s does not wrap its cause", made.name)
		}
	}
	if IsRetryAfter(base) || IsRetryAfter(nil) {
		t.Error("IsRetryAfter is true of an error RetryAfter did not make")
	}
}

// The delay of a RetryAfter is found with errors.As, as Hold's and Defer's are.
func TestRetryAfterKeepsItsDelayBehindTheSentinel(t *testing.T) {
	err := fmt.Errorf("layer: %w", RetryAfter(errors.New("throttled"), 3*time.Second))
	var ra *RetryAfterError
	if !IsRetryAfter(err) || !errors.As(err, &ra) || ra.Delay != 3*time.Second {
		t.Fatalf("IsRetryAfter = %v, As = %+v", IsRetryAfter(err), ra)
	}
}
