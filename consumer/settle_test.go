package consumer

import (
	"context"
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
	return append(dst, driver.Message{ID: "late", Attempt: 1, Handle: "late"}), nil
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
