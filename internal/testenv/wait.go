package testenv

import (
	"context"
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
// waited for, when d passes first.
func WaitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
