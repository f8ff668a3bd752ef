package demo

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/ferrymq/ferry/internal/testenv"
)

// Every goroutine a run starts (relay, consumers, producer, killer, status)
// has stopped when Run returns.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, testenv.LeakOptions()...)
}
