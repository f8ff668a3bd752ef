package idempotency_test

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/memory"
)

// A duplicate that arrives while the first copy is still running waits (it
// is deferred); it must never be dead-lettered for waiting, whatever the
// number of redeliveries it takes, and it must not open the breaker.
func TestDuplicateWaitingBehindALongHandlerIsNeverDeadLettered(t *testing.T) {
	b, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if err := b.CreateQueue("orders", memory.QueueConfig{VisibilityTimeout: 5 * time.Second}); err != nil {
		t.Fatal(err)
	}
	stack, err := consumer.Standard(b, "orders-dlq",
		consumer.StandardDeadLetter(consumer.DeadLetterMaxAttempts(2)),
		consumer.StandardRetry(consumer.RetryAttempts(1)),
		consumer.StandardBreaker(consumer.BreakerFailures(1)))
	if err != nil {
		t.Fatal(err)
	}
	dedup, err := idempotency.New(idempotency.NewMemoryStore(), "billing",
		idempotency.WithInProgressDelay(20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	release := make(chan struct{})
	h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		runs.Add(1)
		<-release // the first copy runs long
		return nil
	}), stack.Wrap, dedup.Wrap)

	event := consumer.Message{Headers: map[string]string{idempotency.EventIDHeader: "evt-1"}, Body: []byte("x")}
	if err := b.Publish(context.Background(), "orders", event, event); err != nil {
		t.Fatal(err)
	}
	c, err := b.NewConsumer(t.Context(), "orders", consumer.WithConcurrency(2), consumer.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = c.Run(ctx, h) }()

	// Let the duplicate be deferred many times over its MaxAttempts of 2.
	deadline := time.Now().Add(30 * time.Second)
	for c.Stats().Deferred < 10 {
		if time.Now().After(deadline) {
			t.Fatalf("the duplicate was not deferred repeatedly: %+v", c.Stats())
		}
		time.Sleep(5 * time.Millisecond)
	}
	close(release)
	for b.Stats("orders").Acked < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("not both copies acked: %+v", b.Stats("orders"))
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	wg.Wait()

	if n := stack.DeadLetter.Count(); n != 0 {
		t.Fatalf("%d message(s) dead-lettered; a deferred duplicate spent its attempts", n)
	}
	if runs.Load() != 1 {
		t.Fatalf("handler ran %d times, want once", runs.Load())
	}
	if stack.Breaker.Opened() != 0 {
		t.Fatal("deferred duplicates opened the breaker")
	}
	if n := b.Stats("orders").Acked; n != 2 || c.Stats().Returned != 0 {
		t.Fatalf("acked %d, returned %d: the deferred copy must wait in the consumer, not go back to the broker (which would count a delivery)", n, c.Stats().Returned)
	}
	if !errors.Is(consumer.Defer(errors.New("x"), 0), consumer.ErrDeferred) {
		t.Fatal("Defer does not match ErrDeferred")
	}
}
