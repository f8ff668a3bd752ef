package sqs_test

import (
	"context"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/tracecheck"
	ferrysqs "github.com/ferrymq/ferry/sqs"
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
	sent, calls := tracecheck.Sent(t, reader, "aws_sqs", name)
	if sent[""] != 2 || calls != 1 {
		t.Fatalf("sent %v in %d calls, want 2 in 1", sent, calls)
	}
}
