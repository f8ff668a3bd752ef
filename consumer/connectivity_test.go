package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
)

// connectLog is a scriptLog whose Connect fails while down is set, with
// err, and answers once it is cleared.
type connectLog struct {
	*scriptLog
	down     atomic.Bool
	err      error
	connects atomic.Int32
}

func (c *connectLog) Connect(ctx context.Context) error {
	c.connects.Add(1)
	if c.down.Load() {
		return c.err
	}
	return nil
}

func (c *connectLog) Capabilities() driver.Capabilities {
	return driver.Capabilities{Redelivers: c.redelivers, Source: "orders"}
}

// probe answers what a liveness and a readiness probe would see.
func probe(l *Loop) (live, ready int) {
	rec := httptest.NewRecorder()
	LivenessHandler(l).ServeHTTP(rec, httptest.NewRequest("GET", "/livez", nil))
	live = rec.Code
	rec = httptest.NewRecorder()
	ReadinessHandler(l).ServeHTTP(rec, httptest.NewRequest("GET", "/readyz", nil))
	return live, rec.Code
}

func waitHealth(t *testing.T, l *Loop, want HealthState) Health {
	t.Helper()
	var h Health
	testenv.WaitFor(t, 20*time.Second, fmt.Sprintf("health %q", want), func() bool { h = l.Health(); return h.State == want })
	return h
}

