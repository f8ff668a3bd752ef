package consumer

import (
	"context"
	"errors"
	"log/slog"
	"runtime"
	"strconv"
	"testing"
	"time"
	"weak"

	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
)

// The unordered messages that went to a worker with a train ahead of them
// and never started go back when the grace ends, even when the handler at
// the head of the train ignores its cancelled context and never returns: they
// are messages not yet started (see the package doc), not the stuck
// handler's, and must not be left to their lease.
func TestGraceEndReturnsTheUnstartedRestOfAStuckWorkersTrain(t *testing.T) {
	drv := newScriptLog(true)
	drv.add("", 6) // unlaned: /0 goes to the only worker with /1../5 as its train
	l, err := New(drv, WithConcurrency(1), WithMaxInFlight(16), WithShutdownGrace(50*time.Millisecond),
		WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan string, 6)
	release := make(chan struct{})
	defer close(release)
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		started <- m.ID
		<-release // ignores its context
		return nil
	}))
	first := <-started
	testenv.WaitFor(t, 20*time.Second, "all six to be fetched", func() bool { return l.Stats().Fetched == 6 })
	time.Sleep(20 * time.Millisecond) // the rest reaches the worker's train or the work queue
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	for i := range 6 {
		id := "/" + strconv.Itoa(i)
		if id == first {
			continue
		}
		st := drv.settlements(id)
		if len(st) != 1 || st[0].Action != driver.Return || !st[0].NotAttempted {
			t.Errorf("%s, which never started, settled %+v when the grace ended, want one return not attempted", id, st)
		}
	}
}

// A delivery that stays in the loop for long (here a poison record retried
// in place) keeps its slab alive, and with it its neighbours; what they
// point at must not reach the deliveries that came after them, or one
// stuck record keeps every message the loop ever ran in memory.
func TestALongHeldDeliveryDoesNotKeepLaterDeliveriesAlive(t *testing.T) {
	const n = 30000
	drv := newScriptLog(false) // a log: the poison record is retried in place, for ever
	msgs := make([]driver.Message, 0, n)
	for i := range n - 1 {
		id := strconv.Itoa(i)
		msgs = append(msgs, driver.Message{ID: id, Deliveries: 1, Handle: id, Body: make([]byte, 8)})
		if i == 0 {
			// Its slab's neighbour: the delivery ahead of it heads the
			// first run.
			msgs = append(msgs, driver.Message{ID: "poison", Deliveries: 1, Handle: "poison"})
		}
	}
	drv.push(msgs...)
	l, err := New(drv, WithConcurrency(2), WithMaxInFlight(2000), WithFetchBatch(500),
		WithRedeliveryBackoff(20*time.Millisecond, 20*time.Millisecond), WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	seen := make(chan weak.Pointer[Message], n)
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		if m.ID == "poison" {
			return errors.New("poison")
		}
		if i, _ := strconv.Atoi(m.ID); i > 2000 && i < n-4000 && i%50 == 0 {
			seen <- weak.Make(m)
		}
		return nil
	}))
	defer func() {
		if err := stop(); err != nil {
			t.Error(err)
		}
	}()
	testenv.WaitFor(t, 20*time.Second, "every other message to be acked", func() bool { return l.Stats().Acked == n-1 })
	close(seen)
	runtime.GC()
	runtime.GC()
	total, alive := 0, 0
	for p := range seen {
		total++
		if p.Value() != nil {
			alive++
		}
	}
	t.Logf("alive %d of %d", alive, total)
	if alive > total/10 {
		t.Errorf("%d of %d acked deliveries sampled are still reachable while the poison record is held", alive, total)
	}
}

