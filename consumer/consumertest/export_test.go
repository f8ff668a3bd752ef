package consumertest

import "time"

// SetPatience sets how long the suite waits for something that must happen,
// for runs of the suite that are meant to fail, and returns a func that
// restores it.
func SetPatience(d time.Duration) (restore func()) {
	old := patience
	patience = d
	return func() { patience = old }
}
