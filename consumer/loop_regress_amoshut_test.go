package consumer

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
)

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
