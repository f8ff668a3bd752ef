package consumer_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/memory"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

func TestStackMetricsReportDeadLettersRetriesAndBreaker(t *testing.T) {
	b, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	stack, err := consumer.Standard(b, "orders-dlq",
		consumer.StandardRetry(consumer.RetryAttempts(3), consumer.RetryInitial(time.Millisecond)))
	if err != nil {
		t.Fatal(err)
	}
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	reg, err := stack.RegisterMetrics(mp, "billing")
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Unregister()

	calls := 0
	flaky := stack.Wrap(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		if calls++; calls == 1 {
			return errors.New("blip")
		}
		return nil
	}))
	if err := flaky.Handle(context.Background(), &consumer.Message{ID: "ok", Attempt: 1}); err != nil {
		t.Fatal(err)
	}
	poison := stack.Wrap(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		return consumer.Permanent(errors.New("bad input"))
	}))
	if err := poison.Handle(context.Background(), &consumer.Message{ID: "bad", Attempt: 1, Offset: -1}); err != nil {
		t.Fatalf("a dead-lettered message must be acked (nil), got %v", err)
	}

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				got[m.Name] = d.DataPoints[0].Value
			case metricdata.Gauge[int64]:
				got[m.Name] = d.DataPoints[0].Value
			}
		}
	}
	if got[consumer.MetricDeadLettered] != 1 || got[consumer.MetricRetries] != 1 || got[consumer.MetricBreakerState] != 0 {
		t.Fatalf("collected %v; want 1 dead-lettered, 1 retry, breaker closed (0)", got)
	}
	if n := b.Stats("orders-dlq").Visible; n != 1 {
		t.Fatalf("dead-letter queue holds %d messages, want 1", n)
	}
}
