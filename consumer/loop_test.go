package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
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
			ID: lane + "/" + strconv.Itoa(i), Lane: lane, Offset: int64(i), Deliveries: 1,
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
	testenv.WaitFor(t, 20*time.Second, "every record is acked", func() bool { return l.Stats().Acked == 40 })
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
	testenv.WaitFor(t, 20*time.Second, "the held message is acked", func() bool { return l.Stats().Acked >= 1 })
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
	testenv.WaitFor(t, 20*time.Second, "the rest drains", func() bool { return l.Stats().Acked == 3 })
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
	testenv.WaitFor(t, 20*time.Second, "messages are acked after the failures", func() bool { return l.Stats().Acked == 3 })
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
			ID: fmt.Sprint(i), Key: fmt.Sprint("k", i%4), Lane: "0", Offset: int64(i), Deliveries: 1, Handle: fmt.Sprint(i),
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
	testenv.WaitFor(t, 20*time.Second, "all acked", func() bool { return l.Stats().Acked == 40 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if peak < 2 {
		t.Fatalf("peak concurrency inside one lane = %d, want > 1 with four keys", peak)
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

func (s *scriptLog) push(msgs ...driver.Message) {
	s.mu.Lock()
	s.pending = append(s.pending, msgs...)
	s.mu.Unlock()
	select {
	case s.notify <- struct{}{}:
	default:
	}
}

// A lease too short for its extensions to land in time is refused when the
// loop is built, naming it, instead of running with nothing ever acked.
func TestNewRefusesALeaseTooShortToExtend(t *testing.T) {
	for _, lease := range []time.Duration{time.Millisecond, 10 * time.Millisecond, driver.MinLease - 1} {
		_, err := New(newLeaseLog(lease))
		var ce *ConfigError
		if !errors.As(err, &ce) || ce.Field != "Lease" {
			t.Errorf("lease %s: New = %v, want a *ConfigError for Lease", lease, err)
		}
	}
	if _, err := New(newLeaseLog(driver.MinLease)); err != nil {
		t.Errorf("lease %s: %v", driver.MinLease, err)
	}
}

// With OrderByKey a message without a key asks for no order: messages
// without keys run side by side, even inside one lane.
func TestOrderByKeyLeavesMessagesWithoutAKeyUnordered(t *testing.T) {
	drv := newScriptLog(false)
	drv.add("0", 8) // no keys
	l, err := New(drv, WithConcurrency(4), WithOrdering(OrderByKey))
	if err != nil {
		t.Fatal(err)
	}
	var running, peak atomic.Int32
	release := make(chan struct{})
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		n := running.Add(1)
		for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
		}
		<-release
		running.Add(-1)
		return nil
	}))
	testenv.WaitFor(t, 20*time.Second, "four keyless messages to run at once", func() bool { return peak.Load() == 4 })
	close(release)
	testenv.WaitFor(t, 20*time.Second, "all acked", func() bool { return l.Stats().Acked == 8 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

// Lanes and keys are kept apart as a pair, whatever bytes they hold: a key
// with a NUL byte in it is freed with its lane when the lane is revoked, and
// its later messages run.
func TestRevocationFreesAKeyWithANulByte(t *testing.T) {
	drv := newScriptLog(true)
	key := "a\x00b"
	drv.push(driver.Message{ID: "1", Key: key, Deliveries: 1, Handle: "1"})
	l, err := New(drv, WithOrdering(OrderByKey))
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan string, 4)
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		started <- m.ID
		if m.ID == "1" {
			<-ctx.Done() // runs until its lane is revoked
			return ctx.Err()
		}
		return nil
	}))
	<-started
	done := make(chan struct{})
	drv.revCh <- driver.Revocation{Lanes: []string{""}, Done: done}
	<-done
	drv.push(driver.Message{ID: "2", Key: key, Deliveries: 1, Handle: "2"})
	select {
	case id := <-started:
		if id != "2" {
			t.Fatalf("ran %s, want 2", id)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the key's next message never ran after its lane was revoked: the key stayed busy")
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

// A message that comes back to the Loop that returned it runs with the
// count of its runs exact, even from a broker that counts only deliveries
// and carries nothing (SQS): the loop remembers what it returned.
func TestReturnedMessageComingBackCountsItsRunsExactly(t *testing.T) {
	drv := &redeliveringLog{scriptLog: newScriptLog(true)}
	drv.push(driver.Message{ID: "m", Source: "q", Deliveries: 1, Handle: "m#1"})
	l, err := New(drv, WithRedeliveryBackoff(time.Millisecond, time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	var attempts []int
	var mu sync.Mutex
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		mu.Lock()
		defer mu.Unlock()
		attempts = append(attempts, m.Attempt)
		switch len(attempts) {
		case 1:
			return Hold(errors.New("breaker open"), time.Millisecond) // not a run
		case 2, 3:
			return errors.New("transient")
		}
		return nil
	}))
	testenv.WaitFor(t, 20*time.Second, "the message to be acked", func() bool { return l.Stats().Acked == 1 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(attempts) != "[1 1 2 3]" {
		t.Fatalf("attempts seen = %v, want [1 1 2 3]: a hold is no run, and two redeliveries were seen", attempts)
	}
}

// redeliveringLog gives a returned message back at once as a new delivery
// with the delivery count one higher, as SQS does, and carries nothing else.
type redeliveringLog struct {
	*scriptLog
	n atomic.Int32
}

func (d *redeliveringLog) Settle(ctx context.Context, b []driver.Settlement) error {
	for _, s := range b {
		if s.Action == driver.Return {
			n := int(d.n.Add(1)) + 1
			d.push(driver.Message{ID: "m", Source: "q", Deliveries: n, Handle: fmt.Sprintf("m#%d", n)})
		}
	}
	return d.scriptLog.Settle(ctx, b)
}

// A driver whose broker pushes deliveries sizes its prefetch from the loop:
// MaxInFlight says the bound the loop keeps, set or defaulted.
func TestMaxInFlightReportsTheBound(t *testing.T) {
	for _, tc := range []struct {
		opts []Option
		want int
	}{
		{[]Option{WithConcurrency(3)}, 12},
		{[]Option{WithConcurrency(2), WithMaxInFlight(7)}, 7},
	} {
		l, err := New(newScriptLog(true), tc.opts...)
		if err != nil {
			t.Fatal(err)
		}
		if got := l.MaxInFlight(); got != tc.want {
			t.Errorf("MaxInFlight = %d, want %d", got, tc.want)
		}
	}
}

// TestTrainsKeepLaneOrder: a worker takes an ordered delivery with the train
// queued behind its key; the key passes along the train, so that nothing
// queued after the train starts before the train's last delivery finished.
// Lanes longer than a train (maxTrain) show whether an ack in the middle of a
// run lets the next delivery of the key queue start too early.
func TestTrainsKeepLaneOrder(t *testing.T) {
	const perLane = 3*maxTrain + 17
	drv := newScriptLog(true)
	drv.add("a", perLane)
	drv.add("b", perLane)
	l, err := New(drv, WithConcurrency(8), WithMaxInFlight(4*perLane), WithFetchBatch(2*perLane))
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu       sync.Mutex
		seen     = map[string][]int64{}
		running  = map[string]int{}
		overlaps int
	)
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		mu.Lock()
		running[m.Lane]++
		if running[m.Lane] > 1 {
			overlaps++
		}
		seen[m.Lane] = append(seen[m.Lane], m.Offset)
		mu.Unlock()
		runtime.Gosched() // let another worker try to start one of the lane
		mu.Lock()
		running[m.Lane]--
		mu.Unlock()
		return nil
	}))
	testenv.WaitFor(t, 20*time.Second, "every message acked", func() bool { return l.Stats().Acked == 2*perLane })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if overlaps > 0 {
		t.Errorf("two handlers of one lane ran at once %d times", overlaps)
	}
	for lane, offs := range seen {
		for i, o := range offs {
			if o != int64(i) {
				t.Fatalf("lane %s ran out of order at %d: offset %d", lane, i, o)
			}
		}
	}
}

