package sqs_test

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"time"

	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/ferrymq/ferry/consumer"
	ferrysqs "github.com/ferrymq/ferry/sqs"
)

// exampleClient stands for the client an application builds, usually with
// config.LoadDefaultConfig (github.com/aws/aws-sdk-go-v2/config) and
// awssqs.NewFromConfig, which take credentials, region and endpoint from
// the default chain.
func exampleClient() *awssqs.Client {
	return awssqs.New(awssqs.Options{
		Region: "eu-west-1",
		// Room for a consumer's receives and batch calls.
		HTTPClient: awshttp.NewBuildableClient().WithTransportOptions(func(t *http.Transport) {
			t.MaxIdleConnsPerHost = 100
		}),
	})
}

// Consume a queue with the standard middleware, dead-lettering to another
// queue.
func Example() {
	ctx := context.Background()
	client := exampleClient()
	broker, err := ferrysqs.New(client)
	if err != nil {
		log.Fatal(err)
	}
	defer broker.Close()

	stack, err := consumer.Standard(broker, "orders-dlq")
	if err != nil {
		log.Fatal(err)
	}
	orders, err := broker.NewConsumer(ctx, "orders", consumer.WithConcurrency(16))
	if err != nil {
		log.Fatal(err) // a missing queue or refused credentials fail here
	}
	err = orders.Run(ctx, stack.Wrap(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		fmt.Printf("order %s: %s (attempt %d)\n", m.ID, m.Body, m.Attempt)
		return nil
	})))
	if err != nil {
		log.Fatal(err)
	}
}

// Publish to a FIFO queue: the key is the message group, the ID the
// deduplication id.
func ExampleBroker_Publish() {
	ctx := context.Background()
	broker, err := ferrysqs.New(exampleClient())
	if err != nil {
		log.Fatal(err)
	}
	err = broker.Publish(ctx, "payments.fifo",
		consumer.Message{ID: "pay-1", Key: "account-7", Body: []byte(`{"amount":100}`)},
		consumer.Message{ID: "pay-2", Key: "account-7", Body: []byte(`{"amount":-40}`),
			Headers: map[string]string{"trace-id": "4bf92f35"}},
	)
	if err != nil {
		log.Fatal(err) // a *consumer.PublishError says which messages failed
	}
}

// A handler reaches the SQS message itself, for attributes Ferry does not
// map.
func ExampleBroker_NewConsumer_as() {
	ctx := context.Background()
	broker, err := ferrysqs.New(exampleClient())
	if err != nil {
		log.Fatal(err)
	}
	c, err := broker.NewConsumer(ctx, "https://sqs.eu-west-1.amazonaws.com/123456789012/orders")
	if err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	_ = c.Run(ctx, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		var raw types.Message
		if m.As(&raw) {
			fmt.Println(raw.Attributes["ApproximateFirstReceiveTimestamp"])
		}
		return nil
	}))
}
