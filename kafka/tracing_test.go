package kafka_test

import (
	"context"
	"testing"
	"time"

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
	pub, err := consumer.TracePublisher(b, tp, "kafka")
	if err != nil {
		t.Fatal(err)
	}
	ctx, request := tp.Tracer("test").Start(ctxFor(t, 60*time.Second), "place order")
	if err := pub.Publish(ctx, topic, consumer.Message{Key: "o-1", Body: []byte("order 1")}); err != nil {
		t.Fatal(err)
	}
	request.End()

	l, err := b.NewConsumer(topic, consumer.WithName(topic+"-billing"), consumer.WithTracerProvider(tp))
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

	checkOneTrace(t, rec.Ended(), "send "+topic, "process "+topic, request.SpanContext(), inHandler, "kafka")
}

// checkOneTrace checks that the producer span is the publisher's child, the
// consumer span the producer span's child, all in one trace, and that the
// handler ran in the consumer span.
func checkOneTrace(t *testing.T, spans []sdktrace.ReadOnlySpan, sendName, processName string, request, inHandler trace.SpanContext, system string) {
	t.Helper()
	var send, process sdktrace.ReadOnlySpan
	for _, s := range spans {
		switch {
		case s.Name() == sendName && send == nil:
			send = s
		case s.Name() == processName && process == nil:
			process = s
		}
	}
	if send == nil || process == nil {
		t.Fatalf("want spans %q and %q, got %d spans", sendName, processName, len(spans))
	}
	if send.SpanKind() != trace.SpanKindProducer || process.SpanKind() != trace.SpanKindConsumer {
		t.Errorf("kinds: send %v, process %v", send.SpanKind(), process.SpanKind())
	}
	if send.Parent().SpanID() != request.SpanID() {
		t.Errorf("the producer span's parent is %v, want the publisher's span %v", send.Parent().SpanID(), request.SpanID())
	}
	if process.Parent().SpanID() != send.SpanContext().SpanID() {
		t.Errorf("the consumer span's parent is %v, want the producer span %v: the trace context did not cross the broker",
			process.Parent().SpanID(), send.SpanContext().SpanID())
	}
	if process.SpanContext().TraceID() != request.TraceID() || !process.Parent().IsRemote() {
		t.Errorf("the consumer span is in trace %v (remote parent %v), want the publisher's trace %v",
			process.SpanContext().TraceID(), process.Parent().IsRemote(), request.TraceID())
	}
	if inHandler.SpanID() != process.SpanContext().SpanID() {
		t.Errorf("the handler ran in span %v, want the consumer span", inHandler.SpanID())
	}
	for _, kv := range process.Attributes() {
		if kv.Key == "messaging.system" && kv.Value.AsString() != system {
			t.Errorf("consumer span messaging.system = %q, want %q", kv.Value.AsString(), system)
		}
	}
}
