package consumer

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
)

// Duplicates deferred behind a claim held elsewhere do not take the room
// of fresh messages: with every in-flight slot full of deferred messages,
// the next fresh one is fetched and runs at once, not after the deferral.
func TestDeferredMessagesDoNotStarveFreshOnes(t *testing.T) {
	drv := newScriptLog(true)
	for i := 0; i < 4; i++ {
		drv.push(driver.Message{ID: "dup", Deliveries: 1, Handle: fmt.Sprint("dup", i)})
	}
	l, err := New(drv, WithConcurrency(2), WithMaxInFlight(4))
	if err != nil {
		t.Fatal(err)
	}
	fresh := make(chan struct{})
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		if m.ID == "dup" {
			return Defer(errors.New("in progress elsewhere"), time.Minute)
		}
		close(fresh)
		return nil
	}))
	eventually(t, "four deferrals", func() bool { return l.Stats().Deferred == 4 })
	drv.push(driver.Message{ID: "fresh", Deliveries: 1, Handle: "fresh"})
	select {
	case <-fresh:
	case <-time.After(10 * time.Second):
		t.Fatal("a fresh message waited behind deferred duplicates that filled the in-flight slots")
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 4; i++ {
		st := drv.settlements(fmt.Sprint("dup", i))
		if len(st) != 1 || st[0].Action != driver.Return || !st[0].NotAttempted {
			t.Errorf("deferred dup%d settled %+v at shutdown, want one return, not attempted", i, st)
		}
	}
}
