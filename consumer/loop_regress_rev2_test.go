package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
)

// A running delivery revoked twice (a lost channel, then a lost connection)
// is awaited by both revocations: each Done closes when it returns.
func TestSecondRevocationOfALaneClosesBothDones(t *testing.T) {
	drv := newScriptLog(false)
	drv.push(driver.Message{ID: "A", Lane: "0", Attempt: 1, Handle: "A"})
	l, err := New(drv, WithConcurrency(2))
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan struct{}, 1)
	gate := make(chan struct{})
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		started <- struct{}{}
		<-gate // slow to notice cancellation
		return ctx.Err()
	}))
	<-started
	done1, done2 := make(chan struct{}), make(chan struct{})
	drv.revCh <- driver.Revocation{Lanes: []string{"0"}, Done: done1}
	drv.revCh <- driver.Revocation{Lanes: []string{"0"}, Done: done2} // e.g. channel and connection both closed
	close(gate)
	for i, d := range []chan struct{}{done1, done2} {
		select {
		case <-d:
		case <-time.After(time.Second):
			t.Errorf("Done of revocation %d not closed 1s after the handler returned", i+1)
		}
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}
