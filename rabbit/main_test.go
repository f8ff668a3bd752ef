package rabbit_test

import (
	"flag"
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/ferrymq/ferry/internal/testenv"
)

// TestMain checks for leaked goroutines, and leaves the examples out when
// RabbitMQ does not answer (they need it, and cannot skip themselves),
// unless FERRY_REQUIRE_BROKERS=1.
func TestMain(m *testing.M) {
	flag.Parse()
	if _, err := testenv.Reachable(testenv.RabbitMQ); err != nil && !testenv.RequireBrokers() {
		fmt.Fprintf(os.Stderr, "rabbit: RabbitMQ does not answer (%v): the examples are skipped\n", err)
		_ = flag.Set("test.skip", "^Example")
	}
	goleak.VerifyTestMain(m)
}
