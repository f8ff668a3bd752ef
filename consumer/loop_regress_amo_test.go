package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
)

func (s *scriptLog) push(msgs ...driver.Message) {
	s.mu.Lock()
	s.pending = append(s.pending, msgs...)
	s.mu.Unlock()
	select {
	case s.notify <- struct{}{}:
	default:
	}
}

// In at-most-once mode a running handler of a revoked lane is still waited
// for: Done closes only after it returns, and when it returns it does not
// release the key that the lane's next generation now owns (which would let
// a later message of the key start while an earlier one runs).
func TestAtMostOnceRevocationWaitsForRunningHandlers(t *testing.T) {
	drv := newScriptLog(false)
	msg := func(id string) driver.Message {
		return driver.Message{ID: id, Lane: "0", Offset: -1, Attempt: 1, Handle: id}
	}
	drv.push(msg("A"))
	l, err := New(drv, WithConcurrency(4), WithDeliveryMode(AtMostOnce))
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan string, 10)
	gate := map[string]chan struct{}{"A": make(chan struct{}), "B": make(chan struct{}), "C": make(chan struct{})}
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		started <- m.ID
		<-gate[m.ID] // ignores cancellation, like a handler stuck in a call
		return nil
	}))
	if id := <-started; id != "A" {
		t.Fatal(id)
	}
	done := make(chan struct{})
	drv.revCh <- driver.Revocation{Lanes: []string{"0"}, Done: done}
	select {
	case <-done:
		t.Errorf("Done closed while A's handler on the revoked lane still runs")
	case <-time.After(100 * time.Millisecond):
	}
	// The lane comes back (the driver moved on because Done closed).
	drv.push(msg("B"), msg("C"))
	if id := <-started; id != "B" {
		t.Fatal(id)
	}
	close(gate["A"]) // the stale handler of the old generation returns
	select {
	case id := <-started:
		t.Errorf("%s started while B, earlier on the same lane, still runs", id)
	case <-time.After(200 * time.Millisecond):
	}
	close(gate["B"])
	close(gate["C"])
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}
