package sqlitestore_test

import (
	"context"
	"database/sql"
	"log/slog"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/idempotency/sqlitestore"
	"github.com/ferrymq/ferry/memory"
)

// The inbox reports what it did under the idempotency middleware's metric
// names, through the MeterProvider of the Loop that runs it: nothing else
// is wired.
func TestInboxReportsItsCountsThroughTheLoopsMeterProvider(t *testing.T) {
	db := openDB(t)
	h, err := sqlitestore.NewInbox(db, "billing", func(context.Context, *sql.Tx, *consumer.Message) error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	b, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	l, err := b.NewConsumer(t.Context(), "orders", consumer.WithName("billing"), consumer.WithMeterProvider(mp),
		consumer.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	ev := func(id string) consumer.Message {
		return consumer.Message{Headers: map[string]string{idempotency.EventIDHeader: id}}
	}
	if err := b.Publish(context.Background(), "orders", ev("a"), ev("b"), ev("a")); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- l.Run(ctx, h) }()
	deadline := time.Now().Add(20 * time.Second)
	for l.Stats().Acked < 3 {
		if time.Now().After(deadline) {
			t.Fatalf("acked %d of 3", l.Stats().Acked)
		}
		time.Sleep(5 * time.Millisecond)
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if sum, ok := m.Data.(metricdata.Sum[int64]); ok {
				for _, dp := range sum.DataPoints {
					got[m.Name] += dp.Value
				}
			}
		}
	}
	if got[idempotency.MetricCompleted] != 2 || got[idempotency.MetricDuplicates] != 1 {
		t.Fatalf("completed %d, duplicates %d; want 2, 1 (all: %v)", got[idempotency.MetricCompleted], got[idempotency.MetricDuplicates], got)
	}
}
