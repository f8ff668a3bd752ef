package memory_test

import (
	"context"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/memory"
)

// TestScheduledMessageDoesNotWedgeAnIdleConsumer: a consumer that handled
// all it could and has only a message scheduled for later (NotBefore)
// waiting makes no progress, and must not call itself wedged (failing its
// liveness probe, and restarting, for as long as the message waits): the
// message counts in its lag, but as delayed.
func TestScheduledMessageDoesNotWedgeAnIdleConsumer(t *testing.T) {
	b := newBroker(t)
	createQueue(t, b, "q", memory.QueueConfig{})
	const wedgedAfter = 300 * time.Millisecond
	l, err := b.NewConsumer(t.Context(), "q", consumer.WithHealthWindow(20*time.Millisecond, 3),
		consumer.WithWedgedAfter(wedgedAfter), consumer.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	var handled atomic.Int32
	testenv.Start(t, func(ctx context.Context) error {
		return l.Run(ctx, consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
			handled.Add(1)
			return nil
		}))
	})
	publish(t, b, "q", msg("now", "now"))
	testenv.WaitFor(t, 10*time.Second, "the first message handled", func() bool { return handled.Load() == 1 })
	later := msg("later", "later")
	later.NotBefore = time.Now().Add(time.Minute)
	publish(t, b, "q", later)
	testenv.WaitFor(t, 10*time.Second, "the health to count the scheduled message", func() bool { return l.Health().Lag == 1 })
	time.Sleep(3 * wedgedAfter)
	if h := l.Health(); h.State == consumer.HealthWedged || !h.Live {
		t.Errorf("Health = %s (live %t): %s; a consumer whose only lag is a scheduled message has nothing to do", h.State, h.Live, h.Reason)
	}
}
