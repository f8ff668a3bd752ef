package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
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