// A consumer whose broker is down at the start says so at once: a WARN
// naming the source and the cause, health disconnected (not ready, but
// alive: a restart would not bring the broker back), a fetch error counted.
// When the broker comes, it consumes and says so.
func TestUnreachableBrokerAtStartIsReportedAndRetried(t *testing.T) {
	drv := &connectLog{scriptLog: newScriptLog(true),
		err: fmt.Errorf("dial tcp 127.0.0.1:1: connection refused: %w", ErrUnreachable)}
	drv.down.Store(true)
	var logs lockedBuffer
	l, err := New(drv, WithName("billing"), WithFetchBackoff(20*time.Millisecond),
		WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	if err != nil {
		t.Fatal(err)
	}
	if h := l.Health(); h.State != HealthStarting || h.Ready || !h.Live {
		t.Fatalf("before Run: %+v, want starting, not ready, live", h)
	}
	stop := runLoop(t, l, HandlerFunc(func(context.Context, *Message) error { return nil }))
	h := waitHealth(t, l, HealthDisconnected)
	if !strings.Contains(h.Error, "connection refused") || h.Source != "orders" {
		t.Fatalf("disconnected health %+v: want the cause and the source", h)
	}
	if live, ready := probe(l); live != http.StatusOK || ready != http.StatusServiceUnavailable {
		t.Fatalf("disconnected: liveness %d, readiness %d; want 200, 503", live, ready)
	}
	testenv.WaitFor(t, 20*time.Second, "a few retries", func() bool { return drv.connects.Load() >= 5 })
	out := logs.String()
	if n := strings.Count(out, "cannot consume: the broker is unreachable"); n < 1 || n > 5 {
		t.Fatalf("%d WARN lines for %d failed connects, want 1 to 5 (rate-limited):\n%s", n, drv.connects.Load(), out)
	}
	if !strings.Contains(out, "level=WARN") || !strings.Contains(out, "source=orders") {
		t.Fatalf("the WARN line does not name the source:\n%s", out)
	}
	if l.Stats().FetchErrors < 5 {
		t.Errorf("FetchErrors = %d, want every failed connect counted", l.Stats().FetchErrors)
	}
	drv.down.Store(false)
	drv.add("", 3)
	testenv.WaitFor(t, 20*time.Second, "the messages to be acked", func() bool { return l.Stats().Acked == 3 })
	if h := l.Health(); h.State == HealthDisconnected || h.State == HealthStarting || h.Error != "" {
		t.Fatalf("after the broker came: %+v", h)
	}
	if !strings.Contains(logs.String(), "consuming again") {
		t.Errorf("no line says it consumes again:\n%s", logs.String())
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

// A Fetch that fails mid-run (a lost connection) turns the health
// disconnected until a Fetch answers again.
func TestFetchFailureMidRunIsDisconnectedUntilAFetchAnswers(t *testing.T) {
	drv := newScriptLog(true)
	l, err := New(drv, WithFetchBackoff(10*time.Millisecond), WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	stop := runLoop(t, l, HandlerFunc(func(context.Context, *Message) error { return nil }))
	drv.add("", 1)
	testenv.WaitFor(t, 20*time.Second, "the first ack", func() bool { return l.Stats().Acked == 1 })
	drv.mu.Lock()
	for range 50 {
		drv.fetchErrs = append(drv.fetchErrs, fmt.Errorf("read: connection reset: %w", ErrUnreachable))
	}
	drv.mu.Unlock()
	drv.add("", 0)
	h := waitHealth(t, l, HealthDisconnected)
	if !strings.Contains(h.Reason, "unreachable") {
		t.Fatalf("reason %q does not name the cause", h.Reason)
	}
	drv.add("", 1)
	testenv.WaitFor(t, 20*time.Second, "the second ack", func() bool { return l.Stats().Acked == 2 })
	if h := l.Health(); h.State == HealthDisconnected {
		t.Fatalf("still disconnected after a fetch answered: %+v", h)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

// A refusal no retry can fix ends Run with the error, and the consumer is
// then stopped: not live, not ready, with the error in its health.
func TestFatalRefusalStopsRunAndFailsLiveness(t *testing.T) {
	drv := &connectLog{scriptLog: newScriptLog(true),
		err: driver.Fatal(fmt.Errorf("SASL authentication failed: %w", ErrRefused))}
	drv.down.Store(true)
	l, err := New(drv, WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	err = l.Run(context.Background(), HandlerFunc(func(context.Context, *Message) error { return nil }))
	if !errors.Is(err, ErrRefused) {
		t.Fatalf("Run = %v, want ErrRefused", err)
	}
	h := l.Health()
	if h.State != HealthStopped || h.Live || h.Ready || !strings.Contains(h.Error, "SASL") {
		t.Fatalf("after Run returned: %+v", h)
	}
	if live, ready := probe(l); live != http.StatusServiceUnavailable || ready != http.StatusServiceUnavailable {
		t.Fatalf("stopped: liveness %d, readiness %d; want 503, 503", live, ready)
	}
}

// A driver that blocks in its first Fetch without a word (no Connect) is
// reported once the report delay is over.
func TestSilentStartIsReportedAfterTheReportDelay(t *testing.T) {
	drv := newScriptLog(true) // no messages: Fetch blocks
	var logs lockedBuffer
	l, err := New(drv, WithReportAfter(50*time.Millisecond), WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	if err != nil {
		t.Fatal(err)
	}
	stop := runLoop(t, l, HandlerFunc(func(context.Context, *Message) error { return nil }))
	testenv.WaitFor(t, 20*time.Second, "the WARN line", func() bool { return strings.Contains(logs.String(), "has not answered since the start") })
	if h := l.Health(); h.State != HealthStarting || h.Ready || !h.Live {
		t.Fatalf("silent start: %+v, want starting, not ready, live", h)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(logs.String(), "has not answered"); n != 1 {
		t.Fatalf("%d slow-start lines, want 1", n)
	}
}

// An open breaker is the system working: it fails readiness, never
// liveness.
func TestOpenBreakerIsLiveButNotReady(t *testing.T) {
	drv := newScriptLog(true)
	drv.add("", 20)
	b := mustBreaker(t, BreakerFailures(2), BreakerOpenFor(time.Hour))
	l, err := New(drv, WithConcurrency(1), WithHealthWindow(20*time.Millisecond, 3), WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	stop := runLoop(t, l, b.Wrap(HandlerFunc(func(context.Context, *Message) error { return errDown })))
	waitHealth(t, l, HealthProtected)
	if live, ready := probe(l); live != http.StatusOK || ready != http.StatusServiceUnavailable {
		t.Fatalf("protected: liveness %d, readiness %d; want 200, 503", live, ready)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

// A handler that hangs, ignoring its context, while messages wait: no
// progress past WithWedgedAfter makes the consumer wedged, and only then
// does liveness fail.
func TestHangingHandlerIsWedgedAndFailsLiveness(t *testing.T) {
	drv := newScriptLog(true)
	drv.add("", 5)
	release := make(chan struct{})
	var once sync.Once
	defer once.Do(func() { close(release) })
	l, err := New(drv, WithConcurrency(1), WithMaxInFlight(2), WithHealthWindow(20*time.Millisecond, 3),
		WithWedgedAfter(300*time.Millisecond), WithShutdownGrace(10*time.Millisecond), WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	stop := runLoop(t, l, HandlerFunc(func(context.Context, *Message) error { <-release; return nil }))
	testenv.WaitFor(t, 20*time.Second, "the handler to hang", func() bool { return l.Stats().Running == 1 })
	if live, _ := probe(l); live != http.StatusOK {
		t.Fatalf("liveness %d while the hang is younger than WithWedgedAfter, want 200", live)
	}
	h := waitHealth(t, l, HealthWedged)
	if h.Live {
		t.Fatalf("wedged but live: %+v", h)
	}
	if live, _ := probe(l); live != http.StatusServiceUnavailable {
		t.Fatalf("wedged: liveness %d, want 503", live)
	}
	once.Do(func() { close(release) })
	testenv.WaitFor(t, 20*time.Second, "progress again", func() bool { return l.Health().State != HealthWedged })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

// A dead-letter destination that refuses every publish turns the health
// "dead-letter failing" while the messages go back to the broker.
func TestDeadLetterPublishFailingShowsInHealth(t *testing.T) {
	drv := newScriptLog(true)
	drv.add("", 3)
	pub := &recordingPublisher{down: true}
	dl, err := NewDeadLetter(pub, "orders-dlq", DeadLetterLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	l, err := New(drv, WithHealthWindow(20*time.Millisecond, 5), WithRedeliveryBackoff(time.Millisecond, 5*time.Millisecond),
		WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	stop := runLoop(t, l, dl.Wrap(HandlerFunc(func(context.Context, *Message) error { return Permanent(errors.New("bad input")) })))
	// More keep coming: the state is of the health window, and failures
	// that all came before its first sample would show in none.
	feeding := make(chan struct{})
	defer close(feeding)
	go func() {
		for {
			select {
			case <-feeding:
				return
			case <-time.After(10 * time.Millisecond):
				drv.add("", 1)
			}
		}
	}()
	h := waitHealth(t, l, HealthDeadLetterFailing)
	if h.Ready || !h.Live {
		t.Fatalf("dead-letter failing: %+v, want not ready, live", h)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

// failingExtendLog is a scriptLog with a lease whose extensions and
// settlements all fail.
type failingExtendLog struct{ *scriptLog }

func (f *failingExtendLog) Lease() time.Duration { return time.Second }

func (f *failingExtendLog) Extend(context.Context, []any, time.Duration) error {
	return errors.New("visibility change refused")
}

func (f *failingExtendLog) Settle(context.Context, []driver.Settlement) error {
	return errors.New("delete refused")
}

// Extensions and settlements that keep failing (every tick, every batch)
// are each logged at WARN, a few times a minute, naming the error.
func TestFailingExtensionsAndSettlementsAreLoggedRateLimited(t *testing.T) {
	drv := &failingExtendLog{scriptLog: newScriptLog(true)}
	drv.add("", 200)
	var logs lockedBuffer
	l, err := New(drv, WithConcurrency(4), WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	var slow atomic.Int32
	stop := runLoop(t, l, HandlerFunc(func(context.Context, *Message) error {
		if slow.Add(1) <= 4 {
			<-release // long enough for the lease to need extending
		}
		return nil
	}))
	testenv.WaitFor(t, 20*time.Second, "extensions to fail", func() bool { return strings.Count(logs.String(), "extending leases failed") >= 1 })
	time.Sleep(2 * time.Second) // more ticks, more failures
	close(release)
	testenv.WaitFor(t, 20*time.Second, "settlements to fail", func() bool { return l.Stats().SettleErrors >= 10 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	out := logs.String()
	for line, most := range map[string]int{"extending leases failed": 5, "settling failed": 5} {
		if n := strings.Count(out, line); n < 1 || n > most {
			t.Errorf("%q: %d lines for %d failed calls, want 1 to %d", line, n, l.Stats().SettleErrors, most)
		}
	}
	if !strings.Contains(out, "visibility change refused") || !strings.Contains(out, "delete refused") {
		t.Errorf("the lines do not name the errors:\n%s", out)
	}
}

// A revocation (a rebalance, a lost channel) is said at INFO, naming the
// lanes, once per revocation and a bounded number of times a minute.
func TestRevocationsAreLoggedAtInfo(t *testing.T) {
	drv := newScriptLog(false)
	var logs lockedBuffer
	l, err := New(drv, WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	if err != nil {
		t.Fatal(err)
	}
	stop := runLoop(t, l, HandlerFunc(func(context.Context, *Message) error { return nil }))
	for range 30 {
		done := make(chan struct{})
		drv.revCh <- driver.Revocation{Lanes: []string{"3"}, Done: done}
		<-done
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	out := logs.String()
	n := strings.Count(out, "the broker took lanes away")
	if n < 1 || n > 5 || !strings.Contains(out, "level=INFO") || !strings.Contains(out, "lanes=[3]") {
		t.Fatalf("%d revocation lines for 30 revocations, want 1 to 5 at INFO naming the lane:\n%s", n, out)
	}
}
