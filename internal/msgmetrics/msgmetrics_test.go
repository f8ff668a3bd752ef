package msgmetrics

import (
	"context"
	"testing"
	"time"

	"go.opentelemetry.io/otel/metric/noop"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// Successes and failures to two destinations each land in their own series,
// with the attributes the conventions ask for: the cached success options of
// one destination never carry another's name or an error.type.
func TestPublisherRecordsEachDestinationApart(t *testing.T) {
	rd := sdkmetric.NewManualReader()
	p, err := NewPublisher(sdkmetric.NewMeterProvider(sdkmetric.WithReader(rd)), "kafka")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for range 3 {
		p.Record(ctx, "orders", 2, time.Now(), nil)
	}
	p.Record(ctx, "payments", 1, time.Now(), nil)
	p.Record(ctx, "orders", 5, time.Now(), context.DeadlineExceeded)
	var rm metricdata.ResourceMetrics
	if err := rd.Collect(ctx, &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != SentMessages {
				continue
			}
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				dest, _ := dp.Attributes.Value(KeyDestination)
				et, _ := dp.Attributes.Value(KeyErrorType)
				sys, _ := dp.Attributes.Value(KeySystem)
				if sys.AsString() != "kafka" {
					t.Errorf("messaging.system = %q", sys.AsString())
				}
				got[dest.AsString()+"/"+et.AsString()] = dp.Value
			}
		}
	}
	want := map[string]int64{"orders/": 6, "payments/": 1, "orders/timeout": 5}
	if len(got) != len(want) {
		t.Fatalf("series %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: %d sent, want %d (all: %v)", k, got[k], v, got)
		}
	}
}

// BenchmarkPublisherRecord is one successful publish call's recording, with
// the no-op provider a service without metrics has.
func BenchmarkPublisherRecord(b *testing.B) {
	p, err := NewPublisher(noop.NewMeterProvider(), "kafka")
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	start := time.Now()
	b.ReportAllocs()
	for b.Loop() {
		p.Record(ctx, "orders", 1, start, nil)
	}
}
