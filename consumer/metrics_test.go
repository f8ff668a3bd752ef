package consumer

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
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
	testenv.WaitFor(t, 20*time.Second, "all acked", func() bool { return l.Stats().Acked == 7 })

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

// lagCounter is a driver that reports a fixed lag and counts the asks.
type lagCounter struct {
	*scriptLog
	asks atomic.Int64
}

func (d *lagCounter) Lag(context.Context) (driver.Lag, error) {
	d.asks.Add(1)
	return driver.Lag{Messages: 42, OldestAge: 3 * time.Second}, nil
}

// A collection of the metrics between two health samples reports the last
// sample's lag and does not ask the broker again: each ask is a round trip
// (Kafka's takes three).
func TestMetricsReuseTheHealthSamplersLag(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())

	drv := &lagCounter{scriptLog: newScriptLog(true)}
	l, err := New(drv, WithName("orders"), WithMeterProvider(mp), WithHealthWindow(time.Hour, 3))
	if err != nil {
		t.Fatal(err)
	}
	stop := runLoop(t, l, HandlerFunc(func(context.Context, *Message) error { return nil }))
	defer stop()
	testenv.WaitFor(t, 20*time.Second, "the first health sample", func() bool { return l.Health().Samples == 1 })
	asked := drv.asks.Load()

	for range 5 {
		var rm metricdata.ResourceMetrics
		if err := reader.Collect(context.Background(), &rm); err != nil {
			t.Fatal(err)
		}
		var lag int64 = -1
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				if g, ok := m.Data.(metricdata.Gauge[int64]); ok && m.Name == MetricLag {
					lag = g.DataPoints[0].Value
				}
			}
		}
		if lag != 42 {
			t.Fatalf("%s = %d, want the driver's 42", MetricLag, lag)
		}
	}
	if n := drv.asks.Load() - asked; n != 0 {
		t.Errorf("5 collections asked the driver for the lag %d more times, want 0", n)
	}
}

// fixedLag is a driver that reports lag.
type fixedLag struct {
	*scriptLog
	lag driver.Lag
}

func (d *fixedLag) Lag(context.Context) (driver.Lag, error) { return d.lag, nil }

// Health.Lag and the lag metric are one number, the messages not yet done:
// on a queue, those waiting plus those taken and not settled, which it
// counts apart; on a log (lag per lane), its lag alone, which already
// counts the records taken and not committed.
func TestLagIsOneNumberForQueuesAndLogs(t *testing.T) {
	for _, tc := range []struct {
		name string
		lag  driver.Lag
		want int64
	}{
		{"queue", driver.Lag{Messages: 7, InFlight: 3}, 10},
		{"queue, in flight unknown", driver.Lag{Messages: 7, InFlight: -1}, 7},
		// A log's member counts what it fetched in InFlight, not in Messages:
		// the sum is the end offsets minus the committed ones, its lanes'.
		{"log", driver.Lag{Messages: 5, InFlight: 4, Lanes: map[string]int64{"0": 5, "1": 4}}, 9},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reader := sdkmetric.NewManualReader()
			mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
			defer mp.Shutdown(context.Background())
			l, err := New(&fixedLag{scriptLog: newScriptLog(true), lag: tc.lag}, WithMeterProvider(mp), WithHealthWindow(time.Hour, 3))
			if err != nil {
				t.Fatal(err)
			}
			stop := runLoop(t, l, HandlerFunc(func(context.Context, *Message) error { return nil }))
			defer stop()
			testenv.WaitFor(t, 20*time.Second, "the first health sample", func() bool { return l.Health().Samples == 1 })
			var rm metricdata.ResourceMetrics
			if err := reader.Collect(context.Background(), &rm); err != nil {
				t.Fatal(err)
			}
			var metricLag int64 = -1
			for _, sm := range rm.ScopeMetrics {
				for _, m := range sm.Metrics {
					if g, ok := m.Data.(metricdata.Gauge[int64]); ok && m.Name == MetricLag {
						metricLag = g.DataPoints[0].Value
					}
				}
			}
			if h := l.Health(); h.Lag != tc.want || metricLag != tc.want {
				t.Errorf("Health.Lag %d, %s %d; want both %d", h.Lag, MetricLag, metricLag, tc.want)
			}
		})
	}
}
