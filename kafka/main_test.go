package kafka_test

import (
	"flag"
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/ferrymq/ferry/internal/testenv"
)

// TestMain runs the child process some tests start, checks for leaked
// goroutines, and leaves the examples out when Kafka does not answer (they
// need it, and cannot skip themselves), unless FERRY_REQUIRE_BROKERS=1.
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(runChild())
	}
	flag.Parse()
	if _, err := testenv.Reachable(testenv.Kafka); err != nil && !testenv.RequireBrokers() {
		fmt.Fprintf(os.Stderr, "kafka: Kafka does not answer (%v): the examples are skipped\n", err)
		_ = flag.Set("test.skip", "^Example")
	}
	goleak.VerifyTestMain(m)
}
