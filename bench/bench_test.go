package bench

import (
	"context"
	"testing"
	"time"

	"github.com/ferrymq/ferry/ferrytest"
	"github.com/ferrymq/ferry/internal/testenv"
)

// TestEveryVariantConsumesEveryMessage runs every variant of every broker
// (a broker that is not reachable is skipped, or fails the test with
// FERRY_REQUIRE_BROKERS=1) on a few messages and checks that each consume
// variant handled every message it was given: a benchmark that loses
// messages is invalid. In -short mode it runs 300 messages a variant and
// 200 for the key-order pair; otherwise 5000 and 1000.
func TestEveryVariantConsumesEveryMessage(t *testing.T) {
	n, keys := 5000, 1000
	if testing.Short() {
		n, keys = 300, 200
	}
	KeyRecords, BacklogRecords = keys, n
	for _, broker := range Brokers {
		t.Run(string(broker), func(t *testing.T) {
			if broker != ferrytest.Memory { // the others are services of the same name
				testenv.Require(t, testenv.Service(broker))
			}
			s, err := NewSuite(broker, testenv.NewName("t"))
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			samples, err := Run(ctx, s, n, 1, time.Minute, t.Logf)
			if err != nil {
				t.Fatal(err)
			}
			if len(samples) != len(s.Variants) {
				t.Fatalf("%d samples of %d variants", len(samples), len(s.Variants))
			}
			for _, smp := range samples {
				if isConsume(smp.Op) && smp.Consumed != smp.N {
					t.Errorf("%s %s: handled %d of %d", smp.Op, smp.Impl, smp.Consumed, smp.N)
				}
			}
		})
	}
}
