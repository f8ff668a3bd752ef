//go:build !unix

package usage

import "time"

// ownCPU is unknown here.
func ownCPU() (time.Duration, bool) { return 0, false }
