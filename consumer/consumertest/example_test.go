package consumertest_test

import (
	"fmt"
	"testing"

	"github.com/ferrymq/ferry/consumer/consumertest"
)

// An adapter's conformance test is one call over its Harness. This one runs
// the suite on the memory broker (memHarness, in harness_test.go), as
// memory/conformance_test.go does; what the harness reports it can do
// decides which clauses run.
func ExampleRun() {
	conformance := func(t *testing.T) { consumertest.Run(t, &memHarness{}) }
	_ = conformance // in a _test.go file: func TestConformance(t *testing.T) { conformance(t) }

	fmt.Printf("%+v\n", (&memHarness{}).Capabilities())
	// Output: {Ordered:true Lease:1s Redelivers:true Delays:true MaxBody:0}
}
