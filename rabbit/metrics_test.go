package rabbit_test

import (
	"context"
	"testing"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/rabbit"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// Publish reports each call as the messaging conventions name it: its
// duration and the messages sent, with messaging.system "rabbitmq" and the
// destination as the user named it (the queue, not amq.default/queue), and
// error.type on a refused publish.
func TestPublishReportsItsCallsAsTheConventionsNameThem(t *testing.T) {
	q := testenv.UniqueName(t, "metrics")
	deleteLater(t, []string{q}, nil)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	b := dial(t, rabbit.WithMeterProvider(mp), rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: q, DeadLetterExchange: "x"}}}))
	ctx := context.Background()
	if err := b.Publish(ctx, rabbit.ToQueue(q), consumer.Message{Body: []byte("a")}, consumer.Message{Body: []byte("b")}); err != nil {
		t.Fatal(err)
	}
	if err := b.Publish(ctx, "no-such-exchange-"+q, consumer.Message{Body: []byte("c")}); err == nil {
		t.Fatal("a publish to a missing exchange succeeded")
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		t.Fatal(err)
	}
	sent := map[string]int64{} // by destination and error.type
	calls := map[string]uint64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				if m.Name != "messaging.client.sent.messages" {
					continue
				}
				for _, dp := range d.DataPoints {
					sys, _ := dp.Attributes.Value("messaging.system")
					dest, _ := dp.Attributes.Value("messaging.destination.name")
					et, _ := dp.Attributes.Value("error.type")
					if sys.AsString() != "rabbitmq" {
						t.Errorf("messaging.system = %q", sys.AsString())
					}
					sent[dest.AsString()+"|"+et.AsString()] += dp.Value
				}
			case metricdata.Histogram[float64]:
				if m.Name != "messaging.client.operation.duration" || m.Unit != "s" {
					continue
				}
				for _, dp := range d.DataPoints {
					dest, _ := dp.Attributes.Value("messaging.destination.name")
					calls[dest.AsString()] += dp.Count
				}
			}
		}
	}
	if sent[q+"|"] != 2 || calls[q] != 1 {
		t.Errorf("to the queue: sent %d in %d calls, want 2 in 1 (all: %v %v)", sent[q+"|"], calls[q], sent, calls)
	}
	refused := 0
	for k, n := range sent {
		if k != q+"|" && n == 1 && len(k) > len("no-such-exchange-") {
			refused++
		}
	}
	if refused != 1 {
		t.Errorf("the refused publish is not counted with an error.type: %v", sent)
	}
}