// TestTrainsTakeTurnsWithOtherLanes: a worker running a lane's train of slow
// handlers hands the rest of it back once another delivery waits for a
// worker, so that one lane does not keep the only worker for a whole train.
func TestTrainsTakeTurnsWithOtherLanes(t *testing.T) {
	drv := newScriptLog(false)
	drv.add("a", 300)
	drv.add("b", 1)
	l, err := New(drv, WithConcurrency(1), WithMaxInFlight(400), WithFetchBatch(400))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var order []string
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		time.Sleep(time.Millisecond)
		mu.Lock()
		order = append(order, m.Lane)
		mu.Unlock()
		return nil
	}))
	testenv.WaitFor(t, 20*time.Second, "all acked", func() bool { return l.Stats().Acked == 301 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	at := slices.Index(order, "b")
	if at < 0 || at > 100 {
		t.Errorf("lane b's only message ran after %d of lane a's 300 (a whole train of %d): trains do not take turns", at, maxTrain)
	}
}

// A finished message is settled while the other workers' handlers still
// run: workers hand their results back at once, so no ack waits for a
// batch to fill or for a slow handler elsewhere (see the package doc).
func TestAnAckDoesNotWaitForOtherHandlers(t *testing.T) {
	drv := newScriptLog(true)
	drv.add("", 3) // unlaned: the three run in parallel
	l, err := New(drv, WithConcurrency(3), WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		if m.ID != "/1" {
			select { // the two slow ones wait until the quick one is acked
			case <-release:
			case <-ctx.Done():
			}
		}
		return nil
	}))
	testenv.WaitFor(t, 20*time.Second, "the quick message is acked while the others run", func() bool {
		return slices.Equal(drv.outcomes()["/1"], []driver.Action{driver.Ack})
	})
	if got := l.Stats(); got.Running != 2 {
		t.Errorf("Running = %d when the quick message was acked, want the two slow ones", got.Running)
	}
	close(release)
	testenv.WaitFor(t, 20*time.Second, "every message is acked", func() bool { return len(drv.outcomes()) == 3 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

// Unordered deliveries go to a worker in trains (one hand-off for many), but
// a slow handler does not keep the rest of its train from idle workers: the
// worker hands them back as soon as one is slow.
func TestASlowHandlerHandsBackTheRestOfItsTrain(t *testing.T) {
	drv := newScriptLog(true)
	drv.add("", 40) // unlaned: trains of about 19 for each of the 2 workers
	l, err := New(drv, WithConcurrency(2), WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error {
		if m.ID == "/0" { // the head of the first run
			select {
			case <-release:
			case <-ctx.Done():
			}
		}
		return nil
	}))
	testenv.WaitFor(t, 20*time.Second, "the other 39 are acked while the first runs", func() bool { return len(drv.outcomes()) == 39 })
	close(release)
	testenv.WaitFor(t, 20*time.Second, "every message is acked", func() bool { return len(drv.outcomes()) == 40 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}
