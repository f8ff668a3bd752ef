package memory_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/memory"
)

// Publish two messages and consume them with a handler through the delivery
// loop. Run returns once its context ends, after acking what was handled.
func Example() {
	b, err := memory.New()
	if err != nil {
		panic(err)
	}
	defer b.Close()
	if err := b.CreateQueue("orders", memory.QueueConfig{VisibilityTimeout: time.Minute}); err != nil {
		panic(err)
	}

	ctx := context.Background()
	err = b.Publish(ctx, "orders",
		consumer.Message{Key: "order-1", Body: []byte("order 1 created")},
		consumer.Message{Key: "order-2", Body: []byte("order 2 created")},
	)
	if err != nil {
		panic(err)
	}

	c, err := b.NewConsumer(ctx, "orders", consumer.WithConcurrency(1))
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	handled := 0
	err = c.Run(ctx, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		fmt.Printf("%s: %s (attempt %d)\n", m.Key, m.Body, m.Attempt)
		if handled++; handled == 2 {
			cancel()
		}
		return nil
	}))
	if err != nil {
		panic(err)
	}
	fmt.Printf("%+v\n", b.Stats("orders"))
	// Output:
	// order-1: order 1 created (attempt 1)
	// order-2: order 2 created (attempt 1)
	// {Visible:0 Delayed:0 InFlight:0 Acked:2 DeadLettered:0}
}

// A message whose handler keeps failing is moved to the dead-letter queue
// once it was received MaxReceiveCount times, as SQS redrive does.
func ExampleBroker_CreateQueue_deadLetterQueue() {
	b, err := memory.New()
	if err != nil {
		panic(err)
	}
	defer b.Close()
	if err := b.CreateQueue("payments-dlq", memory.QueueConfig{}); err != nil {
		panic(err)
	}
	err = b.CreateQueue("payments", memory.QueueConfig{MaxReceiveCount: 3, DeadLetterQueue: "payments-dlq"})
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	if err := b.Publish(ctx, "payments", consumer.Message{ID: "pay-42", Body: []byte("not json")}); err != nil {
		panic(err)
	}

	c, err := b.NewConsumer(ctx, "payments", consumer.WithRedeliveryBackoff(time.Millisecond, time.Millisecond))
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- c.Run(ctx, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			fmt.Printf("attempt %d fails\n", m.Attempt)
			return errors.New("cannot parse")
		}))
	}()
	for b.Stats("payments").DeadLettered == 0 {
		time.Sleep(time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		panic(err)
	}

	for _, m := range b.Messages("payments-dlq") {
		fmt.Printf("dead letter %s from %s after %s receives: %s\n",
			m.ID, m.Header(memory.HeaderSourceQueue), m.Header(memory.HeaderReceiveCount), m.Body)
	}
	// Output:
	// attempt 1 fails
	// attempt 2 fails
	// attempt 3 fails
	// dead letter pay-42 from payments after 3 receives: not json
}

// A message published with NotBefore waits, delayed, until then; the one
// published beside it without a time is consumed at once.
func ExampleBroker_Publish_notBefore() {
	b, err := memory.New()
	if err != nil {
		panic(err)
	}
	defer b.Close()
	if err := b.CreateQueue("reminders", memory.QueueConfig{}); err != nil {
		panic(err)
	}
	ctx := context.Background()
	remindAt := time.Now().Add(time.Second)
	err = b.Publish(ctx, "reminders",
		consumer.Message{Body: []byte("pay your invoice"), NotBefore: remindAt},
		consumer.Message{Body: []byte("invoice sent")},
	)
	if err != nil {
		panic(err)
	}
	fmt.Printf("%+v\n", b.Stats("reminders"))

	c, err := b.NewConsumer(ctx, "reminders", consumer.WithConcurrency(1))
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	handled := 0
	err = c.Run(ctx, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		fmt.Printf("%s (not early: %t)\n", m.Body, !time.Now().Before(remindAt) || string(m.Body) == "invoice sent")
		if handled++; handled == 2 {
			cancel()
		}
		return nil
	}))
	if err != nil {
		panic(err)
	}
	// Output:
	// {Visible:1 Delayed:1 InFlight:0 Acked:0 DeadLettered:0}
	// invoice sent (not early: true)
	// pay your invoice (not early: true)
}
