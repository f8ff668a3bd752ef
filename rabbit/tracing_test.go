package rabbit_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ferrymq/ferry/internal/tracecheck"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/rabbit"
)

// One trace follows a message across RabbitMQ, published through an
// exchange and straight to a queue: the W3C trace context the producer span
// writes into the message's headers comes back out of the AMQP headers, and
// the consumer span of its handler run is the producer span's child, in the
// trace of the span that published it. Both spans name the destination as
// the user named it, the exchange or the queue: "send orders", never "send
// amq.exchange/orders" (the prefix of rabbit.ToExchange), in the span's
// name and in messaging.destination.name.
func TestATraceFollowsAMessageAcrossRabbitMQ(t *testing.T) {
	for _, direct := range []bool{false, true} {
		name := "exchange"
		if direct {
			name = "queue"
		}
		t.Run(name, func(t *testing.T) {
			rec := tracetest.NewSpanRecorder()
			tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
			t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })

			q := testenv.UniqueName(t, "trace")
			deleteLater(t, []string{q}, []string{q})
			b := dial(t, rabbit.WithTopology(rabbit.Topology{
				Exchanges: []rabbit.Exchange{{Name: q, Kind: "fanout"}},
				Queues:    []rabbit.Queue{{Name: q, DeadLetterExchange: q + ".dlx"}},
				Bindings:  []rabbit.Binding{{Exchange: q, Queue: q}},
			}))
			dest := q
			if !direct {
				dest = rabbit.ToExchange(q)
			}
			pub, err := consumer.TracePublisher(b, tp)
			if err != nil {
				t.Fatal(err)
			}
			ctx := testenv.Context(t, 60*time.Second)
			ctx, request := tp.Tracer("test").Start(ctx, "place order")
			if err := pub.Publish(ctx, dest, consumer.Message{Key: "o-1", Body: []byte("order 1")}); err != nil {
				t.Fatal(err)
			}
			request.End()

			l, err := b.NewConsumer(t.Context(), q, consumer.WithName("billing"), consumer.WithTracerProvider(tp))
			if err != nil {
				t.Fatal(err)
			}
			got := make(chan trace.SpanContext, 1)
			runCtx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() {
				done <- l.Run(runCtx, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
					select {
					case got <- trace.SpanContextFromContext(ctx):
					default:
					}
					return nil
				}))
			}()
			var inHandler trace.SpanContext
			select {
			case inHandler = <-got:
			case <-ctx.Done():
				t.Fatal("the message was not consumed")
			}
			cancel()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			spans := rec.Ended()
			tracecheck.OneTrace(t, spans, "send "+q, "process "+q, request.SpanContext(), inHandler, "rabbitmq")
			for _, s := range spans {
				for _, kv := range s.Attributes() {
					if kv.Key == "messaging.destination.name" && kv.Value.AsString() != q {
						t.Errorf("span %q: messaging.destination.name = %q, want %q", s.Name(), kv.Value.AsString(), q)
					}
				}
				if strings.Contains(s.Name(), rabbit.ExchangePrefix) {
					t.Errorf("span %q names the exchange prefix", s.Name())
				}
			}
		})
	}
}
