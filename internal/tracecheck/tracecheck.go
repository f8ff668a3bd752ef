// Package tracecheck holds the checks the adapters' telemetry tests share:
// one trace from a publish across a real broker to its handler, and what a
// publish records in the messaging metrics.
package tracecheck

import (
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// OneTrace checks that the producer span is the publisher's child, the
// consumer span the producer span's child, all in one trace, and that the
// handler ran in the consumer span.
func OneTrace(t testing.TB, spans []sdktrace.ReadOnlySpan, sendName, processName string, request, inHandler trace.SpanContext, system string) {
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
