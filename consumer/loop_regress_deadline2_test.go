package consumer

import (
	"context"
	"testing"
	"time"
)

// When the parent's deadline comes first, its expiry is not Timeout's own:
// expired() stays false, so Timeout does not blame the handler for an outer
// deadline.
func TestLazyDeadlineDoesNotClaimTheParentsDeadline(t *testing.T) {
	wrong := 0
	for i := 0; i < 2000; i++ {
		parent, cancel := context.WithTimeout(context.Background(), 200*time.Microsecond)
		c, release := withLazyDeadline(parent, time.Hour)
		pd, _ := parent.Deadline()
		for time.Now().Before(pd) {
		}
		if c.expired() {
			wrong++
		}
		release()
		cancel()
	}
	if wrong > 0 {
		t.Errorf("%d of 2000: expired() true though only the parent's (outer) deadline passed", wrong)
	}
}
