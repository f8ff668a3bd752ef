package sqs_test

import (
	"flag"
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/ferrymq/ferry/internal/testenv"
)

// TestMain checks for leaked goroutines, and leaves the examples out when
// the SQS server does not answer (they need it, and cannot skip
// themselves), unless FERRY_REQUIRE_BROKERS=1.
func TestMain(m *testing.M) {
	flag.Parse()
	if _, err := testenv.Reachable(testenv.SQS); err != nil && !testenv.RequireBrokers() {
		fmt.Fprintf(os.Stderr, "sqs: the SQS server does not answer (%v): the examples are skipped\n", err)
		_ = flag.Set("test.skip", "^Example")
	}
	goleak.VerifyTestMain(m, testenv.LeakOptions()...)
}
