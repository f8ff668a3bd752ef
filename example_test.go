package ferry_test

import (
	"context"
	"fmt"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/consumer"
)

// Open picks the broker from a URL; the code that publishes and consumes
// is the same for every broker. Here the in-process one: swap the URL for
// kafka://127.0.0.1:9092, sqs://... or amqp://... to run on a real one.
func ExampleOpen() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b, err := ferry.Open(ctx, "mem://")
	if err != nil {
		panic(err)
	}
	defer b.Close()
	if err := b.Publish(ctx, "orders", consumer.Message{Key: "o-1", Body: []byte("order 1 created")}); err != nil {
		panic(err)
	}
	c, err := b.NewConsumer(ctx, "orders", consumer.WithName("billing"))
	if err != nil {
		panic(err)
	}
	err = c.Run(ctx, consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
		fmt.Println(string(m.Body))
		cancel() // one message is enough here
		return nil
	}))
	if err != nil {
		panic(err)
	}
	// Output: order 1 created
}
