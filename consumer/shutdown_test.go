package consumer

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
)

// A handler that returns nil after the shutdown grace cancelled it may have
// stopped short of its work (some handlers treat cancellation as "not an
// error"): its message is returned for redelivery, never acked.
func TestHandlerReturningAfterGraceIsReturnedNotAcked(t *testing.T) {
	drv := newScriptLog(true)
	drv.add("", 1)
	l, err := New(drv, WithConcurrency(1), WithShutdownGrace(20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		errc <- l.Run(ctx, HandlerFunc(func(ctx context.Context, m *Message) error {
			close(started)
			<-ctx.Done()
			return nil // work abandoned, but "cancelled is not a failure"
		}))
	}()
	<-started
	cancel()
	<-errc
	if acts := drv.outcomes()["/0"]; len(acts) != 1 || acts[0] != driver.Return {
		t.Errorf("message whose handler was cancelled by the grace settled %v, want [Return]", acts)
	}
}

// At most once acks a message when a worker takes it, and a worker takes
// one only when it can run it at once: a clean shutdown never acks a message
// whose handler then never runs.
func TestAtMostOnceShutdownRunsWhatItAcked(t *testing.T) {
	drv := newScriptLog(true)
	drv.add("", 3)
	l, err := New(drv, WithConcurrency(1), WithDeliveryMode(AtMostOnce))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	ran := map[string]bool{}
	release := make(chan struct{})
	started := make(chan struct{}, 3)
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		errc <- l.Run(ctx, HandlerFunc(func(ctx context.Context, m *Message) error {
			mu.Lock()
			ran[m.ID] = true
			mu.Unlock()
			started <- struct{}{}
			<-release
			return nil
		}))
	}()
	<-started
	time.Sleep(50 * time.Millisecond)
	cancel()
	time.Sleep(20 * time.Millisecond)
	close(release)
	<-errc
	for id, acts := range drv.outcomes() {
		if len(acts) == 1 && acts[0] == driver.Ack && !ran[id] {
			t.Errorf("%s was acked at a clean shutdown but its handler never ran", id)
		}
	}
}

