package consumer

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
)

// heldSettler is a queue-shaped scriptLog whose Settle calls wait until
// released, counting how many are out at once.
type heldSettler struct {
	*scriptLog
	settlers, batch int

	mu      sync.Mutex
	out     int   // Settle calls out now
	maxOut  int   // the most out at once
	sizes   []int // each call's settlements, in the order the calls began
	release chan struct{}
}

func newHeldSettler(settlers, batch int) *heldSettler {
	return &heldSettler{scriptLog: newScriptLog(true), settlers: settlers, batch: batch, release: make(chan struct{})}
}

func (h *heldSettler) Capabilities() driver.Capabilities {
	c := h.scriptLog.Capabilities()
	c.Settlers, c.SettleBatch = h.settlers, h.batch
	return c
}

func (h *heldSettler) Settle(ctx context.Context, b []driver.Settlement) error {
	h.mu.Lock()
	h.out++
	h.maxOut = max(h.maxOut, h.out)
	h.sizes = append(h.sizes, len(b))
	h.mu.Unlock()
	select {
	case <-h.release:
	case <-ctx.Done():
	}
	err := h.scriptLog.Settle(ctx, b)
	h.mu.Lock()
	h.out--
	h.mu.Unlock()
	return err
}

func (h *heldSettler) state() (out, maxOut int, sizes []int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.out, h.maxOut, append([]int(nil), h.sizes...)
}

func (h *heldSettler) settledOnce(t *testing.T, n int) {
	t.Helper()
	got := h.outcomes()
	if len(got) != n {
		t.Errorf("%d messages settled, want %d", len(got), n)
	}
	for id, acts := range got {
		if len(acts) != 1 || acts[0] != driver.Ack {
			t.Errorf("%s settled %v, want one ack", id, acts)
		}
	}
}

// runWithOneCallOut runs a loop over drv whose handler counts its calls,
// and returns once a first message's Settle call is out (held).
func runWithOneCallOut(t *testing.T, drv *heldSettler) (l *Loop, handled *atomic.Int64, stop func() error) {
	t.Helper()
	l, err := New(drv, WithConcurrency(4), WithMaxInFlight(64))
	if err != nil {
		t.Fatal(err)
	}
	handled = new(atomic.Int64)
	stop = runLoop(t, l, HandlerFunc(func(context.Context, *Message) error { handled.Add(1); return nil }))
	drv.add("a", 1)
	testenv.WaitFor(t, 20*time.Second, "the first Settle call to be out", func() bool { out, _, _ := drv.state(); return out == 1 })
	return l, handled, stop
}

