package consumer

import (
	"context"
	"sync"
	"testing"
	"time"
)

// release() ends the context in the same critical section in which it
// stops the timer, so a Done() racing with it starts no timer and registers
// nothing on the parent.
func TestLazyDeadlineReleaseRacingDoneLeaksNothing(t *testing.T) {
	parent, cancel := context.WithCancel(context.Background())
	defer cancel()
	leakedTimers, leakedLinks := 0, 0
	for i := 0; i < 20000; i++ {
		c, release := withLazyDeadline(parent, time.Hour)
		var wg sync.WaitGroup
		wg.Add(2)
		go func() { defer wg.Done(); release() }()
		go func() { defer wg.Done(); <-c.Done() }()
		wg.Wait()
		c.mu.Lock()
		if c.timer != nil && c.timer.Stop() { // still pending: release never stopped it
			leakedTimers++
		}
		if c.stop != nil && c.stop() { // still linked into the parent
			leakedLinks++
		}
		c.mu.Unlock()
	}
	if leakedTimers+leakedLinks > 0 {
		t.Errorf("after release: %d timers still pending, %d AfterFunc registrations still on the parent", leakedTimers, leakedLinks)
	}
}
