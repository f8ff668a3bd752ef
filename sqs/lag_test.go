package sqs_test

import (
	"context"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
)

// TestLagReportsDepthAndOldestAge: Lag counts the visible and delayed
// messages, those in flight, and estimates the age of the oldest waiting
// message from the messages received, while some are still waiting.
func TestLagReportsDepthAndOldestAge(t *testing.T) {
	c := newClient(t, nil)
	b := newBroker(t, c)
	name, _ := createQueue(t, c, "lag", queueConfig{visibility: 30 * time.Second})
	ctx := context.Background()
	msgs := make([]consumer.Message, 25)
	for i := range msgs {
		msgs[i].Body = []byte("m")
	}
	if err := b.Publish(ctx, name, msgs...); err != nil {
		t.Fatal(err)
	}
	drv, err := b.Driver(ctx, name, driver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer drv.Close()
	lr := drv.(driver.LagReporter)
	lag, err := lr.Lag(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if lag.Messages != 25 || lag.InFlight != 0 || lag.OldestAge != 0 || !lag.Approximate {
		t.Errorf("before any receive: %+v, want 25 messages, none in flight, no age known, the counts approximate", lag)
	}
	time.Sleep(1200 * time.Millisecond)
	got := fetchN(t, drv, 10)
	lag, err = lr.Lag(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if lag.Messages != 25-int64(len(got)) || lag.InFlight != int64(len(got)) {
		t.Errorf("after receiving %d: %+v, want %d waiting and %d in flight", len(got), lag, 25-len(got), len(got))
	}
	if lag.OldestAge < time.Second || lag.OldestAge > time.Minute {
		t.Errorf("OldestAge = %s, want the age of the messages received (over a second)", lag.OldestAge)
	}
	// Lag through the consumer, once everything is handled: nothing waits.
	l, err := b.NewConsumer(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	start(t, l, consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }))
	testenv.WaitFor(t, 40*time.Second, "the rest to be handled", func() bool { return l.Stats().Acked == int64(25-len(got)) })
	lag, err = l.Lag(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if lag.Messages != 0 || lag.OldestAge != 0 {
		t.Errorf("with nothing waiting: %+v, want no messages and no age", lag)
	}
}
