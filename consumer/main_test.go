package consumer

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if any goroutine outlives them: every
// Loop must stop all it started before Run returns.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
