package kafka_test

import (
	"context"
	"testing"
	"time"

	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/internal/tracecheck"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/ferrymq/ferry/consumer"
)

// One trace follows a message across Kafka: the W3C trace context the
// producer span writes into the record's headers comes back out of the
// record, and the consumer span of its handler run is the producer span's
// child, in the trace of the span that published it.
func TestATraceFollowsARecordAcrossKafka(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })

	b := newBroker(t)
	topic := newTopic(t, b, "trace", 1)
	pub, err := consumer.TracePublisher(b, tp)
	if err != nil {
		t.Fatal(err)
	}
	ctx, request := tp.Tracer("test").Start(testenv.Context(t, 60*time.Second), "place order")
	if err := pub.Publish(ctx, topic, consumer.Message{Key: "o-1", Body: []byte("order 1")}); err != nil {
		t.Fatal(err)
	}
	request.End()

	l, err := b.NewConsumer(t.Context(), topic, consumer.WithName(topic+"-billing"), consumer.WithTracerProvider(tp))
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan trace.SpanContext, 1)
	r := runConsumer(t, l, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
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
		t.Fatal("the record was not consumed")
	}
	r.stop(t)

	tracecheck.OneTrace(t, rec.Ended(), "send "+topic, "process "+topic, request.SpanContext(), inHandler, "kafka")
}
