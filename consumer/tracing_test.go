package consumer_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/memory"
)

// tracing is a tracer provider whose ended spans a test can read.
func tracing(t *testing.T) (*sdktrace.TracerProvider, *tracetest.SpanRecorder) {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return tp, rec
}

func spanNamed(spans []sdktrace.ReadOnlySpan, name string) sdktrace.ReadOnlySpan {
	for _, s := range spans {
		if s.Name() == name {
			return s
		}
	}
	return nil
}

func attrOf(s sdktrace.ReadOnlySpan, key string) (attribute.Value, bool) {
	for _, kv := range s.Attributes() {
		if string(kv.Key) == key {
			return kv.Value, true
		}
	}
	return attribute.Value{}, false
}

func hasEvent(s sdktrace.ReadOnlySpan, name string) bool {
	for _, e := range s.Events() {
		if e.Name == name {
			return true
		}
	}
	return false
}

// One trace follows a message from the code that published it, through the
// broker, into its handler: the producer span is the child of the
// publisher's span, the consumer span the child of the producer span, and
// the retry made in place is an event of the consumer span.
func TestATraceFollowsAMessageFromItsPublishToItsHandler(t *testing.T) {
	tp, rec := tracing(t)
	b, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	pub, err := consumer.TracePublisher(b, tp)
	if err != nil {
		t.Fatal(err)
	}
	ctx, request := tp.Tracer("test").Start(context.Background(), "place order")
	if err := pub.Publish(ctx, "orders", consumer.Message{ID: "o-1", Body: []byte("order 1")}); err != nil {
		t.Fatal(err)
	}
	request.End()

	stack, err := consumer.Standard(b, "orders-dlq",
		consumer.StandardRetry(consumer.RetryAttempts(3), consumer.RetryInitial(time.Millisecond)))
	if err != nil {
		t.Fatal(err)
	}
	l, err := b.NewConsumer(ctx, "orders", consumer.WithName("billing"), consumer.WithTracerProvider(tp))
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	runCtx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	var inHandler trace.SpanContext
	go func() {
		done <- l.Run(runCtx, stack.Wrap(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			if runs.Add(1) == 1 {
				return errors.New("payments API blipped")
			}
			inHandler = trace.SpanContextFromContext(ctx)
			cancel()
			return nil
		})))
	}()
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	spans := rec.Ended()
	send, process := spanNamed(spans, "send orders"), spanNamed(spans, "process orders")
	if send == nil || process == nil {
		t.Fatalf("want a send and a process span, got %d spans", len(spans))
	}
	if send.SpanKind() != trace.SpanKindProducer || process.SpanKind() != trace.SpanKindConsumer {
		t.Fatalf("kinds: send %v, process %v", send.SpanKind(), process.SpanKind())
	}
	if send.Parent().SpanID() != request.SpanContext().SpanID() {
		t.Errorf("the producer span's parent is %v, want the publisher's span", send.Parent().SpanID())
	}
	if process.Parent().SpanID() != send.SpanContext().SpanID() || process.SpanContext().TraceID() != request.SpanContext().TraceID() {
		t.Errorf("the consumer span is not the producer span's child in the same trace (parent %v)", process.Parent().SpanID())
	}
	if inHandler.SpanID() != process.SpanContext().SpanID() {
		t.Errorf("the handler's context carries span %v, want the consumer span", inHandler.SpanID())
	}
	for key, want := range map[string]string{
		"messaging.system": "ferry_memory", "messaging.destination.name": "orders",
		"messaging.consumer.group.name": "billing", "messaging.operation.type": "process", "ferry.outcome": "ack",
	} {
		if v, ok := attrOf(process, key); !ok || v.AsString() != want {
			t.Errorf("process span %s = %q, want %q", key, v.AsString(), want)
		}
	}
	if v, ok := attrOf(process, "messaging.message.id"); !ok || v.AsString() == "" {
		t.Errorf("process span has no message id")
	}
	if !hasEvent(process, consumer.EventRetry) {
		t.Errorf("the in-place retry is not an event of the consumer span: %v", process.Events())
	}
	if v, ok := attrOf(send, "messaging.system"); !ok || v.AsString() != "ferry_memory" {
		t.Errorf("send span messaging.system = %q", v.AsString())
	}
}

