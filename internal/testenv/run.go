package testenv

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"
)

// Running is a call started by Start, in a goroutine of its own: a
// consumer's Run, say.
type Running struct {
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
	err    error
}

// StopWithin is how long Stop waits for the call to return once its
// context ended.
const StopWithin = time.Minute

// ErrNotStopped is what Stop returns when the call did not return within
// StopWithin of its context's end.
var ErrNotStopped = errors.New("testenv: the call did not return after its context ended")

// Start calls run in a goroutine with a context that Stop ends, and stops
// it when t ends (after the cleanups registered later, such as one that
// reports Stop's error).
func Start(t testing.TB, run func(ctx context.Context) error) *Running {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &Running{cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- run(ctx) }()
	t.Cleanup(func() { _ = r.Stop() })
	return r
}

// Stop ends the call's context and returns what the call returned, or an
// error wrapping ErrNotStopped when it did not return within StopWithin.
// Later calls return the same.
func (r *Running) Stop() error {
	r.once.Do(func() {
		r.cancel()
		select {
		case r.err = <-r.done:
		case <-time.After(StopWithin):
			r.err = fmt.Errorf("%w within %s", ErrNotStopped, StopWithin)
		}
	})
	return r.err
}
