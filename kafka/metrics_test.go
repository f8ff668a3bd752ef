package kafka_test

import (
	"context"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/kafka"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// Publish reports each call as the messaging conventions name it: its
// duration and the messages sent, with messaging.system "kafka" and the
// topic.
func TestPublishReportsItsCallsAsTheConventionsNameThem(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	b := newBroker(t, kafka.WithMeterProvider(mp))
	topic := newTopic(t, b, "metrics", 1)
	ctx := ctxFor(t, 30*time.Second)
	if err := b.Publish(ctx, topic, consumer.Message{Body: []byte("a")}, consumer.Message{Body: []byte("b")}); err != nil {
		t.Fatal(err)
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	var sent int64
	var calls uint64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, dp := range d.DataPoints {
					sys, _ := dp.Attributes.Value("messaging.system")
					dest, _ := dp.Attributes.Value("messaging.destination.name")
					if m.Name == "messaging.client.sent.messages" && sys.AsString() == "kafka" && dest.AsString() == topic {
						sent += dp.Value
					}
				}
			case metricdata.Histogram[float64]:
				for _, dp := range d.DataPoints {
					op, _ := dp.Attributes.Value("messaging.operation.name")
					if m.Name == "messaging.client.operation.duration" && op.AsString() == "send" {
						calls += dp.Count
					}
				}
			}
		}
	}
	if sent != 2 || calls != 1 {
		t.Fatalf("sent %d in %d calls, want 2 in 1", sent, calls)
	}
}
