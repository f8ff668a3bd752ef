package rabbit_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/rabbit"
)

// Declare an exchange and a quorum queue with a dead-letter exchange,
// publish two messages with their keys as routing keys, and consume them
// through the delivery loop. Run returns once its context ends, after
// acking what was handled.
func Example() {
	orders := exampleName("orders")
	url := os.Getenv("FERRY_AMQP_URL")
	if url == "" {
		url = "amqp://guest:guest@127.0.0.1:5672/"
	}
	defer removeExample(url, orders, orders+".dlq", orders+".dlx")

	b, err := rabbit.Dial(url, rabbit.WithTopology(rabbit.Topology{
		Exchanges: []rabbit.Exchange{{Name: orders, Kind: "topic"}, {Name: orders + ".dlx", Kind: "fanout"}},
		Queues: []rabbit.Queue{
			{Name: orders, DeadLetterExchange: orders + ".dlx", DeliveryLimit: 10},
			{Name: orders + ".dlq", DeadLetterExchange: orders + ".dlx"},
		},
		Bindings: []rabbit.Binding{
			{Exchange: orders, Queue: orders, Key: "order.#"},
			{Exchange: orders + ".dlx", Queue: orders + ".dlq"},
		},
	}))
	if err != nil {
		panic(err)
	}
	defer b.Close()

	ctx := context.Background()
	err = b.Publish(ctx, rabbit.ToExchange(orders),
		consumer.Message{ID: "o-1", Key: "order.created", Body: []byte("order 1")},
		consumer.Message{ID: "o-2", Key: "order.paid", Body: []byte("order 1 paid")},
	)
	if err != nil {
		panic(err)
	}

	c, err := b.NewConsumer(ctx, orders, consumer.WithConcurrency(1))
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	handled := 0
	err = c.Run(ctx, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		fmt.Printf("%s %s: %s (attempt %d)\n", m.ID, m.Key, m.Body, m.Attempt)
		if handled++; handled == 2 {
			cancel()
		}
		return nil
	}))
	if err != nil {
		panic(err)
	}
	// Output:
	// o-1 order.created: order 1 (attempt 1)
	// o-2 order.paid: order 1 paid (attempt 1)
}

// A destination is a queue, as on every broker: the message goes straight
// to it through the default exchange, and the Key travels in a header and
// reaches the handler.
func ExampleBroker_Publish_queue() {
	jobs := exampleName("jobs")
	url := os.Getenv("FERRY_AMQP_URL")
	if url == "" {
		url = "amqp://guest:guest@127.0.0.1:5672/"
	}
	defer removeExample(url, jobs)

	b, err := rabbit.Dial(url, rabbit.WithTopology(rabbit.Topology{
		Queues: []rabbit.Queue{{Name: jobs, Classic: true}},
	}))
	if err != nil {
		panic(err)
	}
	defer b.Close()
	ctx := context.Background()
	if err := b.Publish(ctx, jobs, consumer.Message{Key: "tenant-7", Body: []byte("resize image")}); err != nil {
		panic(err)
	}
	c, err := b.NewConsumer(ctx, jobs)
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	err = c.Run(ctx, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		var dv amqp.Delivery
		if m.As(&dv) {
			fmt.Printf("%s for %s, routing key is the queue: %v\n", m.Body, m.Key, dv.RoutingKey == jobs)
		}
		cancel()
		return nil
	}))
	if err != nil {
		panic(err)
	}
	// Output: resize image for tenant-7, routing key is the queue: true
}

// A message no queue is bound to take fails alone, with ErrUnroutable; the
// others of the call are published.
func ExampleBroker_Publish_unroutable() {
	events := exampleName("events")
	url := os.Getenv("FERRY_AMQP_URL")
	if url == "" {
		url = "amqp://guest:guest@127.0.0.1:5672/"
	}
	defer removeExample(url, events, events+".billing")

	b, err := rabbit.Dial(url, rabbit.WithTopology(rabbit.Topology{
		Exchanges: []rabbit.Exchange{{Name: events, Kind: "direct"}},
		Queues:    []rabbit.Queue{{Name: events + ".billing", Classic: true}},
		Bindings:  []rabbit.Binding{{Exchange: events, Queue: events + ".billing", Key: "invoice"}},
	}))
	if err != nil {
		panic(err)
	}
	defer b.Close()
	err = b.Publish(context.Background(), rabbit.ToExchange(events),
		consumer.Message{Key: "invoice", Body: []byte("invoice 1")},
		consumer.Message{Key: "refund", Body: []byte("refund 1")},
	)
	var pe *consumer.PublishError
	if errors.As(err, &pe) {
		for _, f := range pe.Failed {
			fmt.Printf("message %d unroutable: %v\n", f.Index, errors.Is(f.Err, rabbit.ErrUnroutable))
		}
	}
	// Output: message 1 unroutable: true
}

// Per-key partitioning over the consistent-hash exchange: each partition
// is a single-active-consumer queue, so one consumer at a time takes it, in
// order, and the loop keeps each key's order (Lane is the key).
func ExamplePartitioned() {
	t := rabbit.Partitioned("payments", 3, rabbit.Queue{DeadLetterExchange: "payments.dlx"})
	fmt.Println(t.Exchanges[0].Name, t.Exchanges[0].Kind)
	for _, q := range t.Queues {
		fmt.Println(q.Name, q.SingleActiveConsumer)
	}
	// Output:
	// payments x-consistent-hash
	// payments.0 true
	// payments.1 true
	// payments.2 true
}

// exampleName returns a fresh name for what an example declares (users
// pick their own).
func exampleName(prefix string) string {
	var p [4]byte
	_, _ = rand.Read(p[:])
	return "ferry-example-" + prefix + "-" + hex.EncodeToString(p[:])
}

// removeExample deletes what an example declared on the broker at url
// (queues and exchanges of those names).
func removeExample(url string, names ...string) {
	conn, err := amqp.DialConfig(url, amqp.Config{Dial: amqp.DefaultDial(5 * time.Second)})
	if err != nil {
		return
	}
	defer conn.Close()
	for _, n := range names {
		if ch, err := conn.Channel(); err == nil {
			ch.QueueDelete(n, false, false, false)
			ch.Close()
		}
		if ch, err := conn.Channel(); err == nil {
			ch.ExchangeDelete(n, false, false)
			ch.Close()
		}
	}
}
