package testenv

import (
	"context"
	"errors"
	"testing"
)

// Stop ends the call's context and returns what the call returned, the
// same on every call.
func TestStopEndsTheCallAndReturnsItsError(t *testing.T) {
	errDone := errors.New("done")
	started := make(chan struct{})
	r := Start(t, func(ctx context.Context) error {
		close(started)
		<-ctx.Done()
		return errDone
	})
	<-started
	if err := r.Stop(); !errors.Is(err, errDone) {
		t.Fatalf("Stop = %v, want the call's error", err)
	}
	if err := r.Stop(); !errors.Is(err, errDone) {
		t.Fatalf("Stop again = %v, want the same", err)
	}
}
