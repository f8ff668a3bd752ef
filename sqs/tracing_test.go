package sqs_test

import (
	"context"
	"testing"
	"time"

	"github.com/ferrymq/ferry/internal/tracecheck"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/ferrymq/ferry/consumer"
)

// One trace follows a message across SQS, on a standard and on a FIFO
// queue: the W3C trace context the producer span writes into the message's
// headers (message attributes) comes back out of the message, and the
// consumer span of its handler run is the producer span's child, in the
// trace of the span that published it.
func TestATraceFollowsAMessageAcrossSQS(t *testing.T) {
	for _, fifo := range []bool{false, true} {
		name := "standard"
		if fifo {
			name = "fifo"
		}
		t.Run(name, func(t *testing.T) {
			rec := tracetest.NewSpanRecorder()
			tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
			t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })

			c := newClient(t, nil)
			b := newBroker(t, c)
			queue, _ := createQueue(t, c, "trace", queueConfig{fifo: fifo, visibility: 30 * time.Second})
			pub, err := consumer.TracePublisher(b, tp)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			ctx, request := tp.Tracer("test").Start(ctx, "place order")
			// Eleven headers of the caller's own: with traceparent the
			// message carries more than SQS's ten attributes.
			h := map[string]string{}
			for _, k := range []string{"a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k"} {
				h["x-"+k] = k
			}
			if err := pub.Publish(ctx, queue, consumer.Message{ID: "o-1", Key: "o-1", Body: []byte("order 1"), Headers: h}); err != nil {
				t.Fatal(err)
			}
			request.End()

			l, err := b.NewConsumer(ctx, queue, consumer.WithName("billing"), consumer.WithTracerProvider(tp))
			if err != nil {
				t.Fatal(err)
			}
			got := make(chan trace.SpanContext, 1)
			r := start(t, l, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
				select {
				case got <- trace.SpanContextFromContext(ctx):
				default:
				}
				return nil
			}))
			var inHandler trace.SpanContext
			select {
			case inHandler = <-got:
			case <-ctx.Done():
				t.Fatal("the message was not consumed")
			}
			r.stop(t)
			tracecheck.OneTrace(t, rec.Ended(), "send "+queue, "process "+queue, request.SpanContext(), inHandler, "aws_sqs")
		})
	}
}
