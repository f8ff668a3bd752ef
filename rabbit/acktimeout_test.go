package rabbit_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/rabbit"
)

// TestAckTimeoutIsRecovered: when a handler outlives the broker's
// consumer_timeout, the broker closes the channel with 406; the driver
// notices, revokes (the handler's context ends), logs the advice, and
// consumes again on a new channel, where the message is handled.
func TestAckTimeoutIsRecovered(t *testing.T) {
	amqpURL(t)
	ctl(t, "status")
	t.Cleanup(func() {
		ctl(t, "eval", "application:set_env(rabbit, consumer_timeout, 1800000).")
		ctl(t, "eval", "application:set_env(rabbit, channel_tick_interval, 60000).")
	})
	// Channels read both when they open.
	ctl(t, "eval", "application:set_env(rabbit, consumer_timeout, 1000).")
	ctl(t, "eval", "application:set_env(rabbit, channel_tick_interval, 500).")

	q := testenv.UniqueName(t, "acktimeout")
	deleteLater(t, []string{q}, nil)
	logger, logs := capture(t)
	b := dial(t, rabbit.WithLogger(logger), rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: q, DeadLetterExchange: "x"}}}))
	must(t, b.Publish(testenv.Context(t, 10*time.Second), q, consumer.Message{ID: "slow", Body: []byte("x")}))
	var runs, cancelled, ok atomic.Int64
	c, err := b.NewConsumer(t.Context(), q, consumer.WithLogger(logger))
	must(t, err)
	stop := runLoop(t, c, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if runs.Add(1) == 1 {
			<-ctx.Done() // outlives the consumer_timeout; ends with the revocation
			cancelled.Add(1)
			return ctx.Err()
		}
		ok.Add(1)
		return nil
	}))
	testenv.WaitFor(t, 30*time.Second, "the message to be handled on a new channel", func() bool { return ok.Load() == 1 })
	// Restore the timeout before anything else opens a channel.
	ctl(t, "eval", "application:set_env(rabbit, consumer_timeout, 1800000).")
	must(t, stop())
	if cancelled.Load() != 1 {
		t.Error("the timed-out handler's context did not end")
	}
	if !strings.Contains(logs.String(), "consumer_timeout") {
		t.Error("no log line names consumer_timeout")
	}
	if st := c.Stats(); st.Revoked == 0 {
		t.Errorf("no revocation counted: %+v", st)
	}
}