// A dead-lettered message continues the trace of the run that gave up on it
// (its traceparent is the consumer span's), and the consumer span says so
// in an event and an error status.
func TestADeadLetterContinuesTheTraceOfTheRunThatGaveUp(t *testing.T) {
	tp, rec := tracing(t)
	b, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if err := b.Publish(context.Background(), "orders", consumer.Message{ID: "bad", Body: []byte("{")}); err != nil {
		t.Fatal(err)
	}
	stack, err := consumer.Standard(b, "orders-dlq")
	if err != nil {
		t.Fatal(err)
	}
	l, err := b.NewConsumer(t.Context(), "orders", consumer.WithTracerProvider(tp))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- l.Run(ctx, stack.Wrap(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
			return consumer.Permanent(errors.New("not an order"))
		})))
	}()
	testenv.WaitFor(t, 30*time.Second, "the dead letter", func() bool { return b.Stats("orders-dlq").Visible == 1 })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	process := spanNamed(rec.Ended(), "process orders")
	if process == nil {
		t.Fatal("no consumer span")
	}
	if !hasEvent(process, consumer.EventDeadLetter) {
		t.Errorf("no dead-letter event on the consumer span: %v", process.Events())
	}
	dl := b.Messages("orders-dlq")
	if len(dl) != 1 {
		t.Fatalf("dead-letter queue holds %d messages", len(dl))
	}
	carried := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier(dl[0].Headers)))
	if carried.SpanID() != process.SpanContext().SpanID() || carried.TraceID() != process.SpanContext().TraceID() {
		t.Errorf("the dead letter carries trace context %v/%v, want the consumer span's", carried.TraceID(), carried.SpanID())
	}
}

// A failed or held run marks its span for what it was: an error, or a hold
// that is not one.
func TestARunSpanSaysItsOutcome(t *testing.T) {
	tp, rec := tracing(t)
	b, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if err := b.Publish(context.Background(), "q", consumer.Message{ID: "m"}); err != nil {
		t.Fatal(err)
	}
	l, err := b.NewConsumer(t.Context(), "q", consumer.WithTracerProvider(tp), consumer.WithRedeliveryBackoff(time.Millisecond, time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- l.Run(ctx, consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
			switch runs.Add(1) {
			case 1:
				panic("boom")
			case 2:
				return consumer.Hold(errors.New("breaker open"), time.Millisecond)
			case 3:
				return errors.New("transient")
			}
			cancel()
			return nil
		}))
	}()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	var outcomes []string
	for _, s := range rec.Ended() {
		v, _ := attrOf(s, "ferry.outcome")
		outcomes = append(outcomes, v.AsString())
		isErr := s.Status().Code == codes.Error
		if wantErr := v.AsString() == "panic" || v.AsString() == "retry"; isErr != wantErr {
			t.Errorf("span with outcome %s has status %v", v.AsString(), s.Status())
		}
	}
	want := []string{"panic", "held", "retry", "ack"}
	if len(outcomes) != len(want) {
		t.Fatalf("outcomes %v, want %v", outcomes, want)
	}
	for i := range want {
		if outcomes[i] != want[i] {
			t.Fatalf("outcomes %v, want %v", outcomes, want)
		}
	}
}

// failSecond is a Publisher that refuses the second message of every call:
// what a broker's per-message refusal looks like to TracePublisher.
type failSecond struct{ got []consumer.Message }

func (f *failSecond) System() string { return "kafka" }

func (f *failSecond) Publish(_ context.Context, _ string, msgs ...consumer.Message) error {
	f.got = append(f.got, msgs...)
	return &consumer.PublishError{Failed: []consumer.FailedMessage{{Index: 1, Err: errors.New("too large")}}}
}

