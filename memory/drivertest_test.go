package memory_test

import (
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/consumer/driver/drivertest"
	"github.com/ferrymq/ferry/memory"
)

// TestDriverConformance runs the driver-level conformance suite against
// the memory broker's driver, the reference.
func TestDriverConformance(t *testing.T) {
	drivertest.Run(t, &driverHarness{b: newBroker(t, memory.WithAutoCreate(false))})
}

// driverHarness makes one queue per test on one broker.
type driverHarness struct {
	b   *memory.Broker
	seq atomic.Int64
}

var _ drivertest.Harness = (*driverHarness)(nil)

func (h *driverHarness) NewSource(t *testing.T, cfg drivertest.SourceConfig) string {
	name := "drivertest-" + strconv.FormatInt(h.seq.Add(1), 10)
	if err := h.b.CreateQueue(name, memory.QueueConfig{VisibilityTimeout: cfg.Lease}); err != nil {
		t.Fatalf("create queue %q: %v", name, err)
	}
	return name
}

func (h *driverHarness) Publisher(*testing.T) consumer.Publisher { return h.b }

func (h *driverHarness) Opener(*testing.T, string) driver.Opener { return h.b }

func (h *driverHarness) Capabilities() drivertest.Capabilities {
	return drivertest.Capabilities{
		Redelivers:       true,
		Lease:            time.Second,
		CountsDeliveries: true,
		CarriesHistory:   true,
	}
}
