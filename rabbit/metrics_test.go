package rabbit_test

import (
	"context"
	"testing"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/internal/tracecheck"
	"github.com/ferrymq/ferry/rabbit"
)

// Publish reports each call as the messaging conventions name it: its
// duration and the messages sent, with messaging.system "rabbitmq" and the
// destination as the user named it (the exchange, not amq.exchange/name), and
// error.type on a refused publish.
func TestPublishReportsItsCallsAsTheConventionsNameThem(t *testing.T) {
	q := testenv.UniqueName(t, "metrics")
	deleteLater(t, []string{q}, nil)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	b := dial(t, rabbit.WithMeterProvider(mp), rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: q, DeadLetterExchange: "x"}}}))
	ctx := context.Background()
	if err := b.Publish(ctx, q, consumer.Message{Body: []byte("a")}, consumer.Message{Body: []byte("b")}); err != nil {
		t.Fatal(err)
	}
	if err := b.Publish(ctx, rabbit.ToExchange("no-such-exchange-"+q), consumer.Message{Body: []byte("c")}); err == nil {
		t.Fatal("a publish to a missing exchange succeeded")
	}
	sent, calls := tracecheck.Sent(t, reader, "rabbitmq", q)
	if sent[""] != 2 || calls != 1 {
		t.Errorf("to the queue: sent %v in %d calls, want 2 in 1", sent, calls)
	}
	refused, _ := tracecheck.Sent(t, reader, "rabbitmq", "no-such-exchange-"+q)
	if len(refused) != 1 || refused[""] != 0 {
		t.Errorf("the refused publish is not counted with an error.type: %v", refused)
	}
}