// TracePublisher marks exactly the refused message's span as an error, and
// never writes into the caller's headers.
func TestTracePublisherMarksOnlyTheRefusedMessage(t *testing.T) {
	tp, rec := tracing(t)
	next := &failSecond{}
	pub, err := consumer.TracePublisher(next, tp)
	if err != nil {
		t.Fatal(err)
	}
	mine := map[string]string{"k": "v"}
	err = pub.Publish(context.Background(), "d",
		consumer.Message{ID: "a", Headers: mine}, consumer.Message{ID: "b"}, consumer.Message{ID: "c"})
	var pe *consumer.PublishError
	if !errors.As(err, &pe) {
		t.Fatalf("Publish = %v, want the PublishError through", err)
	}
	if len(mine) != 1 {
		t.Errorf("the caller's headers were changed: %v", mine)
	}
	for _, m := range next.got {
		if m.Headers["traceparent"] == "" {
			t.Errorf("message %s went out without a traceparent", m.ID)
		}
	}
	spans := rec.Ended()
	if len(spans) != 3 {
		t.Fatalf("%d spans, want 3", len(spans))
	}
	for _, s := range spans {
		id, _ := attrOf(s, "messaging.message.id")
		if isErr := s.Status().Code == codes.Error; isErr != (id.AsString() == "b") {
			t.Errorf("span of %s: status %v", id.AsString(), s.Status())
		}
	}
	if _, err := consumer.TracePublisher(nil, tp); !errors.Is(err, consumer.ErrInvalidConfig) {
		t.Errorf("TracePublisher(nil) = %v, want a ConfigError", err)
	}
}

// prefixed publishes to destinations that carry a prefix beyond the name
// (as rabbit.ToExchange's do) and names them without it.
type prefixed struct{ got []string }

func (p *prefixed) Publish(_ context.Context, dest string, _ ...consumer.Message) error {
	p.got = append(p.got, dest)
	return nil
}

func (p *prefixed) DestinationName(dest string) string { return strings.TrimPrefix(dest, "via/") }

func (p *prefixed) System() string { return "rabbitmq" }

// wrapper is a Publisher over another that says which (an Unwrap method).
type wrapper struct{ next consumer.Publisher }

func (w wrapper) Publish(ctx context.Context, dest string, msgs ...consumer.Message) error {
	return w.next.Publish(ctx, dest, msgs...)
}

func (w wrapper) Unwrap() consumer.Publisher { return w.next }

// A Publisher that is a DestinationNamer, or wraps one, has its spans name
// the destination as it names it (span name and messaging.destination.name),
// while the message still goes to the destination as given.
func TestTracePublisherNamesTheDestinationAsThePublisherDoes(t *testing.T) {
	for _, tc := range []struct {
		name string
		wrap func(consumer.Publisher) consumer.Publisher
	}{
		{"namer", func(p consumer.Publisher) consumer.Publisher { return p }},
		{"wrapped namer", func(p consumer.Publisher) consumer.Publisher { return wrapper{p} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tp, rec := tracing(t)
			next := &prefixed{}
			pub, err := consumer.TracePublisher(tc.wrap(next), tp)
			if err != nil {
				t.Fatal(err)
			}
			if err := pub.Publish(context.Background(), "via/orders", consumer.Message{ID: "a"}); err != nil {
				t.Fatal(err)
			}
			if len(next.got) != 1 || next.got[0] != "via/orders" {
				t.Errorf("published to %v, want via/orders", next.got)
			}
			s := spanNamed(rec.Ended(), "send orders")
			if s == nil {
				t.Fatalf("no span %q among %d", "send orders", len(rec.Ended()))
			}
			if v, _ := attrOf(s, "messaging.destination.name"); v.AsString() != "orders" {
				t.Errorf("messaging.destination.name = %q, want orders", v.AsString())
			}
			// The system is the one the publisher (or the one it wraps) names.
			if v, _ := attrOf(s, "messaging.system"); v.AsString() != "rabbitmq" {
				t.Errorf("messaging.system = %q, want rabbitmq", v.AsString())
			}
		})
	}
}

// anonymous is a Publisher that names no messaging system.
type anonymous struct{}

func (anonymous) Publish(context.Context, string, ...consumer.Message) error { return nil }

// A Publisher that names no system, nor wraps one that does, is refused
// with a ConfigError naming the field: spans without messaging.system
// break the conventions' required attribute.
func TestTracePublisherRefusesAPublisherThatNamesNoSystem(t *testing.T) {
	tp, _ := tracing(t)
	for _, p := range []consumer.Publisher{anonymous{}, wrapper{anonymous{}}} {
		_, err := consumer.TracePublisher(p, tp)
		var ce *consumer.ConfigError
		if !errors.As(err, &ce) || ce.Field != "Publisher" || !strings.Contains(err.Error(), "names no messaging system") {
			t.Errorf("TracePublisher(%T) = %v, want a ConfigError for Publisher saying it names no messaging system", p, err)
		}
	}
}
