package consumer

import (
	"context"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
)

// A running delivery revoked twice (a lost channel, then a lost connection)
// is awaited by both revocations: each Done closes when it returns.
func TestSecondRevocationOfALaneClosesBothDones(t *testing.T) {
	drv := newScriptLog(false)
	drv.push(driver.Message{ID: "A", Lane: "0", Deliveries: 1, Handle: "A"})
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

type slowSettle struct {
	*scriptLog
	gate     chan struct{}
	once     sync.Once
	mu       sync.Mutex
	revDone  chan struct{}
	lateAcks []any
}

func (s *slowSettle) Settle(ctx context.Context, b []driver.Settlement) error {
	s.once.Do(func() { <-s.gate }) // the first Settle is slow (a broker round trip)
	s.mu.Lock()
	if s.revDone != nil {
		select {
		case <-s.revDone:
			for _, st := range b {
				if st.Handle == "A" {
					s.lateAcks = append(s.lateAcks, st.Handle)
				}
			}
		default:
		}
	}
	s.mu.Unlock()
	return s.scriptLog.Settle(ctx, b)
}

// A revocation's Done waits until the outcomes decided before it (an ack of
// the revoked lane waiting behind a slow Settle) have reached the driver:
// a Kafka rebalance callback that commits what finished must see them, and
// no ack may reach the driver for a lane the consumer no longer owns.
func TestRevocationDoneWaitsForDecidedAcks(t *testing.T) {
	drv := &slowSettle{scriptLog: newScriptLog(false), gate: make(chan struct{})}
	drv.push(driver.Message{ID: "X", Lane: "1", Deliveries: 1, Handle: "X"})
	l, err := New(drv, WithConcurrency(2))
	if err != nil {
		t.Fatal(err)
	}
	var handled atomic.Int32
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error { handled.Add(1); return nil }))
	testenv.WaitFor(t, 20*time.Second, "X handled", func() bool { return handled.Load() == 1 })
	time.Sleep(20 * time.Millisecond) // X's ack is decided; the settler is now stuck in the first Settle
	drv.push(driver.Message{ID: "A", Lane: "0", Deliveries: 1, Handle: "A"})
	testenv.WaitFor(t, 20*time.Second, "A's handler succeeded", func() bool { return handled.Load() == 2 })
	time.Sleep(20 * time.Millisecond) // A's ack is decided, queued behind the slow Settle
	done := make(chan struct{})
	drv.mu.Lock()
	drv.revDone = done
	drv.mu.Unlock()
	drv.revCh <- driver.Revocation{Lanes: []string{"0"}, Done: done}
	select {
	case <-done:
		t.Fatal("Done closed while the ack of A, decided before the revocation, had not reached the driver")
	case <-time.After(100 * time.Millisecond):
	}
	close(drv.gate) // the slow Settle completes; A's ack goes out, then Done closes
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("Done never closed")
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if acts := drv.outcomes()["A"]; len(acts) != 1 || acts[0] != driver.Ack {
		t.Errorf("A settled %v, want one ack before Done", acts)
	}
	if len(drv.lateAcks) > 0 {
		t.Errorf("Ack of %v reached the driver after the revocation of its lane was declared done", drv.lateAcks)
	}
}

