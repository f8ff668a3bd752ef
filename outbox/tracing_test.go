package outbox_test

import (
	"context"
	"testing"
	"time"

	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/memory"
	"github.com/ferrymq/ferry/outbox"
)

// An event written inside a traced transaction carries that trace, and the
// relay's publish through a consumer.TracePublisher continues it: the
// producer span is the child of the span that wrote the event, on every
// backend. An event that brings its own trace context keeps it.
func TestTheRelaysPublishContinuesTheWritersTrace(t *testing.T) {
	forEachBackend(t, func(t *testing.T, b *backend) {
		ctx := testenv.Context(t, 60*time.Second)
		rec := tracetest.NewSpanRecorder()
		tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
		defer tp.Shutdown(context.Background())
		br, err := memory.New()
		if err != nil {
			t.Fatal(err)
		}
		defer br.Close()

		wctx, write := tp.Tracer("test").Start(ctx, "place order")
		own := map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
		if err := b.add(wctx,
			outbox.Event{ID: "traced", Destination: queue, Key: "k"},
			outbox.Event{ID: "own", Destination: queue, Key: "j", Headers: own},
		); err != nil {
			t.Fatal(err)
		}
		write.End()
		if err := b.add(ctx, outbox.Event{ID: "untraced", Destination: queue, Key: "u"}); err != nil {
			t.Fatal(err)
		}

		pub, err := consumer.TracePublisher(br, tp)
		if err != nil {
			t.Fatal(err)
		}
		st := b.store(t, "")
		runRelay(t, st, pub, fast()...)
		drain(t, st)

		sends := map[string]sdktrace.ReadOnlySpan{}
		for _, s := range rec.Ended() {
			if s.SpanKind() != trace.SpanKindProducer {
				continue
			}
			for _, kv := range s.Attributes() {
				if kv.Key == "messaging.message.id" {
					sends[kv.Value.AsString()] = s
				}
			}
		}
		if s := sends["traced"]; s == nil || s.Parent().SpanID() != write.SpanContext().SpanID() || s.SpanContext().TraceID() != write.SpanContext().TraceID() {
			t.Fatalf("the publish of the traced event is not the child of the span that wrote it (%v)", sends["traced"])
		}
		if s := sends["own"]; s == nil || s.SpanContext().TraceID().String() != "0af7651916cd43dd8448eb211c80319c" {
			t.Fatalf("an event's own trace context was not kept")
		}
		if s := sends["untraced"]; s == nil || s.Parent().IsValid() {
			t.Fatalf("an event written outside any span got a parent")
		}
		for _, m := range br.Messages(queue) {
			got := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier(m.Headers)))
			if want := sends[m.ID].SpanContext(); got.SpanID() != want.SpanID() {
				t.Errorf("message %s carries span %v, want its producer span %v", m.ID, got.SpanID(), want.SpanID())
			}
		}
	})
}
