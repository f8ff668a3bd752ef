package consumer

import (
	"context"
	"testing"
	"time"
)

// At shutdown every message queued behind a busy key is returned to the
// broker too, not just the ones ready to run, and the in-flight count drops
// to zero.
func TestShutdownReturnsFollowersOfReadyKeys(t *testing.T) {
	drv := newScriptLog(true)
	drv.add("1", 1)
	drv.add("2", 1)
	drv.add("3", 2) // 3/0 ready, 3/1 queued behind it
	drv.add("4", 2) // 4/0 ready, 4/1 queued behind it
	l, err := New(drv, WithConcurrency(1), WithMaxInFlight(16), WithShutdownGrace(5*time.Second))
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
	<-started
	time.Sleep(50 * time.Millisecond) // let the dispatcher fill the work buffer and ready queue
	cancel()
	time.Sleep(50 * time.Millisecond)
	close(release)
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	out := drv.outcomes()
	t.Logf("fetched=%d settled=%v inflight=%d", l.Stats().Fetched, out, l.Stats().InFlight)
	for _, id := range []string{"3/1", "4/1"} {
		if len(out[id]) != 1 {
			t.Errorf("%s settled %v, want exactly one Return", id, out[id])
		}
	}
	if got := l.Stats().InFlight; got != 0 {
		t.Errorf("InFlight = %d after Run returned, want 0", got)
	}
}