func TestRevocationCancelsHandlersAndSettlesNothing(t *testing.T) {
	drv := newScriptLog(false)
	drv.add("0", 3)
	l, err := New(drv, WithConcurrency(2))
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan struct{}, 10)
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		if m.Lane == "0" {
			started <- struct{}{}
			<-ctx.Done() // blocks until the lane is revoked
			return ctx.Err()
		}
		return nil
	}))
	<-started
	done := make(chan struct{})
	drv.revCh <- driver.Revocation{Lanes: []string{"0"}, Done: done}
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("revocation was never completed")
	}
	drv.add("1", 5)
	testenv.WaitFor(t, 20*time.Second, "lane 1 is acked", func() bool { return l.Stats().Acked == 5 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	for id, acts := range drv.outcomes() {
		if id[0] == '0' {
			t.Fatalf("revoked record %s was settled: %v", id, acts)
		}
	}
	if got := l.Stats().Revoked; got != 3 {
		t.Fatalf("Revoked = %d, want 3 (one running, two queued behind it)", got)
	}
	if l.Stats().InFlight != 0 {
		t.Fatalf("InFlight = %d after revocation and shutdown, want 0", l.Stats().InFlight)
	}
}

// In at-most-once mode a running handler of a revoked lane is still waited
// for: Done closes only after it returns, and when it returns it does not
// release the key that the lane's next generation now owns (which would let
// a later message of the key start while an earlier one runs).
func TestAtMostOnceRevocationWaitsForRunningHandlers(t *testing.T) {
	drv := newScriptLog(false)
	msg := func(id string) driver.Message {
		return driver.Message{ID: id, Lane: "0", Offset: -1, Deliveries: 1, Handle: id}
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

// staleBatchLog hands out nothing until released, then a batch fetched
// before lane 0's revocation (generation 1) and one of its next assignment
// (generation 2): what a Kafka Fetch returns when a rebalance happens while
// its records are on their way to the loop.
type staleBatchLog struct {
	*scriptLog
	release chan struct{}
	once    bool
}

func (s *staleBatchLog) Fetch(ctx context.Context, dst []driver.Message, max int) ([]driver.Message, error) {
	if !s.once {
		s.once = true
		select {
		case <-s.release:
		case <-ctx.Done():
			return dst, ctx.Err()
		}
		return append(dst,
			driver.Message{ID: "old", Lane: "0", Offset: 7, Deliveries: 1, Handle: "old", Generation: 1},
			driver.Message{ID: "new", Lane: "0", Offset: 7, Deliveries: 1, Handle: "new", Generation: 2},
		), nil
	}
	<-ctx.Done()
	return dst, ctx.Err()
}

// TestMessagesOfARevokedGenerationAreDropped: a message fetched under a lane
// generation that a revocation ended (Revocation.Before) and handed over
// after it is neither run nor settled; one of the lane's next generation
// runs.
func TestMessagesOfARevokedGenerationAreDropped(t *testing.T) {
	drv := &staleBatchLog{scriptLog: newScriptLog(false), release: make(chan struct{})}
	l, err := New(drv)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var ran []string
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		mu.Lock()
		ran = append(ran, m.ID)
		mu.Unlock()
		return nil
	}))
	done := make(chan struct{})
	drv.revCh <- driver.Revocation{Lanes: []string{"0"}, Done: done, Before: 2}
	<-done
	close(drv.release)
	testenv.WaitFor(t, 20*time.Second, "both messages admitted", func() bool { return l.Stats().Fetched == 2 && l.Stats().InFlight == 0 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(ran, []string{"new"}) {
		t.Errorf("ran %v, want only the message of the new generation", ran)
	}
	out := drv.outcomes()
	if len(out["old"]) != 0 {
		t.Errorf("the stale message was settled %v", out["old"])
	}
	if got := l.Stats().Revoked; got != 1 {
		t.Errorf("Revoked = %d, want 1", got)
	}
}

// A revocation does not wait for a worker to come free: deliveries of the
// revoked lane that sit in the work queue (here behind the one worker, busy
// with a handler of another lane that does not return until the test ends),
// trains of their keys with them, are let go at once and never run. Found
// when every Kafka rebalance of a consumer whose workers were all busy
// elsewhere waited out the driver's whole revocation wait.
func TestRevocationDoesNotWaitForAWorkerToTakeItsWork(t *testing.T) {
	drv := newScriptLog(false)
	msgs := []driver.Message{{ID: "slow", Lane: "0", Key: "a", Deliveries: 1, Handle: "slow"}}
	for i := range 5 {
		id := "1/" + strconv.Itoa(i)
		msgs = append(msgs, driver.Message{ID: id, Lane: "1", Key: "b", Deliveries: 1, Handle: id})
	}
	msgs = append(msgs, driver.Message{ID: "0/after", Lane: "0", Key: "c", Deliveries: 1, Handle: "0/after"})
	drv.push(msgs...)
	l, err := New(drv, WithConcurrency(1), WithMaxInFlight(16), WithOrdering(OrderByKey),
		WithShutdownGrace(50*time.Millisecond), WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan string, len(msgs))
	release := make(chan struct{})
	releaseOnce := sync.OnceFunc(func() { close(release) })
	stop := sync.OnceValue(runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		started <- m.ID
		if m.ID == "slow" {
			<-release // lane 0 is not revoked: it keeps running
		}
		return nil
	})))
	// On a failure too, the stuck handler returns, then the loop stops.
	defer stop()
	defer releaseOnce()
	if id := <-started; id != "slow" {
		t.Fatalf("%s ran first, want slow", id)
	}
	// 1/0 goes to the work queue (room for one) with 1/1-1/4, its key's
	// train; 0/after waits in the ready queue.
	testenv.WaitFor(t, 20*time.Second, "all to be fetched", func() bool { return l.Stats().Fetched == int64(len(msgs)) })
	time.Sleep(20 * time.Millisecond)
	done := make(chan struct{})
	drv.revCh <- driver.Revocation{Lanes: []string{"1"}, Done: done}
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("the revocation of lane 1, none of whose messages started, was not done 5s later: it waits for a worker to take lane 1's work")
	}
	if got := l.Stats().Revoked; got != 5 {
		t.Errorf("Revoked = %d, want the 5 messages of lane 1", got)
	}
	releaseOnce()
	testenv.WaitFor(t, 20*time.Second, "lane 0's second message to run", func() bool { return len(drv.outcomes()["0/after"]) == 1 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	close(started)
	for id := range started {
		if strings.HasPrefix(id, "1/") {
			t.Errorf("%s of the revoked lane ran", id)
		}
	}
	for id, acts := range drv.outcomes() {
		if strings.HasPrefix(id, "1/") {
			t.Errorf("%s of the revoked lane settled %v", id, acts)
		}
	}
}
