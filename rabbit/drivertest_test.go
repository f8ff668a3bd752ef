package rabbit_test

import (
	"strings"
	"testing"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/consumer/driver/drivertest"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/rabbit"
)

// TestDriverConformance runs the driver-level conformance suite against
// the RabbitMQ driver, one classic queue per test.
func TestDriverConformance(t *testing.T) {
	amqpURL(t)
	drivertest.Run(t, &driverHarness{brokers: map[string]*rabbit.Broker{}})
}

// driverHarness gives each source a Broker of its own, whose topology
// declares the queue and whose connections are named after it: Revoke
// closes them from the broker's side, and only them (the broker is shared).
type driverHarness struct {
	brokers map[string]*rabbit.Broker // by source
}

var (
	_ drivertest.Harness  = (*driverHarness)(nil)
	_ drivertest.Revoking = (*driverHarness)(nil)
)

func (h *driverHarness) NewSource(t *testing.T, _ drivertest.SourceConfig) string {
	name := testenv.UniqueName(t, "drv")
	topo := rabbit.Topology{Queues: []rabbit.Queue{{Name: name, DeadLetterExchange: name + ".dlx"}}}
	deleteLater(t, []string{name}, nil)
	h.brokers[name] = dial(t, rabbit.WithTopology(topo), rabbit.WithConnectionName(name))
	t.Cleanup(func() { delete(h.brokers, name) })
	return name
}

func (h *driverHarness) Publisher(t *testing.T) consumer.Publisher { return dial(t) }

func (h *driverHarness) Opener(t *testing.T, source string) driver.Opener {
	b := h.brokers[source]
	if b == nil {
		t.Fatalf("no broker for source %q", source)
	}
	return b
}

// Revoke closes the source's Broker's connections from the broker's side:
// the consuming channel dies with its connection, and the driver revokes
// its deliveries.
func (h *driverHarness) Revoke(t *testing.T, source string, _ driver.Config, _ driver.Driver) driver.Driver {
	n := 0
	for _, line := range strings.Split(ctl(t, "list_connections", "pid", "client_properties"), "\n") {
		if strings.Contains(line, source) {
			ctl(t, "close_connection", strings.Fields(line)[0], "ferry drivertest: revoke")
			n++
		}
	}
	if n == 0 {
		t.Fatalf("no connection of %q to close", source)
	}
	return nil
}

func (h *driverHarness) Capabilities() drivertest.Capabilities {
	return drivertest.Capabilities{
		Redelivers: true,
		// A delay rounds up to the next delay queue: never sooner.
		CountsDeliveries: true, // carried in a header through the delay queue
		CarriesHistory:   true,
	}
}
