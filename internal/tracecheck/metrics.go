package tracecheck

import (
	"context"
	"testing"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// Sent collects reader and returns, for the publishes to destination that
// the broker named system recorded, how many messages
// messaging.client.sent.messages counted (by error.type, "" for success)
// and how many calls messaging.client.operation.duration timed: the check
// the adapters' publish-metrics tests share.
func Sent(t testing.TB, reader *sdkmetric.ManualReader, system, destination string) (sent map[string]int64, calls uint64) {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	sent = map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				if m.Name != "messaging.client.sent.messages" {
					continue
				}
				for _, dp := range d.DataPoints {
					sys, _ := dp.Attributes.Value("messaging.system")
					dest, _ := dp.Attributes.Value("messaging.destination.name")
					et, _ := dp.Attributes.Value("error.type")
					if sys.AsString() == system && dest.AsString() == destination {
						sent[et.AsString()] += dp.Value
					}
				}
			case metricdata.Histogram[float64]:
				if m.Name != "messaging.client.operation.duration" || m.Unit != "s" {
					continue
				}
				for _, dp := range d.DataPoints {
					sys, _ := dp.Attributes.Value("messaging.system")
					dest, _ := dp.Attributes.Value("messaging.destination.name")
					op, _ := dp.Attributes.Value("messaging.operation.name")
					if sys.AsString() == system && dest.AsString() == destination && op.AsString() == "send" {
						calls += dp.Count
					}
				}
			}
		}
	}
	return sent, calls
}
