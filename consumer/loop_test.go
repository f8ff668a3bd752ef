package consumer

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
)

// scriptLog is a driver shaped like a partitioned log (it cannot take a
// message back, and it revokes lanes) for the loop paths that a queue
// broker never reaches. The memory broker and the conformance suite cover
// the queue paths against real queue semantics.
type scriptLog struct {
	mu         sync.Mutex
	pending    []driver.Message
	settled    []driver.Settlement
	fetchErrs  []error
	revCh      chan driver.Revocation
	notify     chan struct{}
	redelivers bool
	closed     bool
}

func newScriptLog(redelivers bool) *scriptLog {
	return &scriptLog{revCh: make(chan driver.Revocation), notify: make(chan struct{}, 1), redelivers: redelivers}
}

func (s *scriptLog) add(lane string, n int) {
	s.mu.Lock()
	for i := 0; i < n; i++ {
		s.pending = append(s.pending, driver.Message{
			ID: lane + "/" + strconv.Itoa(i), Lane: lane, Offset: int64(i), Attempt: 1,
			Handle: lane + "/" + strconv.Itoa(i), Body: []byte(strconv.Itoa(i)),
		})
	}
	s.mu.Unlock()
	select {
	case s.notify <- struct{}{}:
	default:
	}
}

func (s *scriptLog) Fetch(ctx context.Context, dst []driver.Message, max int) ([]driver.Message, error) {
	for {
		s.mu.Lock()
		if len(s.fetchErrs) > 0 {
			err := s.fetchErrs[0]
			s.fetchErrs = s.fetchErrs[1:]
			s.mu.Unlock()
			return dst, err
		}
		n := min(max, len(s.pending))
		dst = append(dst, s.pending[:n]...)
		s.pending = s.pending[n:]
		s.mu.Unlock()
		if n > 0 {
			return dst, nil
		}
		select {
		case <-s.notify:
		case <-ctx.Done():
			return dst, ctx.Err()
		}
	}
}

func (s *scriptLog) Settle(_ context.Context, b []driver.Settlement) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.settled = append(s.settled, b...)
	return nil
}

func (s *scriptLog) Capabilities() driver.Capabilities {
	return driver.Capabilities{Redelivers: s.redelivers}
}

func (s *scriptLog) Revoked() <-chan driver.Revocation { return s.revCh }

func (s *scriptLog) Close() error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	return nil
}

func (s *scriptLog) outcomes() map[string][]driver.Action {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string][]driver.Action{}
	for _, st := range s.settled {
		id := st.Handle.(string)
		out[id] = append(out[id], st.Action)
	}
	return out
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func runLoop(t *testing.T, l *Loop, h Handler) (stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- l.Run(ctx, h) }()
	return func() error {
		cancel()
		select {
		case err := <-errc:
			return err
		case <-time.After(20 * time.Second):
			t.Fatal("Run did not return after its context ended")
			return nil
		}
	}
}

