package drivertest

import "time"

// SetWait sets how long the suite waits for something that must happen,
// for runs of the suite that are meant to fail, and returns a func that
// restores it.
func SetWait(d time.Duration) (restore func()) {
	old := wait
	wait = d
	return func() { wait = old }
}
