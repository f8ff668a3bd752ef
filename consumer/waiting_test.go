package consumer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
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
	testenv.WaitFor(t, 20*time.Second, "four deferrals", func() bool { return l.Stats().Deferred == 4 })
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

// On a broker that cannot take a message back (a Kafka log), a Return is a
// no-op until the lane changes hands. deferRun returns a deferred record
// once dp.deferred reaches the bound, without looking at
// Capabilities.Redelivers: the record is never run again here, its key is
// freed, and later records of its lane run (and commit) past it.
func TestDeferBeyondTheBoundOnALogIsRunAgainInPlace(t *testing.T) {
	drv := newScriptLog(false)
	drv.add("0", 1)
	drv.add("1", 1)
	l, err := New(drv, WithConcurrency(1), WithMaxInFlight(1))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	runs := map[string]int{}
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		mu.Lock()
		defer mu.Unlock()
		runs[m.ID]++
		if runs[m.ID] == 1 {
			return Defer(errors.New("a duplicate runs elsewhere"), 50*time.Millisecond)
		}
		return nil
	}))
	testenv.WaitFor(t, 20*time.Second, "both records deferred once", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return runs["0/0"] >= 1 && runs["1/0"] >= 1
	})
	time.Sleep(300 * time.Millisecond) // well past the deferral
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	for id, acts := range drv.outcomes() {
		for _, a := range acts {
			if a == driver.Return {
				t.Errorf("record %s was returned to a log that cannot take it back (a no-op on Kafka: lost until a rebalance)", id)
			}
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for _, id := range []string{"0/0", "1/0"} {
		if runs[id] < 2 {
			t.Errorf("deferred record %s ran %d time(s): it was never run again", id, runs[id])
		}
	}
}