func TestGraceOverCancelsHandlersAndLeavesTheirMessages(t *testing.T) {
	drv := newScriptLog(true)
	drv.add("", 1)
	l, err := New(drv, WithConcurrency(1), WithShutdownGrace(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		errc <- l.Run(ctx, HandlerFunc(func(ctx context.Context, m *Message) error {
			close(started)
			<-ctx.Done() // a long handler that honours cancellation
			return ctx.Err()
		}))
	}()
	<-started
	cancel()
	select {
	case err := <-errc:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Run did not return after the grace period")
	}
	if acts := drv.outcomes()["/0"]; len(acts) != 1 || acts[0] != driver.Return {
		t.Fatalf("the cancelled handler's message settled %v, want a return", acts)
	}
}

// settlements returns every settlement of the message with handle id.
func (s *scriptLog) settlements(id string) []driver.Settlement {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []driver.Settlement
	for _, st := range s.settled {
		if st.Handle.(string) == id {
			out = append(out, st)
		}
	}
	return out
}

// Cancelling Run's context stops fetching and runs what was already
// fetched, within the grace: the messages queued behind a busy key and those
// waiting for a worker run (in order) and are acked. Nothing is handed back,
// since every message handed back counts as a delivery on SQS and RabbitMQ
// and would cost it one of its retries.
func TestShutdownRunsWhatWasFetched(t *testing.T) {
	drv := newScriptLog(true)
	drv.add("3", 3) // 3/0 runs, 3/1 and 3/2 queue behind it
	drv.add("4", 2)
	drv.add("", 4)
	l, err := New(drv, WithConcurrency(1), WithMaxInFlight(16), WithShutdownGrace(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	var mu sync.Mutex
	var ran []string
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		errc <- l.Run(ctx, HandlerFunc(func(ctx context.Context, m *Message) error {
			<-release
			mu.Lock()
			ran = append(ran, m.ID)
			mu.Unlock()
			return nil
		}))
	}()
	testenv.WaitFor(t, 20*time.Second, "all nine to be fetched", func() bool { return l.Stats().Fetched == 9 })
	cancel()
	time.Sleep(50 * time.Millisecond) // let the loop see the cancellation first
	close(release)
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	for id, acts := range drv.outcomes() {
		if len(acts) != 1 || acts[0] != driver.Ack {
			t.Errorf("message %s settled %v at a graceful shutdown, want one ack", id, acts)
		}
	}
	if len(ran) != 9 {
		t.Fatalf("%d of 9 fetched messages ran before Run returned: %v", len(ran), ran)
	}
	pos := map[string]int{}
	for i, id := range ran {
		pos[id] = i
	}
	if !(pos["3/0"] < pos["3/1"] && pos["3/1"] < pos["3/2"] && pos["4/0"] < pos["4/1"]) {
		t.Errorf("lanes ran out of order while draining: %v", ran)
	}
	if got := l.Stats().InFlight; got != 0 {
		t.Errorf("InFlight = %d after Run returned, want 0", got)
	}
}

// When the grace ends, running handlers are cancelled and their messages
// go back (attempted); what never started goes back marked not attempted,
// so a broker that can return a message without counting a delivery does.
func TestGraceEndHandsBackWhatDidNotStartNotAttempted(t *testing.T) {
	drv := newScriptLog(true)
	drv.add("3", 3)
	drv.add("", 3)
	l, err := New(drv, WithConcurrency(1), WithMaxInFlight(16), WithShutdownGrace(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan string, 10)
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		errc <- l.Run(ctx, HandlerFunc(func(ctx context.Context, m *Message) error {
			started <- m.ID
			<-ctx.Done() // a long handler that honours cancellation
			return ctx.Err()
		}))
	}()
	first := <-started
	testenv.WaitFor(t, 20*time.Second, "all six to be fetched", func() bool { return l.Stats().Fetched == 6 })
	cancel()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	for id := range drv.outcomes() {
		st := drv.settlements(id)
		if len(st) != 1 || st[0].Action != driver.Return {
			t.Fatalf("%s settled %+v, want one return", id, st)
		}
		if want := id != first; st[0].NotAttempted != want {
			t.Errorf("%s returned with NotAttempted %v, want %v (the one that ran is %s)", id, st[0].NotAttempted, want, first)
		}
	}
	if n := len(drv.outcomes()); n != 6 {
		t.Fatalf("%d of 6 fetched messages settled", n)
	}
	if got := l.Stats().InFlight; got != 0 {
		t.Errorf("InFlight = %d after Run returned, want 0", got)
	}
}

// What waits in the loop to run later (here a message held by an open
// breaker for a minute) goes back at once when Run's context ends, with the
// time it had left to wait, not attempted; Run does not wait out the hold.
func TestShutdownReturnsWaitingMessagesAtOnceWithTheirDelay(t *testing.T) {
	drv := newScriptLog(true)
	drv.add("", 1)
	l, err := New(drv, WithConcurrency(1), WithShutdownGrace(30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	held := make(chan struct{})
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		close(held)
		return Hold(errors.New("dependency down"), time.Minute)
	}))
	<-held
	testenv.WaitFor(t, 20*time.Second, "the hold to be applied", func() bool { return l.Stats().Held == 1 })
	start := time.Now()
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if waited := time.Since(start); waited > 10*time.Second {
		t.Fatalf("Run took %s to return with only a held message, want it to return without waiting out the hold", waited)
	}
	st := drv.settlements("/0")
	if len(st) != 1 || st[0].Action != driver.Return || !st[0].NotAttempted || st[0].Delay < 50*time.Second || st[0].Delay > time.Minute {
		t.Fatalf("held message settled %+v, want one return, not attempted, with its remaining minute", st)
	}
}

// hungSettle is a driver whose Settle hangs until its context ends.
type hungSettle struct {
	*scriptLog
	calls atomic.Int32
}

func (h *hungSettle) Settle(ctx context.Context, b []driver.Settlement) error {
	h.calls.Add(1)
	<-ctx.Done()
	return ctx.Err()
}

// A Settle that hangs does not hold a shutdown for its 30 s call timeout:
// Run returns a second after the grace, cancelling the call.
func TestShutdownDoesNotWaitOnAHungSettle(t *testing.T) {
	drv := &hungSettle{scriptLog: newScriptLog(true)}
	drv.add("", 1)
	l, err := New(drv, WithShutdownGrace(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	stop := runLoop(t, l, HandlerFunc(func(context.Context, *Message) error { return nil }))
	testenv.WaitFor(t, 20*time.Second, "the ack to reach Settle", func() bool { return drv.calls.Load() == 1 })
	start := time.Now()
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if waited := time.Since(start); waited > 10*time.Second {
		t.Fatalf("Run took %s to return behind a hung Settle, want about the grace plus a second", waited)
	}
}

// A handler that returned nil before the grace ended, on a live context, is
// returned instead of acked when the dispatcher happens to serve the grace
// timer before that handler's done (both ready in one select: the choice is
// random): finish decides "returned after its context was cancelled" from
// graceOver at the time it runs, not from when the handler returned. The
// message then runs again although it finished in time (contract 8: "acks
// what finished"). The worker should note, as the handler returns, whether
// the grace was over then. This test replays that interleaving.
func TestHandlerThatFinishedBeforeTheGraceIsAcked(t *testing.T) {
	drv := newScriptLog(true)
	l, err := New(drv, WithShutdownGrace(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	dp := newDispatcher(context.Background(), l, HandlerFunc(func(context.Context, *Message) error { return nil }), nil)
	defer dp.cancelHandler()
	defer dp.io.cancel()
	var sd shutdown
	defer sd.stop()
	d := newDelivery(new(deliverySlab), &driver.Message{ID: "m", Deliveries: 1, Handle: "m"}, nil)
	dp.l.inflight.Add(1)
	dp.admit(d)
	dp.ready = dp.ready[1:]
	d.state = stateRunning
	dp.running++
	dp.beginShutdown(&sd)
	// The worker ran the handler (as worker() does), which returned nil
	// with its context still live, and put d in its box ...
	_, d.err = dp.call(d, monoNow())
	// ... but the dispatcher served the grace timer first.
	dp.endGrace(&sd)
	dp.running--
	dp.finish(d)
	if n := len(dp.io.pending.batch); n != 1 || dp.io.pending.batch[0].Action != driver.Ack {
		t.Fatalf("a handler that returned nil before the grace ended was settled %+v, want an ack", dp.io.pending.batch)
	}
}

// Revocation then shutdown: a delivery of the revoked lane that sits in
// the work queue (a worker stuck in a handler that ignores its context
// never takes it) is not settled when the grace ends. endGrace once
// reclaimed it and settled it with a Return, breaking "the loop settles
// nothing for [revoked lanes]" (driver.Revoker); now the revocation itself
// takes it out of the work queue and drops it (reclaimWork), and endGrace's
// reclaim drops a revoked delivery too (returnUnstarted).
func TestRevokedDeliveryInTheWorkQueueIsNotSettledAtTheGrace(t *testing.T) {
	drv := newScriptLog(true)
	drv.push(
		driver.Message{ID: "A", Lane: "0", Deliveries: 1, Handle: "A"},
		driver.Message{ID: "B", Lane: "1", Deliveries: 1, Handle: "B"},
	)
	l, err := New(drv, WithConcurrency(1), WithShutdownGrace(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan string, 2)
	release := make(chan struct{})
	defer close(release)
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		started <- m.ID
		<-release // ignores its context
		return nil
	}))
	if id := <-started; id != "A" {
		t.Fatalf("%s ran first, want A", id)
	}
	testenv.WaitFor(t, 20*time.Second, "B to be fetched", func() bool { return l.Stats().Fetched == 2 })
	time.Sleep(50 * time.Millisecond) // B goes into the work queue (room for one), behind the stuck worker
	done := make(chan struct{})
	drv.revCh <- driver.Revocation{Lanes: []string{"1"}, Done: done}
	if err := stop(); err != nil { // the grace ends, A is abandoned
		t.Fatal(err)
	}
	if acts := drv.outcomes()["B"]; len(acts) > 0 {
		t.Fatalf("B, whose lane was revoked, was settled %v at the end of the grace", acts)
	}
}

// pushingLog is a log whose broker pushed one more delivery ahead of Fetch,
// which only Drain hands over.
type pushingLog struct {
	*scriptLog
	drained atomic.Int32
}

func (p *pushingLog) Drain(_ context.Context, dst []driver.Message) ([]driver.Message, error) {
	if p.drained.Add(1) > 1 {
		return dst, nil
	}
	return append(dst, driver.Message{ID: "pushed", Deliveries: 1, Handle: "pushed"}), nil
}

// When Run stops, what the broker pushed ahead of Fetch (Drain) runs within
// the grace and is acked, instead of going back to the broker.
func TestStoppingRunsWhatTheBrokerPushedAhead(t *testing.T) {
	drv := &pushingLog{scriptLog: newScriptLog(true)}
	drv.push(driver.Message{ID: "fetched", Deliveries: 1, Handle: "fetched"})
	l, err := New(drv)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	ran := map[string]bool{}
	stop := runLoop(t, l, HandlerFunc(func(_ context.Context, m *Message) error {
		mu.Lock()
		ran[m.ID] = true
		mu.Unlock()
		return nil
	}))
	testenv.WaitFor(t, 20*time.Second, "the fetched message to run", func() bool { mu.Lock(); defer mu.Unlock(); return ran["fetched"] })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if drv.drained.Load() != 1 {
		t.Fatalf("Drain called %d times, want once", drv.drained.Load())
	}
	if acts := drv.outcomes()["pushed"]; !ran["pushed"] || len(acts) != 1 || acts[0] != driver.Ack {
		t.Fatalf("the pushed delivery ran %v and was settled %v, want run and acked", ran["pushed"], acts)
	}
}
