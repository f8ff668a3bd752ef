package consumer_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/memory"
)

// The recommended stack around a handler: a body that does not decode is a
// permanent error, so its message goes to the dead-letter queue at once, with
// the story in its headers, and the good message next to it is unaffected.
func ExampleStandard() {
	broker, err := memory.New()
	if err != nil {
		panic(err)
	}
	defer broker.Close()
	_ = broker.Publish(context.Background(), "orders",
		consumer.Message{ID: "o-1", Body: []byte(`{"qty":1}`)},
		consumer.Message{ID: "o-2", Body: []byte(`{"qty":`)})

	discard := slog.New(slog.DiscardHandler)
	stack, err := consumer.Standard(broker, "orders-dlq",
		consumer.StandardRetry(consumer.RetryAttempts(3), consumer.RetryInitial(50*time.Millisecond)),
		consumer.StandardBreaker(consumer.BreakerFailures(5), consumer.BreakerOpenFor(10*time.Second)),
		consumer.StandardDeadLetter(consumer.DeadLetterMaxAttempts(5), consumer.DeadLetterConsumerName("billing"),
			consumer.DeadLetterLogger(discard)),
		consumer.StandardTimeout(30*time.Second))
	if err != nil {
		fmt.Println(err)
		return
	}
	handle := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		var order struct{ Qty int }
		if err := json.Unmarshal(m.Body, &order); err != nil {
			return consumer.Permanent(fmt.Errorf("decode order: %w", err))
		}
		fmt.Println("processed", m.ID, "qty", order.Qty)
		return nil
	})

	loop, err := broker.NewConsumer(context.Background(), "orders", consumer.WithName("billing"), consumer.WithLogger(discard))
	if err != nil {
		fmt.Println(err)
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- loop.Run(ctx, stack.Wrap(handle)) }()
	for broker.Stats("orders").Acked < 2 {
		time.Sleep(time.Millisecond)
	}
	cancel()
	<-done

	for _, m := range broker.Messages("orders-dlq") {
		fmt.Println("dead-lettered", m.Headers[consumer.HeaderDLQMessageID],
			m.Headers[consumer.HeaderDLQReason], "after", m.Headers[consumer.HeaderDLQAttempts], "attempt(s):",
			m.Headers[consumer.HeaderDLQError])
	}
	fmt.Println("breaker", stack.Breaker.State(), "- dead letters", stack.DeadLetter.Count())
	// Output:
	// processed o-1 qty 1
	// dead-lettered o-2 permanent after 1 attempt(s): permanent: decode order: unexpected end of JSON input
	// breaker closed - dead letters 1
}

// A partner API that takes 50 calls a second: the stack starts at most that
// many runs a second (after a quiet while, up to 5 at once), each run
// waiting for its turn before the handler is called.
func ExampleStandardRateLimit() {
	broker, err := memory.New()
	if err != nil {
		panic(err)
	}
	defer broker.Close()
	stack, err := consumer.Standard(broker, "invoices-dlq",
		consumer.StandardRateLimit(50, consumer.RateLimitBurst(5)))
	if err != nil {
		fmt.Println(err)
		return
	}
	handle := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return nil // call the partner API
	})
	_ = stack.Wrap(handle) // DeadLetter → Retry → Breaker → RateLimit → Timeout → Recover → handle
	fmt.Println(stack.RateLimit.Waited(), stack.RateLimit.Waiting())
	// Output: 0 0
}
