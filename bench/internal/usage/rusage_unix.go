//go:build unix

package usage

import (
	"syscall"
	"time"
)

// ownCPU is this process's user and system time so far, every thread's.
func ownCPU() (time.Duration, bool) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, false
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), true
}
