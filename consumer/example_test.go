package consumer_test

import (
	"context"
	"fmt"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/memory"
)

type orderPlaced struct {
	OrderID string `json:"order_id"`
	Total   int    `json:"total_cents"`
}

// A typed handler over the memory broker: JSON decodes each body into an
// orderPlaced. A body that does not decode never reaches the handler; it is
// a permanent error that names the field, for a DeadLetter middleware to
// move aside.
func ExampleJSON() {
	b, err := memory.New()
	if err != nil {
		panic(err)
	}
	defer b.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	_ = b.Publish(ctx, "orders",
		consumer.Message{Key: "o-1", Body: []byte(`{"order_id":"o-1","total_cents":1250}`)})

	h := consumer.JSON(func(ctx context.Context, o orderPlaced, m *consumer.Message) error {
		fmt.Printf("order %s: %d cents (attempt %d)\n", o.OrderID, o.Total, m.Attempt)
		cancel()
		return nil
	})
	bad := h.Handle(ctx, &consumer.Message{Body: []byte(`{"order_id":"o-2","total_cents":"twelve"}`)})
	fmt.Println("permanent:", consumer.IsPermanent(bad))
	fmt.Println(bad)

	c, err := b.NewConsumer(ctx, "orders", consumer.WithName("billing"))
	if err != nil {
		panic(err)
	}
	if err := c.Run(ctx, h); err != nil {
		panic(err)
	}
	// Output:
	// permanent: true
	// permanent: decode JSON body: field "total_cents" (at byte 40): json: cannot unmarshal string into Go struct field orderPlaced.total_cents of type int
	// order o-1: 1250 cents (attempt 1)
}

// Chain lists middleware outermost first: here logging sees every message
// before the idempotency or retry layers would.
func ExampleChain() {
	logging := func(next consumer.Handler) consumer.Handler {
		return consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			fmt.Println("start", m.ID)
			err := next.Handle(ctx, m)
			fmt.Println("end", m.ID, err)
			return err
		})
	}
	h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		fmt.Println("handle", m.ID)
		return nil
	}), logging)
	_ = h.Handle(context.Background(), &consumer.Message{ID: "m-1"})
	// Output:
	// start m-1
	// handle m-1
	// end m-1 <nil>
}
