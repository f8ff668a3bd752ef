package ferrytest_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/ferrymq/ferry/internal/testenv"
)

// Every consumer, driver and connection the kit starts is stopped by the
// time its test ends.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, testenv.LeakOptions()...)
}
