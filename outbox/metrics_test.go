package outbox_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/memory"
	"github.com/ferrymq/ferry/outbox"
)

func TestEventIDHeaderIsWhatIdempotencyReads(t *testing.T) {
	if outbox.EventIDHeader != idempotency.EventIDHeader {
		t.Fatalf("outbox.EventIDHeader %q, idempotency.EventIDHeader %q", outbox.EventIDHeader, idempotency.EventIDHeader)
	}
}

// collect returns each metric's value (the sum of its points) by name.
func collect(t *testing.T, reader *sdkmetric.ManualReader) map[string]float64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, p := range d.DataPoints {
					out[m.Name] += float64(p.Value)
				}
			case metricdata.Gauge[int64]:
				for _, p := range d.DataPoints {
					out[m.Name] += float64(p.Value)
				}
			case metricdata.Gauge[float64]:
				for _, p := range d.DataPoints {
					out[m.Name] += p.Value
				}
			}
		}
	}
	return out
}

// The relay's metrics: the backlog while the publisher is down, its age,
// the events held for later (scheduled, in the backlog, and no age), and
// what was published once it is back.
func TestMetricsReportBacklogAgeAndPublished(t *testing.T) {
	b := openSQLite(t)
	ctx := testenv.Context(t, 30*time.Second)
	br, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer br.Close()
	pub := &flaky{Broker: br}
	pub.failing.Store(true)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	for i := range 5 {
		if err := b.add(ctx, outbox.Event{Destination: queue, Key: strconv.Itoa(i)}); err != nil {
			t.Fatal(err)
		}
	}
	// Two held for an hour: in the backlog and scheduled, not published.
	later := time.Now().Add(time.Hour)
	if err := b.add(ctx, outbox.Event{Destination: queue, Key: "later", NotBefore: later}, outbox.Event{Destination: queue, NotBefore: later}); err != nil {
		t.Fatal(err)
	}
	runRelay(t, b.store(t, ""), pub, fast(outbox.WithMeterProvider(mp))...)
	var m map[string]float64
	testenv.WaitFor(t, 20*time.Second, "no publish failure reported", func() bool {
		m = collect(t, reader)
		return m[outbox.MetricPublishFailures] >= 1
	})
	if m[outbox.MetricBacklog] != 7 || m[outbox.MetricScheduled] != 2 || m[outbox.MetricOldestAge] <= 0 || m[outbox.MetricLanes] != outbox.Lanes {
		t.Fatalf("metrics while the publisher is down: %v", m)
	}
	pub.failing.Store(false)
	testenv.WaitFor(t, 20*time.Second, "the drained backlog was not reported", func() bool {
		m = collect(t, reader)
		return m[outbox.MetricPublished] == 5 && m[outbox.MetricBacklog] == 2 && m[outbox.MetricScheduled] == 2 && m[outbox.MetricOldestAge] == 0
	})
}
