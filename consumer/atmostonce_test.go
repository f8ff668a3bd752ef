package consumer

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"
)

// In at-most-once mode a breaker's hold still pauses fetching, so an open
// breaker does not drain the backlog into the void at full speed.
func TestAtMostOnceHoldPausesFetching(t *testing.T) {
	drv := newScriptLog(true)
	drv.add("", 50)
	l, err := New(drv, WithConcurrency(1), WithMaxInFlight(1), WithDeliveryMode(AtMostOnce))
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		runs.Add(1)
		return Hold(errors.New("breaker open"), time.Minute)
	}))
	time.Sleep(200 * time.Millisecond)
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	acked := 0
	for _, acts := range drv.outcomes() {
		acked += len(acts)
	}
	if runs.Load() > 1 {
		t.Errorf("breaker held for a minute, yet %d messages were fetched, acked (%d) and dropped within 200ms; Held stat = %d",
			runs.Load(), acked, l.Stats().Held)
	}
}