// TestConcurrentSettleOnlyForAFullBatch: with a driver that takes Settle
// calls at once (SQS), acks decided while a call is out go out in another
// call without waiting for it, but only once they fill the driver's batch,
// and never more calls than it takes.
func TestConcurrentSettleOnlyForAFullBatch(t *testing.T) {
	drv := newHeldSettler(2, 5)
	l, handled, stop := runWithOneCallOut(t, drv)
	drv.add("b", 4) // four acks while the first call is out: less than a batch
	testenv.WaitFor(t, 20*time.Second, "the four to be handled", func() bool { return handled.Load() == 5 })
	time.Sleep(100 * time.Millisecond) // for the dispatcher to decide their acks
	if out, _, sizes := drv.state(); out != 1 {
		t.Fatalf("%d Settle calls out (sizes %v) with four acks waiting: a second call went out for less than a batch of 5", out, sizes)
	}
	drv.add("c", 1) // the fifth fills a batch
	testenv.WaitFor(t, 20*time.Second, "a second Settle call with the five acks", func() bool { out, _, _ := drv.state(); return out == 2 })
	drv.add("d", 10) // no third call: the driver takes two at once
	testenv.WaitFor(t, 20*time.Second, "the ten to be handled", func() bool { return handled.Load() == 16 })
	time.Sleep(100 * time.Millisecond)
	if _, maxOut, sizes := drv.state(); maxOut != 2 || len(sizes) != 2 || sizes[0] != 1 || sizes[1] != 5 {
		t.Fatalf("calls of %v, at most %d out at once; want calls of 1 and 5, two out at once", sizes, maxOut)
	}
	close(drv.release)
	testenv.WaitFor(t, 20*time.Second, "every message settled", func() bool { return l.Stats().Acked == 16 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	drv.settledOnce(t, 16)
}

// TestConcurrentSettleSendsWholeBatches: acks that wait for a free settle
// goroutine and come to more than a batch go out in whole batches; the rest
// wait for the next call rather than making a short call of their own (SQS
// would send 7 acks as 5 and 2).
func TestConcurrentSettleSendsWholeBatches(t *testing.T) {
	drv := newHeldSettler(2, 5)
	l, handled, stop := runWithOneCallOut(t, drv)
	drv.add("b", 5) // a second call, of a full batch: both settlers busy
	testenv.WaitFor(t, 20*time.Second, "a second Settle call", func() bool { out, _, _ := drv.state(); return out == 2 })
	drv.add("c", 7) // seven acks waiting, with no settler free
	testenv.WaitFor(t, 20*time.Second, "the seven to be handled", func() bool { return handled.Load() == 13 })
	time.Sleep(100 * time.Millisecond) // for the dispatcher to decide their acks
	drv.release <- struct{}{}          // one call returns: the seven may go
	testenv.WaitFor(t, 20*time.Second, "a third Settle call", func() bool { _, _, sizes := drv.state(); return len(sizes) == 3 })
	time.Sleep(100 * time.Millisecond)
	if _, _, sizes := drv.state(); sizes[2] != 5 {
		t.Fatalf("calls of %v: the seven waiting acks went in a call of %d, want a whole batch of 5", sizes, sizes[2])
	}
	close(drv.release)
	testenv.WaitFor(t, 20*time.Second, "every message settled", func() bool { return l.Stats().Acked == 13 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if _, _, sizes := drv.state(); len(sizes) != 4 || sizes[3] != 2 {
		t.Errorf("calls of %v, want the last two acks in a fourth call of 2", sizes)
	}
	drv.settledOnce(t, 13)
}

// TestOneSettlerSettlesOneCallAtATime: a driver that does not take Settle
// calls at once (Kafka, RabbitMQ, memory) gets one at a time, however many
// acks wait.
func TestOneSettlerSettlesOneCallAtATime(t *testing.T) {
	drv := newHeldSettler(0, 0)
	l, handled, stop := runWithOneCallOut(t, drv)
	drv.add("b", 30)
	testenv.WaitFor(t, 20*time.Second, "the rest to be handled", func() bool { return handled.Load() == 31 })
	time.Sleep(100 * time.Millisecond) // for the dispatcher to decide their acks
	if out, _, sizes := drv.state(); out != 1 || len(sizes) != 1 {
		t.Fatalf("%d Settle calls out, calls of %v: a driver of one settler got a second call while one was out", out, sizes)
	}
	close(drv.release)
	testenv.WaitFor(t, 20*time.Second, "every message settled", func() bool { return l.Stats().Acked == 31 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if _, maxOut, sizes := drv.state(); maxOut != 1 || len(sizes) != 2 || sizes[1] != 30 {
		t.Errorf("calls of %v, at most %d out at once; want one of 1 and then one of 30, one at a time", sizes, maxOut)
	}
	drv.settledOnce(t, 31)
}

// TestShutdownSendsTheLastAcksWithoutAFullBatch: once Run is stopping,
// acks decided while a Settle call is out go in another call at once,
// full batch or not, so that the drain does not wait on the call ahead.
func TestShutdownSendsTheLastAcksWithoutAFullBatch(t *testing.T) {
	drv := newHeldSettler(2, 5)
	l, err := New(drv, WithConcurrency(4), WithMaxInFlight(64), WithShutdownGrace(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var running atomic.Int64
	gate := make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errc := make(chan error, 1)
	go func() {
		errc <- l.Run(ctx, HandlerFunc(func(_ context.Context, m *Message) error {
			if m.Lane != "a" {
				running.Add(1)
				<-gate // still running when the shutdown begins
			}
			return nil
		}))
	}()
	drv.add("a", 1)
	testenv.WaitFor(t, 20*time.Second, "the first Settle call to be out", func() bool { out, _, _ := drv.state(); return out == 1 })
	drv.add("b", 1)
	drv.add("c", 1)
	testenv.WaitFor(t, 20*time.Second, "the two handlers to be running", func() bool { return running.Load() == 2 })
	cancel() // the shutdown begins, with a call out and two handlers running
	time.Sleep(100 * time.Millisecond)
	close(gate)
	testenv.WaitFor(t, 20*time.Second, "the two acks to go out beside the call that is out", func() bool { out, _, _ := drv.state(); return out == 2 })
	close(drv.release)
	select {
	case err := <-errc:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Run did not return")
	}
	drv.settledOnce(t, 3)
}
