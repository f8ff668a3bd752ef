package consumer

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
)

// lateBatchLog hands out A and B of lane 0 at once; its next Fetch returns
// C of lane 0 just after the Run's context ended, as a Kafka Fetch that
// drained its stash as the consumer stopped (the fetcher hands such a batch
// over all the same).
type lateBatchLog struct {
	*scriptLog
	calls int
}

func (s *lateBatchLog) Fetch(ctx context.Context, dst []driver.Message, max int) ([]driver.Message, error) {
	s.calls++
	if s.calls == 1 {
		for i, id := range []string{"A", "B"} {
			dst = append(dst, driver.Message{ID: id, Lane: "0", Offset: int64(i), Deliveries: 1, Handle: id})
		}
		return dst, nil
	}
	if s.calls == 2 {
		<-ctx.Done()
		time.Sleep(100 * time.Millisecond) // the dispatcher has begun its shutdown by now
		return append(dst, driver.Message{ID: "C", Lane: "0", Offset: 2, Deliveries: 1, Handle: "C"}), nil
	}
	<-ctx.Done()
	return dst, ctx.Err()
}

// TestShutdownKeepsLaneOrderForALateBatch: on a log, A (offset 0) failed
// and waits to run again in place, holding its lane; B waits behind it.
// The context ends: A goes back with its delay and B with it
// (beginShutdown → settle → takeFollowers), which frees the lane. C
// (offset 2), fetched as the consumer stopped and handed over just after,
// finds the lane free, runs and is acked during the grace: a later record
// of the partition completes while an earlier one has not (it runs again
// on the next owner, after C).
func TestShutdownKeepsLaneOrderForALateBatch(t *testing.T) {
	drv := &lateBatchLog{scriptLog: newScriptLog(false)}
	l, err := New(drv, WithConcurrency(2), WithRedeliveryBackoff(time.Minute, time.Minute), WithShutdownGrace(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu  sync.Mutex
		ran []string
	)
	failed := make(chan struct{}, 1)
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		mu.Lock()
		ran = append(ran, m.ID)
		mu.Unlock()
		if m.ID == "A" {
			select {
			case failed <- struct{}{}:
			default:
			}
			return errors.New("transient")
		}
		return nil
	}))
	<-failed
	time.Sleep(20 * time.Millisecond)
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	out := drv.outcomes()
	t.Logf("ran %v; settled A=%v B=%v C=%v", ran, out["A"], out["B"], out["C"])
	for _, id := range ran {
		if id == "C" {
			t.Fatalf("C (offset 2) ran while A (offset 0) of its lane had been handed back unfinished; C settled %v", out["C"])
		}
	}
}

// TestRevokedRunInTheWorkQueueAtTheGrace: the only worker is stuck in a
// handler that ignores cancellation; lane 0's head waits in the work queue
// with its train. Lane 0 is revoked, then the grace ends: the revocation
// takes the head and its train out of the work queue (reclaimWork; before
// it, endGrace did); none of lane 0 is settled, the revocation's Done
// closes, and nothing stays in flight.
func TestRevokedRunInTheWorkQueueAtTheGrace(t *testing.T) {
	drv := newScriptLog(false)
	drv.push(driver.Message{ID: "S", Lane: "s", Deliveries: 1, Handle: "S"})
	l, err := New(drv, WithConcurrency(1), WithMaxInFlight(32), WithShutdownGrace(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	stuck := make(chan struct{})
	release := make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		errc <- l.Run(ctx, HandlerFunc(func(ctx context.Context, m *Message) error {
			if m.ID == "S" {
				close(stuck)
				<-release // ignores its context
			}
			return nil
		}))
	}()
	<-stuck
	drv.add("0", 10)
	testenv.WaitFor(t, 20*time.Second, "lane 0 fetched", func() bool { return l.Stats().Fetched == 11 })
	time.Sleep(20 * time.Millisecond) // its head goes to the work queue with its train
	done := make(chan struct{})
	drv.revCh <- driver.Revocation{Lanes: []string{"0"}, Done: done}
	cancel()
	select {
	case <-done:
	case <-time.After(2 * time.Second):
		t.Error("revocation Done not closed 2s after the grace ended")
	}
	close(release)
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	for id, acts := range drv.outcomes() {
		if id != "S" {
			t.Errorf("%s of the revoked lane settled %v", id, acts)
		}
	}
	if got := l.Stats().InFlight; got != 0 {
		t.Errorf("InFlight = %d after Run returned", got)
	}
	if got := l.Stats().Revoked; got != 10 {
		t.Errorf("Revoked = %d, want 10", got)
	}
}
