package testenv

import (
	"context"
	"strings"
	"testing"
	"time"
)

// Context returns a context that ends after d, or once t and its
// cleanups are done. (Not t.Context: that ends before the cleanups run,
// and a cleanup that deletes a topic may use a context made earlier.)
func Context(t testing.TB, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// WaitFor polls cond every 10ms until it holds, and fails t, saying what it
// waited for, when d passes first. Each of state, if any, is called at the
// timeout and what it returns is added to the failure, to say where things
// stood (counters, a breaker's state) when the wait gave up.
func WaitFor(t testing.TB, d time.Duration, what string, cond func() bool, state ...func() string) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			if len(state) == 0 {
				t.Fatalf("timed out after %s waiting for %s", d, what)
				return
			}
			seen := make([]string, 0, len(state))
			for _, s := range state {
				seen = append(seen, s())
			}
			t.Fatalf("timed out after %s waiting for %s; then: %s", d, what, strings.Join(seen, "; "))
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}
