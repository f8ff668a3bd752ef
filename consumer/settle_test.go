package consumer

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
)

type concSettle struct {
	*scriptLog
	fetches    atomic.Int32
	inSettle   atomic.Int32
	concurrent atomic.Int32
}

func (c *concSettle) Fetch(ctx context.Context, dst []driver.Message, max int) ([]driver.Message, error) {
	if c.fetches.Add(1) == 1 {
		return c.scriptLog.Fetch(ctx, dst, max)
	}
	<-ctx.Done()
	// A receive that completed as the context ended: a driver may hand it over.
	return append(dst, driver.Message{ID: "late", Deliveries: 1, Handle: "late"}), nil
}

func (c *concSettle) Settle(ctx context.Context, b []driver.Settlement) error {
	if c.inSettle.Add(1) > 1 {
		c.concurrent.Add(1)
	}
	time.Sleep(30 * time.Millisecond)
	c.inSettle.Add(-1)
	return c.scriptLog.Settle(ctx, b)
}

// A batch fetched as Run stops is returned through the same goroutine as
// every other settlement: Settle is never called concurrently with itself,
// as the driver contract promises.
func TestSettleNeverRunsConcurrently(t *testing.T) {
	for i := 0; i < 20; i++ {
		drv := &concSettle{scriptLog: newScriptLog(true)}
		drv.add("", 6)
		l, err := New(drv, WithConcurrency(1), WithMaxInFlight(16))
		if err != nil {
			t.Fatal(err)
		}
		started := make(chan struct{}, 10)
		ctx, cancel := context.WithCancel(context.Background())
		errc := make(chan error, 1)
		go func() {
			errc <- l.Run(ctx, HandlerFunc(func(ctx context.Context, m *Message) error {
				started <- struct{}{}
				time.Sleep(10 * time.Millisecond)
				return nil
			}))
		}()
		<-started
		for drv.fetches.Load() < 2 {
			time.Sleep(time.Millisecond)
		}
		cancel()
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
		if n := drv.concurrent.Load(); n > 0 {
			t.Fatalf("run %d: Settle entered while another Settle was running (%d times)", i, n)
		}
	}
}

// leaseLog is a queue-like driver with a lease: it records every Extend and
// every Settle, and can hold the first Settle until released.
type leaseLog struct {
	*scriptLog
	lease    time.Duration
	holdOnce chan struct{} // the first Settle waits until it is closed

	mu        sync.Mutex
	settling  map[any]bool // handles in the Settle under way
	extended  map[any]int
	overlaps  []any // handles extended while their settlement was under way
	settleNum int
}

func newLeaseLog(lease time.Duration) *leaseLog {
	return &leaseLog{scriptLog: newScriptLog(true), lease: lease, holdOnce: make(chan struct{}),
		settling: map[any]bool{}, extended: map[any]int{}}
}

func (d *leaseLog) Lease() time.Duration { return d.lease }

func (d *leaseLog) Extend(_ context.Context, handles []any, _ time.Duration) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, h := range handles {
		d.extended[h]++
		if d.settling[h] {
			d.overlaps = append(d.overlaps, h)
		}
	}
	return nil
}

func (d *leaseLog) Settle(ctx context.Context, b []driver.Settlement) error {
	d.mu.Lock()
	d.settleNum++
	first := d.settleNum == 1
	for _, s := range b {
		d.settling[s.Handle] = true
	}
	d.mu.Unlock()
	if first {
		select {
		case <-d.holdOnce:
		case <-ctx.Done():
		}
	}
	d.mu.Lock()
	for _, s := range b {
		delete(d.settling, s.Handle)
	}
	d.mu.Unlock()
	return d.scriptLog.Settle(ctx, b)
}

func (d *leaseLog) extensions(h any) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.extended[h]
}

// While one Settle hangs, the messages whose outcome is decided and whose
// settlement waits behind it keep their leases: they are extended, from a
// goroutine of their own, and never while their own settlement is being
// made (an extension landing after a return would undo its delay).
func TestSettlementsWaitingBehindAHungSettleKeepTheirLeases(t *testing.T) {
	drv := newLeaseLog(time.Second)
	drv.add("", 1)
	l, err := New(drv, WithConcurrency(1))
	if err != nil {
		t.Fatal(err)
	}
	stop := runLoop(t, l, HandlerFunc(func(context.Context, *Message) error { return nil }))
	eventually(t, "the first ack to be with the driver", func() bool {
		drv.mu.Lock()
		defer drv.mu.Unlock()
		return drv.settleNum == 1
	})
	drv.push(driver.Message{ID: "x1", Deliveries: 1, Handle: "x1"}, driver.Message{ID: "x2", Deliveries: 1, Handle: "x2"})
	eventually(t, "the waiting messages to be extended twice", func() bool {
		return drv.extensions("x1") >= 2 && drv.extensions("x2") >= 2
	})
	close(drv.holdOnce)
	eventually(t, "every message acked", func() bool { return l.Stats().Acked == 3 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	drv.mu.Lock()
	defer drv.mu.Unlock()
	if len(drv.overlaps) > 0 {
		t.Fatalf("extended while their settlement was under way: %v", drv.overlaps)
	}
}
