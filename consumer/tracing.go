package consumer

import (
	"context"
	"errors"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// This file is tracing with OpenTelemetry: a consumer span for every handler
// run of a Loop (WithTracerProvider), a producer span for every message
// published through TracePublisher, and the W3C trace context carried
// between them in the message's headers, so that one trace follows a message
// from the code that published it, across the broker, into its handler.
// Attribute names are those of OpenTelemetry's messaging semantic
// conventions; Ferry's own are prefixed ferry.

// tracerName is the instrumentation scope of Ferry's spans.
const tracerName = "github.com/ferrymq/ferry/consumer"

// traceContext is the propagator of the trace context in message headers:
// W3C traceparent and tracestate, which every broker carries as a header.
var traceContext propagation.TextMapPropagator = propagation.TraceContext{}

// Span event names, added to the consumer span by the middleware.
const (
	// EventRetry is added when Retry runs the handler again in place.
	EventRetry = "ferry.retry"
	// EventDeadLetter is added when DeadLetter moves the message away.
	EventDeadLetter = "ferry.dead_letter"
)

// startRun starts the consumer span of one handler run and returns the
// context the handler gets.
func (dp *dispatcher) startRun(ctx context.Context, m *Message) (context.Context, trace.Span) {
	parent := traceContext.Extract(ctx, propagation.MapCarrier(m.Headers))
	attrs := make([]attribute.KeyValue, 0, 10)
	attrs = append(attrs,
		attribute.String("messaging.operation.name", "process"),
		attribute.String("messaging.operation.type", "process"),
		attribute.String("messaging.destination.name", m.Source),
		attribute.String("messaging.consumer.group.name", dp.l.cfg.name),
		attribute.Int("messaging.message.body.size", len(m.Body)),
		attribute.Int("ferry.attempt", m.Attempt),
		attribute.Int("ferry.deliveries", m.Deliveries),
	)
	if s := dp.l.caps.System; s != "" {
		attrs = append(attrs, attribute.String("messaging.system", s))
	}
	if m.ID != "" {
		attrs = append(attrs, attribute.String("messaging.message.id", m.ID))
	}
	if m.Lane != "" {
		attrs = append(attrs, attribute.String("messaging.destination.partition.id", m.Lane))
	}
	if m.Offset >= 0 {
		attrs = append(attrs, attribute.Int64("messaging.kafka.offset", m.Offset))
	}
	// The handler's context stays the delivery's own (its record, its
	// reservations, its lane's cancellation), with the span added.
	return dp.l.tracer.Start(parent, "process "+m.Source,
		trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...))
}

