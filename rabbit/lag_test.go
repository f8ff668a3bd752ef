package rabbit_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/rabbit"
)

// The lag the loop reports (Health.Lag: the driver's Messages plus
// InFlight) is what is not yet done: the queue's ready messages, the
// deliveries the broker pushed ahead that the loop has not taken (the
// prefetch beyond the loop's MaxInFlight), and those the loop holds
// (running, and queued for a worker). Before, the pushed ones were missing.
func TestLagCountsReadyPrefetchedAndRunning(t *testing.T) {
	amqpURL(t)
	name := testenv.UniqueName(t, "lag")
	deleteLater(t, []string{name}, nil)
	b := dial(t, rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: name, DeadLetterExchange: name + ".dlx"}}}))
	const (
		total       = 25
		prefetch    = 10 // pushed by the broker
		maxInFlight = 4  // taken by the loop
		concurrency = 2  // running
	)
	msgs := make([]consumer.Message, total)
	for i := range msgs {
		msgs[i] = consumer.Message{Body: []byte(strconv.Itoa(i))}
	}
	must(t, b.Publish(testenv.Context(t, 10*time.Second), name, msgs...))

	d, err := openDriver(t, b, name, driver.Config{MaxInFlight: prefetch})
	must(t, err)
	c, err := consumer.New(d, consumer.WithMaxInFlight(maxInFlight), consumer.WithConcurrency(concurrency),
		consumer.WithHealthWindow(100*time.Millisecond, 3), consumer.WithLogger(testLogger(t)))
	must(t, err)
	release := make(chan struct{})
	stop := runLoop(t, c, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}))
	testenv.WaitFor(t, 20*time.Second, "the handlers to run and the loop to be full", func() bool {
		st := c.Stats()
		return st.Running == concurrency && st.InFlight == maxInFlight
	})
	testenv.WaitFor(t, 20*time.Second, "the broker to push the prefetch", func() bool {
		_, unacked := queueCounts(t, name)
		return unacked == prefetch
	})
	ready, unacked := queueCounts(t, name)
	if ready != total-prefetch {
		t.Fatalf("the broker says %d ready and %d unacked, want %d and %d", ready, unacked, total-prefetch, prefetch)
	}

	lag, err := c.Lag(testenv.Context(t, 10*time.Second))
	must(t, err)
	if lag.Messages != int64(ready) || lag.InFlight != int64(unacked) {
		t.Errorf("Lag: %d waiting and %d in flight, want %d ready and %d unacked (%d running, %d queued in the loop, %d pushed ahead)",
			lag.Messages, lag.InFlight, ready, unacked, concurrency, maxInFlight-concurrency, prefetch-maxInFlight)
	}
	var h consumer.Health
	testenv.WaitFor(t, 10*time.Second, "a health sample", func() bool {
		h = c.Health()
		return h.Samples > 0 && h.Lag >= 0
	})
	if h.Lag != total {
		t.Errorf("Health.Lag = %d, want %d: every message not done (%d ready, %d unacked)", h.Lag, total, ready, unacked)
	}
	close(release)
	testenv.WaitFor(t, 30*time.Second, "every message to be done", func() bool { return c.Stats().Acked == total })
	must(t, stop())
}
