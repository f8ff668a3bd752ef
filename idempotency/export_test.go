package idempotency

import (
	"testing"
	"time"
)

// SetSettleTimeout makes the middleware wait d for a store's Complete or
// Release, for the rest of the test.
func SetSettleTimeout(t testing.TB, d time.Duration) {
	saved := settleTimeout
	settleTimeout = d
	t.Cleanup(func() { settleTimeout = saved })
}
