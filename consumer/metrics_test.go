package consumer

import (
	"context"
	"testing"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

func TestMetricsReportTheLoopsCounters(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())

	drv := newScriptLog(true)
	drv.add("", 7)
	l, err := New(drv, WithName("orders"), WithMeterProvider(mp))
	if err != nil {
		t.Fatal(err)
	}
	stop := runLoop(t, l, HandlerFunc(func(context.Context, *Message) error { return nil }))
	eventually(t, "all acked", func() bool { return l.Stats().Acked == 7 })

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if s, ok := m.Data.(metricdata.Sum[int64]); ok {
				for _, dp := range s.DataPoints {
					if v, _ := dp.Attributes.Value("messaging.consumer.group.name"); v.AsString() != "orders" {
						t.Errorf("%s: consumer name attribute = %q", m.Name, v.AsString())
					}
					got[m.Name] = dp.Value
				}
			}
		}
	}
	if got[MetricConsumed] != 7 || got[MetricAcked] != 7 {
		t.Fatalf("collected %v, want 7 consumed and 7 acked", got)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}
