package lagcmd

import (
	"context"
	"strconv"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/rabbit"
)

// gaugeValue collects the metrics of reader and returns the value of the
// int64 gauge name.
func gaugeValue(t *testing.T, reader *sdkmetric.ManualReader, name string) (int64, bool) {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if g, ok := m.Data.(metricdata.Gauge[int64]); ok && m.Name == name && len(g.DataPoints) > 0 {
				return g.DataPoints[0].Value, true
			}
		}
	}
	return 0, false
}

// On RabbitMQ, with messages ready, pushed ahead to a consumer (its
// prefetch beyond the loop's MaxInFlight) and running, the consumer's
// Health.Lag and its ferry.consumer.lag metric are one number, every
// message not yet done: the queue's ready messages (Lag.Messages) and what
// the consumer holds, pushed and running (Lag.InFlight). ferry lag, in
// another process, sees the ready messages only (AMQP tells nobody else a
// consumer's unacked count) and says its in flight is unknown, so that its
// number is the metric's less what the consumers hold.
func TestLagOnRabbitMQAgreesWithTheConsumer(t *testing.T) {
	url, queue := rabbitQueue(t)
	const (
		total       = 25
		prefetch    = 10
		maxInFlight = 4
		concurrency = 2
	)
	b, err := rabbit.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	msgs := make([]consumer.Message, total)
	for i := range msgs {
		msgs[i] = consumer.Message{Body: []byte(strconv.Itoa(i))}
	}
	if err := b.Publish(context.Background(), queue, msgs...); err != nil {
		t.Fatal(err)
	}

	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { mp.Shutdown(context.Background()) })
	d, err := b.Driver(t.Context(), queue, driver.Config{MaxInFlight: prefetch})
	if err != nil {
		t.Fatal(err)
	}
	c, err := consumer.New(d, consumer.WithName("billing"), consumer.WithMaxInFlight(maxInFlight),
		consumer.WithConcurrency(concurrency), consumer.WithHealthWindow(100*time.Millisecond, 3), consumer.WithMeterProvider(mp))
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- c.Run(ctx, consumer.HandlerFunc(func(ctx context.Context, _ *consumer.Message) error {
			select {
			case <-release:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}))
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	deadline := time.Now().Add(30 * time.Second)
	for {
		lag, err := c.Lag(context.Background())
		st := c.Stats()
		if err == nil && st.Running == concurrency && lag.InFlight == prefetch && lag.Messages == total-prefetch {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the consumer did not settle into %d running and %d pushed: lag %+v (%v), stats %+v", concurrency, prefetch, lag, err, st)
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond) // a health sample of the settled state

	h := c.Health()
	waiting, ok := gaugeValue(t, reader, consumer.MetricLag)
	if !ok {
		t.Fatalf("no %s gauge", consumer.MetricLag)
	}
	code, out, errOut := ferryLag(t, context.Background(), queue, "--broker", url, "--samples", "2", "--interval", "100ms", "--json")
	if code != 1 && code != 0 {
		t.Fatalf("ferry lag exit %d: %s%s", code, out, errOut)
	}
	r := reports(t, out)[0]
	t.Logf("ferry lag %d (in flight %d), %s %d, Health.Lag %d", r.Lag, r.InFlight, consumer.MetricLag, waiting, h.Lag)
	if r.Lag != total-prefetch {
		t.Errorf("ferry lag says %d, want %d: the ready messages", r.Lag, total-prefetch)
	}
	if waiting != h.Lag {
		t.Errorf("%s says %d and Health.Lag %d, want one number", consumer.MetricLag, waiting, h.Lag)
	}
	if r.InFlight != -1 {
		t.Errorf("ferry lag's in flight %d, want unknown (-1): AMQP does not tell another process's unacked deliveries", r.InFlight)
	}
	if h.Lag != total || h.Lag != r.Lag+prefetch {
		t.Errorf("Health.Lag %d, want %d: ferry lag's %d and the %d the consumer holds (running, queued, pushed ahead)", h.Lag, total, r.Lag, prefetch)
	}
	close(release)
}
