package main

import (
	"strings"
	"testing"
	"time"

	"github.com/ferrymq/ferry/examples/internal/exampletest"
	"github.com/ferrymq/ferry/internal/testenv"
)

// The example pays every order it placed, on the real Kafka.
func TestExamplePaysEveryOrder(t *testing.T) {
	seeds := testenv.RequireKafka(t)
	out := exampletest.Run(t, 90*time.Second, "-brokers", strings.Join(seeds, ","), "-orders", "5", "-timeout", "60s")
	for _, want := range []string{"order service: placed o-0005", "billing: paid o-0005", "billing: paid 5 of 5 orders"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q", want)
		}
	}
}

// SIGTERM mid-run (how a container is stopped) stops the example cleanly:
// the payments in flight finish, the consumer drains, and it exits 0.
func TestExampleDrainsOnSIGTERM(t *testing.T) {
	seeds := testenv.RequireKafka(t)
	exampletest.CheckDrainsOnSIGTERM(t, exampletest.Build(t), "-brokers", strings.Join(seeds, ","), "-orders", "100", "-pay-time", "300ms", "-timeout", "90s")
}