// When the grace ends, a delivery still in the work queue goes back with
// what of its train of unordered deliveries is still its own: the part taken
// back from it (by a revocation, as here, or by rebalance) is in the ready
// queue, or with another worker, and is settled from there, once. The
// state is the dispatcher's own, built by its own steps.
func TestGraceEndSettlesATakenBackTrainOnce(t *testing.T) {
	drv := newScriptLog(true)
	l, err := New(drv, WithConcurrency(3), WithOrdering(OrderByKey), WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	dp := newDispatcher(context.Background(), l, HandlerFunc(func(context.Context, *Message) error { return nil }), nil)
	defer dp.cancelHandler()
	var slab deliverySlab
	for i := range 9 { // keyless, so unordered: 0..6 on lane a, 7 and 8 on lane b
		lane := "a"
		if i >= 7 {
			lane = "b"
		}
		m := driver.Message{ID: strconv.Itoa(i), Lane: lane, Deliveries: 1, Handle: strconv.Itoa(i)}
		l.inflight.Add(1)
		dp.admit(newDelivery(&slab, &m, nil))
	}
	dp.sendReady() // 0+[1 2], 3+[4], 5+[6] fill the work queue; 7 and 8 stay ready
	if len(dp.work) != 3 || len(dp.ready) != 2 {
		t.Fatalf("work queue %d, ready %d: not the state this test builds", len(dp.work), len(dp.ready))
	}
	// Lane b goes; the trains' unclaimed rests come back to the ready
	// queue (revoke takes them back; before it did, a takeDone's
	// rebalance did, with a worker idle).
	dp.revoke(driver.Revocation{Lanes: []string{"b"}, Done: make(chan struct{})})
	taken := <-dp.work // a worker takes 0
	dp.takeDone()
	var sd shutdown
	defer sd.stop()
	dp.endGrace(&sd)
	count := map[string]int{}
	for _, job := range []settleJob{dp.io.pending, dp.io.staged} {
		for _, s := range job.batch {
			count[s.Handle.(string)]++
		}
	}
	for id, n := range count {
		if n > 1 {
			t.Errorf("%s settled %d times when the grace ended", id, n)
		}
	}
	if dp.running != 1 {
		t.Errorf("running = %d after the grace ended, want 1 (%s, with its worker)", dp.running, taken.msg.ID)
	}
}

// A revocation waits for the running handlers of its lanes, not for
// deliveries of them that never started: those in a train of unordered
// deliveries behind a slow handler of another lane are let go at once, as
// they are from the ready queue, so that a handler elsewhere (here one that
// does not return until the test ends) does not hold the broker's
// rebalance up.
func TestRevocationDoesNotWaitForTheUnstartedRestOfATrain(t *testing.T) {
	drv := newScriptLog(false)
	// Keyless, so unordered: "slow" takes the rest as its train. (Without
	// trains, "other" would wait in the work queue and lane 1 in the ready
	// queue.)
	msgs := []driver.Message{
		{ID: "slow", Lane: "0", Deliveries: 1, Handle: "slow"},
		{ID: "other", Lane: "0", Deliveries: 1, Handle: "other"},
	}
	for i := range 5 {
		id := "1/" + strconv.Itoa(i)
		msgs = append(msgs, driver.Message{ID: id, Lane: "1", Deliveries: 1, Handle: id})
	}
	drv.push(msgs...)
	l, err := New(drv, WithConcurrency(1), WithMaxInFlight(16), WithOrdering(OrderByKey),
		WithShutdownGrace(50*time.Millisecond), WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan string, 7)
	release := make(chan struct{})
	defer close(release)
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		started <- m.ID
		if m.ID == "slow" {
			<-release // lane 0 is not revoked: it keeps running
		}
		return nil
	}))
	if id := <-started; id != "slow" {
		t.Fatalf("%s ran first, want slow", id)
	}
	testenv.WaitFor(t, 20*time.Second, "all seven to be fetched", func() bool { return l.Stats().Fetched == 7 })
	time.Sleep(20 * time.Millisecond)
	done := make(chan struct{})
	drv.revCh <- driver.Revocation{Lanes: []string{"1"}, Done: done}
	select {
	case <-done:
	case <-time.After(2 * time.Second):
		t.Errorf("the revocation of lane 1, none of whose messages started, was not done 2s later: it waits for lane 0's handler")
	}
	if got := l.Stats().Revoked; got != 5 {
		t.Errorf("Revoked = %d, want the 5 messages of lane 1", got)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}
