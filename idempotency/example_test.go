package idempotency_test

import (
	"context"
	"fmt"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
)

func Example() {
	store := idempotency.NewMemoryStore()
	dedup, err := idempotency.New(store, "billing") // the consumer's name
	if err != nil {
		panic(err)
	}
	charge := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		fmt.Printf("charging for order %s\n", m.Body)
		return nil
	})
	h := consumer.Chain(charge, dedup.Wrap)

	// The same event, delivered three times (a publisher retry, a redelivery).
	for i := range 3 {
		m := &consumer.Message{
			ID:      fmt.Sprintf("broker-id-%d", i),
			Body:    []byte("42"),
			Headers: map[string]string{idempotency.EventIDHeader: "order-42-paid"},
		}
		if err := h.Handle(context.Background(), m); err != nil {
			panic(err)
		}
	}
	// Output:
	// charging for order 42
}
