package consumer

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
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

// openBreaker returns a breaker that is open now and half-open after
// openFor: one failed call through it opened it.
func openBreaker(t *testing.T, openFor time.Duration, opts ...BreakerOption) *Breaker {
	t.Helper()
	b, err := NewBreaker(append([]BreakerOption{BreakerFailures(1), BreakerOpenFor(openFor)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	fail := b.Wrap(HandlerFunc(func(context.Context, *Message) error { return errors.New("dependency down") }))
	_ = fail.Handle(context.Background(), &Message{})
	if b.State() != BreakerOpen {
		t.Fatalf("breaker %s, want open", b.State())
	}
	return b
}

// In at-most-once mode the loop asks the chain's breakers before the ack.
// When one holds the message there, the handler never ran, yet finish sets
// d.runs from d.msg.Attempt, which call() never set on this delivery: 0 on a
// first delivery, so runs becomes -1 and the next run sees Attempt 0.
func TestAtMostOnceHoldBeforeTheAckKeepsAttemptOne(t *testing.T) {
	drv := newScriptLog(true)
	drv.push(driver.Message{ID: "m", Deliveries: 1, Handle: "m"})
	b := openBreaker(t, 100*time.Millisecond)
	l, err := New(drv, WithConcurrency(1), WithDeliveryMode(AtMostOnce))
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan int, 4)
	stop := runLoop(t, l, Chain(HandlerFunc(func(ctx context.Context, m *Message) error {
		got <- m.Attempt
		return nil
	}), b.Wrap))
	var attempt int
	select {
	case attempt = <-got:
	case <-time.After(10 * time.Second):
		t.Fatal("the held message never ran")
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if l.Stats().Held == 0 {
		t.Fatal("the breaker did not hold the message: the test tested nothing")
	}
	if attempt != 1 {
		t.Fatalf("first run of a message held before its ack saw Attempt %d, want 1", attempt)
	}
}

// failingAckLog fails every Settle while fail is set, after a signal that
// it was called; it holds the Settle until release is closed.
type failingAckLog struct {
	*scriptLog
	called  chan struct{}
	release chan struct{}
	once    sync.Once
}

func (f *failingAckLog) Settle(ctx context.Context, b []driver.Settlement) error {
	first := false
	f.once.Do(func() { first = true })
	if first {
		close(f.called)
		<-f.release
		return errors.New("commit refused: partition revoked")
	}
	return f.scriptLog.Settle(ctx, b)
}

// At most once: the worker reserves a call of every breaker before the ack.
// When the lane is revoked while the ack is with the driver and the ack then
// fails, finish takes the revoked branch (drop) before releaseReservations,
// so the reservation is never given back. A half-open breaker whose one
// trial is that reservation stays half-open for good and holds every later
// message (gobreaker counts the request until its done is called).
func TestRevokedAtMostOnceAckFailureGivesBackTheBreakerCall(t *testing.T) {
	drv := &failingAckLog{scriptLog: newScriptLog(false), called: make(chan struct{}), release: make(chan struct{})}
	b := openBreaker(t, 50*time.Millisecond) // one trial when half-open
	time.Sleep(80 * time.Millisecond)        // half-open now
	drv.push(driver.Message{ID: "A", Lane: "0", Deliveries: 1, Handle: "A"})
	l, err := New(drv, WithConcurrency(2), WithDeliveryMode(AtMostOnce))
	if err != nil {
		t.Fatal(err)
	}
	ran := make(chan string, 4)
	stop := runLoop(t, l, Chain(HandlerFunc(func(ctx context.Context, m *Message) error {
		ran <- m.ID
		return nil
	}), b.Wrap))
	<-drv.called // A's ack is with the driver; A holds the breaker's one trial
	done := make(chan struct{})
	drv.revCh <- driver.Revocation{Lanes: []string{"0"}, Done: done}
	close(drv.release) // the ack fails
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Done never closed")
	}
	drv.push(driver.Message{ID: "B", Lane: "1", Deliveries: 1, Handle: "B"})
	var got string
	select {
	case got = <-ran:
	case <-time.After(3 * time.Second):
	}
	st := b.State()
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if got != "B" {
		t.Fatalf("B never ran (breaker %s, held %d times): the trial reserved for A, whose ack failed after its lane was revoked, was never given back", st, b.Held())
	}
}

// slowFirstSettle holds its first Settle until gate is closed, and signals
// when that Settle began.
type slowFirstSettle struct {
	*scriptLog
	began chan struct{}
	gate  chan struct{}
	once  sync.Once
}

func (s *slowFirstSettle) Settle(ctx context.Context, b []driver.Settlement) error {
	first := false
	s.once.Do(func() { first = true })
	if first {
		close(s.began)
		<-s.gate
	}
	return s.scriptLog.Settle(ctx, b)
}

// At most once, shutdown mid-ack: a message whose ack was only queued (not
// yet sent: an earlier Settle was still being made) when the grace ended is
// still acked after the grace, and its handler then starts with its context
// already cancelled. The message was not started when the grace ended, so
// it should go back (not attempted), not be acked and run on a dead
// context: in a graceful shutdown that is a lost message.
func TestAtMostOnceAckNotSentWhenTheGraceEndsIsNotMade(t *testing.T) {
	drv := &slowFirstSettle{scriptLog: newScriptLog(true), began: make(chan struct{}), gate: make(chan struct{})}
	drv.push(driver.Message{ID: "1", Deliveries: 1, Handle: "1"})
	l, err := New(drv, WithConcurrency(2), WithDeliveryMode(AtMostOnce), WithShutdownGrace(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	startedCancelled := map[string]bool{}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		errc <- l.Run(ctx, HandlerFunc(func(ctx context.Context, m *Message) error {
			mu.Lock()
			startedCancelled[m.ID] = ctx.Err() != nil
			mu.Unlock()
			return nil
		}))
	}()
	<-drv.began // 1's ack is with the driver
	drv.push(driver.Message{ID: "2", Deliveries: 1, Handle: "2"})
	testenv.WaitFor(t, 20*time.Second, "2 to be fetched", func() bool { return l.Stats().Fetched == 2 })
	time.Sleep(100 * time.Millisecond) // its worker asks for its ack, which queues behind 1's
	cancel()
	time.Sleep(200 * time.Millisecond) // the grace is over
	close(drv.gate)
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	acts := drv.outcomes()["2"]
	mu.Lock()
	defer mu.Unlock()
	if len(acts) == 1 && acts[0] == driver.Ack && startedCancelled["2"] {
		t.Fatalf("2 was acked after the grace ended and its handler started on a cancelled context (settled %v)", acts)
	}
}

// At most once: an ack that failed is counted in Stats.Acked, and as a
// handler failure in Stats.Failed, though nothing was acked and no handler
// ran (finish takes the d.acked branch for errAckFailed).
func TestAtMostOnceFailedAckIsNeitherAckedNorAFailureInStats(t *testing.T) {
	drv := &failingAckLog{scriptLog: newScriptLog(true), called: make(chan struct{}), release: make(chan struct{})}
	close(drv.release)
	drv.push(driver.Message{ID: "1", Deliveries: 1, Handle: "1"})
	l, err := New(drv, WithDeliveryMode(AtMostOnce))
	if err != nil {
		t.Fatal(err)
	}
	var ran atomic.Int32
	stop := runLoop(t, l, HandlerFunc(func(context.Context, *Message) error { ran.Add(1); return nil }))
	testenv.WaitFor(t, 20*time.Second, "the message to leave", func() bool { return l.Stats().Fetched == 1 && l.Stats().InFlight == 0 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	s := l.Stats()
	if ran.Load() != 0 {
		t.Fatalf("handler ran after its ack failed")
	}
	if s.Acked != 0 || s.Failed != 0 {
		t.Fatalf("Stats after one failed ack and no run: Acked = %d, Failed = %d, SettleErrors = %d; want Acked 0, Failed 0",
			s.Acked, s.Failed, s.SettleErrors)
	}
}

// At most once: a revocation that arrives after a worker took a delivery
// and before the dispatcher serves its ack request (the worker is in
// reserveGates, here slowed by a breaker's state-change callback) marks the
// delivery revoked, yet ackFirst queues its ack all the same: the loop acks
// a message of a lane it was told it no longer owns, after the revocation,
// and then runs its handler on a cancelled context. ackFirst should answer
// a revoked (or graceOver) delivery's request with false at once.
func TestAtMostOnceRevokedBeforeItsAckIsNotAcked(t *testing.T) {
	inCallback, proceed := make(chan struct{}), make(chan struct{})
	var once sync.Once
	b := openBreaker(t, 50*time.Millisecond, BreakerOnStateChange(func(from, to BreakerState) {
		if to == BreakerHalfOpen {
			once.Do(func() { close(inCallback); <-proceed })
		}
	}))
	time.Sleep(80 * time.Millisecond) // the next Allow turns it half-open
	drv := newScriptLog(false)
	drv.push(driver.Message{ID: "A", Lane: "0", Deliveries: 1, Handle: "A"})
	l, err := New(drv, WithConcurrency(1), WithDeliveryMode(AtMostOnce))
	if err != nil {
		t.Fatal(err)
	}
	var ran atomic.Int32
	stop := runLoop(t, l, Chain(HandlerFunc(func(ctx context.Context, m *Message) error {
		ran.Add(1)
		return nil
	}), b.Wrap))
	<-inCallback // the worker holds A, reserving the breaker's call
	done := make(chan struct{})
	drv.revCh <- driver.Revocation{Lanes: []string{"0"}, Done: done}
	close(proceed)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Done never closed")
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if acts := drv.outcomes()["A"]; len(acts) > 0 {
		t.Errorf("A, whose lane was revoked before its ack was decided, was settled %v (ran %d times)", acts, ran.Load())
	}
}

// At most once, leased broker (SQS): a message whose ack is decided but
// queued behind a Settle still being made is not extended, because
// extendLeases skips every delivery with d.acked set (settle.go:330), and
// ackFirst sets acked as soon as the ack is queued. The driver contract
// (driver.Extender) says the loop extends every message it still holds,
// "waiting for its settlement to be sent" included, and at-least-once
// settlements waiting in pending are extended. Here the ack waits behind a
// slow Settle longer than the lease: the lease runs out, the broker hands
// the message to another consumer, which runs it, and then this loop's ack
// is made (SQS deletes with a stale receipt handle "succeed") and its
// handler runs too: the message runs twice in the at-most-once mode.
func TestAtMostOnceAckQueuedBehindASlowSettleKeepsItsLease(t *testing.T) {
	drv := newLeaseLog(time.Second) // the first Settle hangs until holdOnce closes
	drv.push(driver.Message{ID: "1", Deliveries: 1, Handle: "1"})
	l, err := New(drv, WithConcurrency(2), WithDeliveryMode(AtMostOnce))
	if err != nil {
		t.Fatal(err)
	}
	stop := runLoop(t, l, HandlerFunc(func(context.Context, *Message) error { return nil }))
	released := false
	defer func() {
		if !released {
			close(drv.holdOnce)
		}
	}()
	testenv.WaitFor(t, 20*time.Second, "1's ack to be with the driver", func() bool {
		drv.mu.Lock()
		defer drv.mu.Unlock()
		return drv.settleNum == 1
	})
	drv.push(driver.Message{ID: "2", Deliveries: 1, Handle: "2"})
	testenv.WaitFor(t, 20*time.Second, "2 to be fetched", func() bool { return l.Stats().Fetched == 2 })
	// 2's worker asks for its ack at once; the ack queues behind 1's. Wait
	// two leases: 2's lease must have been extended meanwhile.
	time.Sleep(2 * time.Second)
	n := drv.extensions("2")
	close(drv.holdOnce)
	released = true
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if n == 0 {
		t.Fatalf("2's ack waited 2s (two 1s leases) behind a slow Settle and its lease was never extended: another consumer gets it and both run it")
	}
}

// At most once, shutdown: withdrawAcks (settle.go:218) takes back only the
// acks in io.pending. Since the fix, a settlement is moved to io.staged by
// stage() at the top of the dispatcher's loop and only then offered to the
// settle goroutine in the select; when the grace timer is ready in that
// same select (the choice is random), endGrace runs with the ack staged:
// it is not withdrawn, it is sent after the grace, and the handler then
// starts on a cancelled context, which is the lost message the withdrawal
// was added to prevent (TestAtMostOnceAckNotSentWhenTheGraceEndsIsNotMade).
// This test replays that interleaving on the dispatcher's methods.
func TestAtMostOnceStagedAckIsWithdrawnAtTheGrace(t *testing.T) {
	drv := newScriptLog(true)
	l, err := New(drv, WithDeliveryMode(AtMostOnce), WithShutdownGrace(time.Hour))
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
	// The worker asks for the ack; the dispatcher queues it.
	reply := make(chan error, 1)
	dp.ackFirst(ackRequest{d, reply})
	dp.beginShutdown(&sd)
	// Top of the dispatcher's loop: the ack is staged ...
	if !dp.io.stage() {
		t.Fatal("nothing staged")
	}
	// ... and the select serves the grace timer before the settle goroutine
	// takes the job.
	dp.endGrace(&sd)
	select {
	case err := <-reply:
		if err != errNotStarted {
			t.Fatalf("the worker was told %v, want errNotStarted", err)
		}
	default:
		for _, s := range dp.io.settleJob().batch {
			if s.Handle == "m" && s.Action == driver.Ack {
				t.Fatalf("the grace ended before the ack was sent, yet the ack stays staged (to be made after the grace, its handler then starting on a cancelled context)")
			}
		}
		t.Fatal("the worker waits for an ack that is neither staged nor withdrawn")
	}
}

// settleRecorder keeps every settlement its driver was given.
type settleRecorder struct {
	*scriptLog
	mu  sync.Mutex
	got []driver.Settlement
}

func (s *settleRecorder) Settle(ctx context.Context, b []driver.Settlement) error {
	s.mu.Lock()
	s.got = append(s.got, b...)
	s.mu.Unlock()
	return s.scriptLog.Settle(ctx, b)
}

// The ack an at-most-once delivery gets before its handler runs says so
// (BeforeRun), so that a driver that makes acks durable later (a Kafka
// commit on a timer) makes this one durable before the handler runs; an
// at-least-once ack does not.
func TestAnAckBeforeTheRunSaysSo(t *testing.T) {
	for _, mode := range []DeliveryMode{AtMostOnce, AtLeastOnce} {
		drv := &settleRecorder{scriptLog: newScriptLog(true)}
		drv.push(driver.Message{ID: "m", Deliveries: 1, Handle: "m"})
		l, err := New(drv, WithDeliveryMode(mode))
		if err != nil {
			t.Fatal(err)
		}
		ran := make(chan struct{}, 1)
		stop := runLoop(t, l, HandlerFunc(func(context.Context, *Message) error { ran <- struct{}{}; return nil }))
		<-ran
		testenv.WaitFor(t, 20*time.Second, "the ack", func() bool { drv.mu.Lock(); defer drv.mu.Unlock(); return len(drv.got) == 1 })
		if err := stop(); err != nil {
			t.Fatal(err)
		}
		if got := drv.got[0]; got.Action != driver.Ack || got.BeforeRun != (mode == AtMostOnce) {
			t.Errorf("mode %v: settlement %+v, want an ack with BeforeRun %v", mode, got, mode == AtMostOnce)
		}
	}
}

// lockedBuffer is a bytes.Buffer for a logger that several goroutines use.
type lockedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (w *lockedBuffer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *lockedBuffer) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// At most once, a message whose first run fails after its ack, and whose
// retry inside the chain then meets the breaker that failure opened, is
// lost: the mode allows it, but the loop counts it as dropped (not as held,
// which would say it is kept) and says so in a WARN line naming it.
func TestAtMostOnceMessageHeldAfterItsAckIsCountedAndLoggedAsDropped(t *testing.T) {
	drv := newScriptLog(true)
	drv.push(driver.Message{ID: "lost-one", Deliveries: 1, Handle: "lost-one"})
	b := mustBreaker(t, BreakerFailures(1), BreakerOpenFor(time.Hour))
	rt := mustRetry(t, RetryAttempts(3))
	var slept []time.Duration
	noSleep(rt, &slept)
	var logs lockedBuffer
	l, err := New(drv, WithConcurrency(1), WithDeliveryMode(AtMostOnce),
		WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	stop := runLoop(t, l, Chain(HandlerFunc(func(context.Context, *Message) error {
		runs.Add(1)
		return errors.New("dependency down")
	}), rt.Wrap, b.Wrap))
	testenv.WaitFor(t, 20*time.Second, "the message to be dropped", func() bool { return l.Stats().Dropped == 1 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	st := l.Stats()
	if runs.Load() != 1 || b.State() != BreakerOpen || st.Held != 0 || st.Dropped != 1 {
		t.Fatalf("runs %d, breaker %s, Held %d, Dropped %d; want 1, open, 0, 1", runs.Load(), b.State(), st.Held, st.Dropped)
	}
	if out := logs.String(); !strings.Contains(out, "level=WARN") || !strings.Contains(out, "at-most-once message dropped") ||
		!strings.Contains(out, "id=lost-one") {
		t.Fatalf("no WARN line naming the dropped message; the log was:\n%s", out)
	}
}

// A handler that fails after the ack at a high rate drops every message:
// each is counted, but the log says so a bounded number of times.
func TestAtMostOnceDroppedMessagesAreLoggedRateLimited(t *testing.T) {
	drv := newScriptLog(true)
	drv.add("", 500)
	var logs lockedBuffer
	l, err := New(drv, WithConcurrency(4), WithDeliveryMode(AtMostOnce),
		WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	if err != nil {
		t.Fatal(err)
	}
	stop := runLoop(t, l, HandlerFunc(func(context.Context, *Message) error { return errors.New("sink down") }))
	testenv.WaitFor(t, 20*time.Second, "every message to be dropped", func() bool { return l.Stats().Dropped == 500 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(logs.String(), "at-most-once message dropped"); n < 1 || n > 5 {
		t.Fatalf("%d lines for 500 dropped messages, want 1 to 5", n)
	}
}
