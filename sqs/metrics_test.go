package sqs_test

import (
	"context"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	ferrysqs "github.com/ferrymq/ferry/sqs"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// Publish reports each call as the messaging conventions name it: its
// duration and the messages sent, with messaging.system "aws_sqs" and the
// queue.
func TestPublishReportsItsCallsAsTheConventionsNameThem(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	c := newClient(t, nil)
	b := newBroker(t, c, ferrysqs.WithMeterProvider(mp))
	name, _ := createQueue(t, c, "metrics", queueConfig{visibility: 30 * time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := b.Publish(ctx, name, consumer.Message{Body: []byte("a")}, consumer.Message{Body: []byte("b")}); err != nil {
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
					if m.Name == "messaging.client.sent.messages" && sys.AsString() == "aws_sqs" && dest.AsString() == name {
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
