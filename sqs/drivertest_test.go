package sqs_test

import (
	"testing"
	"time"

	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/consumer/driver/drivertest"
	ferrysqs "github.com/ferrymq/ferry/sqs"
)

// TestDriverConformance runs the driver-level conformance suite against
// the SQS driver on ElasticMQ, one standard queue per test.
func TestDriverConformance(t *testing.T) {
	c := newClient(t, nil)
	drivertest.Run(t, &driverHarness{c: c, b: newBroker(t, c)})
}

type driverHarness struct {
	c *awssqs.Client
	b *ferrysqs.Broker
}

var _ drivertest.Harness = (*driverHarness)(nil)

func (h *driverHarness) NewSource(t *testing.T, cfg drivertest.SourceConfig) string {
	vis := 30 * time.Second
	if cfg.Lease > 0 {
		vis = cfg.Lease
	}
	name, _ := createQueue(t, h.c, "drv", queueConfig{visibility: vis})
	return name
}

func (h *driverHarness) Publisher(*testing.T) consumer.Publisher { return h.b }

func (h *driverHarness) Opener(*testing.T, string) driver.Opener { return h.b }

func (h *driverHarness) Capabilities() drivertest.Capabilities {
	return drivertest.Capabilities{
		Redelivers: true,
		// Visibility timeouts are whole seconds: two leave the extensions
		// (every half second) room.
		Lease:            2 * time.Second,
		DelayGranularity: time.Second,
		CountsDeliveries: true, // ApproximateReceiveCount
	}
}