// endRun ends a run's span with its outcome.
func endRun(span trace.Span, err error) {
	switch {
	case err == nil:
		span.SetAttributes(attribute.String("ferry.outcome", "ack"))
	case IsHeld(err):
		span.SetAttributes(attribute.String("ferry.outcome", "held"))
	case IsDeferred(err):
		span.SetAttributes(attribute.String("ferry.outcome", "deferred"))
	default:
		outcome := "retry"
		if IsPermanent(err) {
			outcome = "permanent"
		}
		var p *PanicError
		if errors.As(err, &p) {
			outcome = "panic"
		}
		span.SetAttributes(attribute.String("ferry.outcome", outcome))
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

// addRunEvent adds an event to the span of the handler run behind ctx, if
// one is recording: nothing is built when tracing is off.
func addRunEvent(ctx context.Context, name string, attrs func() []attribute.KeyValue) {
	span := trace.SpanFromContext(ctx)
	if !span.IsRecording() {
		return
	}
	span.AddEvent(name, trace.WithAttributes(attrs()...))
}

// DestinationNamer is implemented by a Publisher whose destinations say
// more than the name of the queue, topic or exchange they reach (RabbitMQ's
// rabbit.ToExchange("orders") is "amq.exchange/orders"): DestinationName
// returns the name a user gave it ("orders"), which TracePublisher puts in
// its spans' names and messaging.destination.name.
type DestinationNamer interface {
	DestinationName(destination string) string
}

// destinationName is destination as p names it (see DestinationNamer),
// looking through Publishers that wrap another (an Unwrap method).
func destinationName(p Publisher, destination string) string {
	for range 8 {
		if n, ok := p.(DestinationNamer); ok {
			return n.DestinationName(destination)
		}
		u, ok := p.(interface{ Unwrap() Publisher })
		if !ok {
			break
		}
		p = u.Unwrap()
	}
	return destination
}

// systemOf is the messaging system p names (SystemNamer), or the one of
// the Publisher it wraps (an Unwrap() Publisher method), and "" when none
// does.
func systemOf(p Publisher) string {
	for range 8 {
		if n, ok := p.(SystemNamer); ok {
			return n.System()
		}
		u, ok := p.(interface{ Unwrap() Publisher })
		if !ok {
			break
		}
		p = u.Unwrap()
	}
	return ""
}

// TracePublisher returns a Publisher that publishes through p and makes a
// producer span of tp, "send DESTINATION", for every message, with the W3C
// trace context of that span written into a copy of the message's headers
// (traceparent, tracestate), so that the consumer span of the message's
// handler run is its child. A message that already carries a trace context
// (an outbox event written inside a traced transaction) continues that
// trace; otherwise the span is a child of ctx's. The spans' messaging.system
// is the one p names ("kafka", "aws_sqs", "rabbitmq", "ferry_memory"): every
// adapter's Broker is a SystemNamer, and so is a Publisher that wraps one
// and says so with an Unwrap() Publisher method; a Publisher that names no
// system is a *ConfigError. DESTINATION is the destination as p names it,
// when p is a DestinationNamer. A message the Publish call failed gets an
// error span.
func TracePublisher(p Publisher, tp trace.TracerProvider) (Publisher, error) {
	if p == nil {
		return nil, ConfigErrorf("Publisher", "must not be nil")
	}
	if tp == nil {
		return nil, ConfigErrorf("TracerProvider", "must not be nil")
	}
	system := systemOf(p)
	if system == "" {
		return nil, ConfigErrorf("Publisher", "%T names no messaging system: it is not a SystemNamer, nor does it wrap one (Unwrap() Publisher)", p)
	}
	return &tracePublisher{next: p, tracer: tp.Tracer(tracerName), system: system}, nil
}

// System is the messaging system of the Publisher it publishes through.
func (t *tracePublisher) System() string { return t.system }

type tracePublisher struct {
	next   Publisher
	tracer trace.Tracer
	system string
}

// Unwrap returns the Publisher it publishes through.
func (t *tracePublisher) Unwrap() Publisher { return t.next }

func (t *tracePublisher) Publish(ctx context.Context, destination string, msgs ...Message) error {
	name := destinationName(t.next, destination)
	spans := make([]trace.Span, len(msgs))
	out := make([]Message, len(msgs))
	for i, m := range msgs {
		parent := ctx
		if sc := trace.SpanContextFromContext(traceContext.Extract(context.Background(), propagation.MapCarrier(m.Headers))); sc.IsValid() {
			parent = trace.ContextWithRemoteSpanContext(ctx, sc)
		}
		attrs := []attribute.KeyValue{
			attribute.String("messaging.operation.name", "send"),
			attribute.String("messaging.operation.type", "send"),
			attribute.String("messaging.destination.name", name),
			attribute.Int("messaging.message.body.size", len(m.Body)),
		}
		if t.system != "" {
			attrs = append(attrs, attribute.String("messaging.system", t.system))
		}
		if m.ID != "" {
			attrs = append(attrs, attribute.String("messaging.message.id", m.ID))
		}
		sctx, span := t.tracer.Start(parent, "send "+name,
			trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(attrs...))
		spans[i] = span
		h := make(map[string]string, len(m.Headers)+2)
		for k, v := range m.Headers {
			h[k] = v
		}
		traceContext.Inject(sctx, propagation.MapCarrier(h))
		m.Headers = h
		out[i] = m
	}
	err := t.next.Publish(ctx, destination, out...)
	failed := map[int]error{}
	var pe *PublishError
	switch {
	case err == nil:
	case errors.As(err, &pe):
		for _, f := range pe.Failed {
			failed[f.Index] = f.Err
		}
	default:
		for i := range spans {
			failed[i] = err
		}
	}
	for i, span := range spans {
		if e, ok := failed[i]; ok {
			span.RecordError(e)
			span.SetStatus(codes.Error, e.Error())
		}
		span.End()
	}
	return err
}

// retryEventAttrs describes an in-place retry for its span event.
func retryEventAttrs(attempt int, delay time.Duration, err error) []attribute.KeyValue {
	return []attribute.KeyValue{
		attribute.Int("ferry.attempt", attempt),
		attribute.String("ferry.retry.delay", delay.String()),
		attribute.String("exception.message", err.Error()),
	}
}

// deadLetterEventAttrs describes a dead-lettering for its span event.
func deadLetterEventAttrs(destination, reason string, attempts int, err error) []attribute.KeyValue {
	a := []attribute.KeyValue{
		attribute.String("ferry.dead_letter.destination", destination),
		attribute.String("ferry.dead_letter.reason", reason),
		attribute.Int("ferry.attempts", attempts),
	}
	if err != nil {
		a = append(a, attribute.String("exception.message", err.Error()))
	}
	return a
}
