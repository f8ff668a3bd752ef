package kafka_test

import (
	"context"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/consumer/driver/drivertest"
	"github.com/ferrymq/ferry/kafka"
)

// TestDriverConformance runs the driver-level conformance suite against
// the Kafka driver, one topic of four partitions per test, every driver of
// a topic in one group, under both group protocols.
func TestDriverConformance(t *testing.T) {
	for _, p := range []kafka.GroupProtocol{kafka.Classic, kafka.NextGen} {
		t.Run(p.String(), func(t *testing.T) {
			drivertest.Run(t, &driverHarness{b: newBroker(t, kafka.WithGroupProtocol(p))})
		})
	}
}

type driverHarness struct {
	b *kafka.Broker
}

var (
	_ drivertest.Harness  = (*driverHarness)(nil)
	_ drivertest.Revoking = (*driverHarness)(nil)
)

func (h *driverHarness) NewSource(t *testing.T, _ drivertest.SourceConfig) string {
	return newTopic(t, h.b, "drv", 4)
}

func (h *driverHarness) Publisher(*testing.T) consumer.Publisher { return h.b }

func (h *driverHarness) Opener(*testing.T, string) driver.Opener { return h.b }

// Revoke opens a second member of d's group: the rebalance its first
// Fetch starts takes partitions from d.
func (h *driverHarness) Revoke(t *testing.T, source string, cfg driver.Config, _ driver.Driver) driver.Driver {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	d, err := h.b.Driver(ctx, source, cfg)
	if err != nil {
		t.Fatalf("second member of %q: %v", cfg.Name, err)
	}
	return d
}

func (h *driverHarness) Capabilities() drivertest.Capabilities {
	// A log: a partition's records are the lane's, in order, and nothing
	// is taken back; commits carry no count of deliveries.
	return drivertest.Capabilities{}
}