func TestInPlaceRetryKeepsLaneOrder(t *testing.T) {
	drv := newScriptLog(false)
	drv.add("0", 20)
	drv.add("1", 20)
	l, err := New(drv, WithConcurrency(4), WithRedeliveryBackoff(time.Millisecond, 5*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	seen := map[string][]int64{}
	attempts := map[string]int{}
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		mu.Lock()
		defer mu.Unlock()
		attempts[m.ID] = m.Attempt
		if m.ID == "0/5" && m.Attempt < 3 {
			return errors.New("transient")
		}
		seen[m.Lane] = append(seen[m.Lane], m.Offset)
		return nil
	}))
	eventually(t, "every record is acked", func() bool { return l.Stats().Acked == 40 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	for lane, offs := range seen {
		for i, o := range offs {
			if o != int64(i) {
				t.Fatalf("lane %s completed out of order: %v", lane, offs)
			}
		}
	}
	if attempts["0/5"] != 3 {
		t.Fatalf("record 0/5 ran with attempt %d at last, want 3", attempts["0/5"])
	}
	for id, acts := range drv.outcomes() {
		if len(acts) != 1 || acts[0] != driver.Ack {
			t.Fatalf("record %s settled %v, want one ack", id, acts)
		}
	}
	if got := l.Stats().Retried; got != 2 {
		t.Fatalf("Retried = %d, want 2", got)
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
	eventually(t, "lane 1 is acked", func() bool { return l.Stats().Acked == 5 })
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

func TestShutdownAcksFinishedAndReturnsUnstarted(t *testing.T) {
	drv := newScriptLog(true)
	drv.add("", 10)
	l, err := New(drv, WithConcurrency(2), WithShutdownGrace(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	started := make(chan string, 10)
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		errc <- l.Run(ctx, HandlerFunc(func(ctx context.Context, m *Message) error {
			started <- m.ID
			<-release
			return nil
		}))
	}()
	a, b := <-started, <-started
	cancel()
	time.Sleep(50 * time.Millisecond) // let the loop see the cancellation first
	close(release)
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	out := drv.outcomes()
	for id, acts := range out {
		want := driver.Return
		if id == a || id == b {
			want = driver.Ack
		}
		if len(acts) != 1 || acts[0] != want {
			t.Fatalf("message %s settled %v, want [%v]", id, acts, want)
		}
	}
	drv.mu.Lock()
	unfetched := len(drv.pending)
	drv.mu.Unlock()
	if len(out) != int(l.Stats().Fetched) || len(out)+unfetched != 10 {
		t.Fatalf("%d settled, %d fetched, %d never fetched; want every fetched message settled", len(out), l.Stats().Fetched, unfetched)
	}
	if !drv.closed {
		t.Fatal("Run did not close the driver")
	}
	if err := l.Run(context.Background(), HandlerFunc(func(context.Context, *Message) error { return nil })); !errors.Is(err, ErrAlreadyRun) {
		t.Fatalf("second Run: %v, want ErrAlreadyRun", err)
	}
}

func TestHoldKeepsAttemptAndPausesFetching(t *testing.T) {
	drv := newScriptLog(true)
	drv.add("", 1)
	l, err := New(drv, WithConcurrency(1))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var attempts []int
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		mu.Lock()
		defer mu.Unlock()
		attempts = append(attempts, m.Attempt)
		if len(attempts) < 3 {
			// Publish more while held: the loop must not fetch them yet.
			drv.add("more", 1)
			return Hold(errors.New("breaker open"), 100*time.Millisecond)
		}
		return nil
	}))
	eventually(t, "the held message is acked", func() bool { return l.Stats().Acked >= 1 })
	mu.Lock()
	first3 := append([]int(nil), attempts[:3]...)
	mu.Unlock()
	for _, a := range first3 {
		if a != 1 {
			t.Fatalf("attempts while held = %v, want all 1", first3)
		}
	}
	if got := l.Stats().Held; got != 2 {
		t.Fatalf("Held = %d, want 2", got)
	}
	eventually(t, "the rest drains", func() bool { return l.Stats().Acked == 3 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if out := drv.outcomes(); out[""+"/0"][0] != driver.Ack {
		t.Fatalf("held message settled %v, want ack without a return", out["/0"])
	}
}

func TestFetchErrorsAreRetriedAndFatalEndsRun(t *testing.T) {
	drv := newScriptLog(true)
	drv.fetchErrs = []error{errors.New("connection reset"), errors.New("connection reset")}
	drv.add("", 3)
	l, err := New(drv, WithFetchBackoff(10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errc := make(chan error, 1)
	go func() {
		errc <- l.Run(ctx, HandlerFunc(func(context.Context, *Message) error { return nil }))
	}()
	eventually(t, "messages are acked after the failures", func() bool { return l.Stats().Acked == 3 })
	if got := l.Stats().FetchErrors; got != 2 {
		t.Fatalf("FetchErrors = %d, want 2", got)
	}
	gone := errors.New("queue deleted")
	drv.mu.Lock()
	drv.fetchErrs = []error{driver.Fatal(gone)}
	drv.mu.Unlock()
	drv.add("", 0)
	select {
	case err := <-errc:
		if !errors.Is(err, gone) {
			t.Fatalf("Run returned %v, want the fatal error", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Run did not end on a fatal fetch error")
	}
}

func TestNewRejectsBadConfigNamingTheField(t *testing.T) {
	drv := newScriptLog(true)
	cases := []struct {
		opt   Option
		field string
	}{
		{WithConcurrency(0), "Concurrency"},
		{WithConcurrency(-1), "Concurrency"},
		{WithMaxInFlight(0), "MaxInFlight"},
		{WithFetchBatch(0), "FetchBatch"},
		{WithName(""), "Name"},
		{WithShutdownGrace(-time.Second), "ShutdownGrace"},
		{WithRedeliveryBackoff(time.Second, time.Millisecond), "RedeliveryBackoff"},
		{WithLogger(nil), "Logger"},
	}
	for _, c := range cases {
		_, err := New(drv, c.opt)
		var ce *ConfigError
		if !errors.As(err, &ce) || ce.Field != c.field || !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("want a ConfigError naming %s, got %v", c.field, err)
		}
	}
	if _, err := New(drv, WithConcurrency(8), WithMaxInFlight(4)); err == nil {
		t.Error("MaxInFlight below Concurrency was accepted")
	}
	if _, err := New(nil); err == nil {
		t.Error("a nil driver was accepted")
	}
	l, _ := New(drv)
	if err := l.Run(context.Background(), nil); !errors.Is(err, ErrInvalidConfig) {
		t.Errorf("Run(nil handler) = %v, want a ConfigError", err)
	}
}

func TestOrderByKeyRunsKeysInParallelInsideOneLane(t *testing.T) {
	drv := newScriptLog(false)
	drv.mu.Lock()
	for i := 0; i < 40; i++ {
		drv.pending = append(drv.pending, driver.Message{
			ID: fmt.Sprint(i), Key: fmt.Sprint("k", i%4), Lane: "0", Offset: int64(i), Attempt: 1, Handle: fmt.Sprint(i),
		})
	}
	drv.mu.Unlock()
	l, err := New(drv, WithConcurrency(4), WithOrdering(OrderByKey))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	running, peak := 0, 0
	last := map[string]int64{}
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		mu.Lock()
		running++
		peak = max(peak, running)
		if prev, ok := last[m.Key]; ok && prev > m.Offset {
			t.Errorf("key %s: offset %d after %d", m.Key, m.Offset, prev)
		}
		last[m.Key] = m.Offset
		mu.Unlock()
		time.Sleep(2 * time.Millisecond)
		mu.Lock()
		running--
		mu.Unlock()
		return nil
	}))
	eventually(t, "all acked", func() bool { return l.Stats().Acked == 40 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if peak < 2 {
		t.Fatalf("peak concurrency inside one lane = %d, want > 1 with four keys", peak)
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

func TestHandlersSeeTheLoopName(t *testing.T) {
	drv := newScriptLog(true)
	drv.add("", 1)
	l, err := New(drv, WithName("billing"))
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan string, 1)
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		got <- Name(ctx)
		return nil
	}))
	if name := <-got; name != "billing" {
		t.Fatalf("Name = %q, want billing", name)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if Name(context.Background()) != "ferry" {
		t.Fatal("Name outside a loop is not the default")
	}
}
