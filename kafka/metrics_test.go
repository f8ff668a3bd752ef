package kafka_test

import (
	"context"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/internal/tracecheck"
	"github.com/ferrymq/ferry/kafka"
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
	ctx := testenv.Context(t, 30*time.Second)
	if err := b.Publish(ctx, topic, consumer.Message{Body: []byte("a")}, consumer.Message{Body: []byte("b")}); err != nil {
		t.Fatal(err)
	}
	sent, calls := tracecheck.Sent(t, reader, "kafka", topic)
	if sent[""] != 2 || calls != 1 {
		t.Fatalf("sent %v in %d calls, want 2 in 1", sent, calls)
	}
}
