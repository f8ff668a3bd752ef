package sqs_test

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"os"
	"strconv"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/credentials"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/ferrymq/ferry/consumer"
	ferrysqs "github.com/ferrymq/ferry/sqs"
)

// Consume a queue with the standard middleware, dead-lettering to another
// queue. The client here speaks to an SQS-compatible server (ElasticMQ, at
// FERRY_SQS_ENDPOINT); against AWS an application usually builds it with
// config.LoadDefaultConfig (github.com/aws/aws-sdk-go-v2/config) and
// awssqs.NewFromConfig, which take credentials, region and endpoint from
// the default chain.
func Example() {
	ctx := context.Background()
	endpoint := os.Getenv("FERRY_SQS_ENDPOINT")
	if endpoint == "" {
		endpoint = "http://127.0.0.1:9324"
	}
	client := awssqs.New(awssqs.Options{
		Region:       "us-east-1",
		BaseEndpoint: aws.String(endpoint),
		Credentials:  credentials.NewStaticCredentialsProvider("ferry", "ferry", ""),
		// Room for a consumer's receives and batch calls.
		HTTPClient: awshttp.NewBuildableClient().WithTransportOptions(func(t *http.Transport) {
			t.MaxIdleConnsPerHost = 100
		}),
	})
	broker, err := ferrysqs.New(client)
	if err != nil {
		log.Fatal(err)
	}
	defer broker.Close()

	orders := "orders-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	if err := broker.CreateSource(ctx, orders, consumer.SourceConfig{}); err != nil {
		log.Fatal(err)
	}
	defer broker.DeleteSource(ctx, orders)
	if err := broker.CreateSource(ctx, orders+"-dlq", consumer.SourceConfig{}); err != nil {
		log.Fatal(err)
	}
	defer broker.DeleteSource(ctx, orders+"-dlq")
	if err := broker.Publish(ctx, orders, consumer.Message{Key: "o-1", Body: []byte("order 1 created")}); err != nil {
		log.Fatal(err)
	}

	stack, err := consumer.Standard(broker, orders+"-dlq")
	if err != nil {
		log.Fatal(err)
	}
	c, err := broker.NewConsumer(ctx, orders, consumer.WithConcurrency(16))
	if err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	err = c.Run(ctx, stack.Wrap(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		fmt.Printf("%s: %s (attempt %d)\n", m.Key, m.Body, m.Attempt)
		cancel() // one message is enough here: Run deletes it and returns nil
		return nil
	})))
	if err != nil {
		log.Fatal(err) // a missing queue or refused credentials end Run
	}
	// Output: o-1: order 1 created (attempt 1)
}

// Publish to a FIFO queue: the key is the message group, the ID the
// deduplication id. The messages of one group are handled in order.
func ExampleBroker_Publish() {
	ctx := context.Background()
	endpoint := os.Getenv("FERRY_SQS_ENDPOINT")
	if endpoint == "" {
		endpoint = "http://127.0.0.1:9324"
	}
	broker, err := ferrysqs.New(awssqs.New(awssqs.Options{
		Region:       "us-east-1",
		BaseEndpoint: aws.String(endpoint),
		Credentials:  credentials.NewStaticCredentialsProvider("ferry", "ferry", ""),
	}))
	if err != nil {
		log.Fatal(err)
	}
	defer broker.Close()
	payments := "payments-" + strconv.FormatInt(time.Now().UnixNano(), 36) + ".fifo"
	if err := broker.CreateSource(ctx, payments, consumer.SourceConfig{FIFO: true}); err != nil {
		log.Fatal(err)
	}
	defer broker.DeleteSource(ctx, payments)

	err = broker.Publish(ctx, payments,
		consumer.Message{ID: "pay-1", Key: "account-7", Body: []byte(`{"amount":100}`)},
		consumer.Message{ID: "pay-2", Key: "account-7", Body: []byte(`{"amount":-40}`),
			Headers: map[string]string{"trace-id": "4bf92f35"}},
	)
	if err != nil {
		log.Fatal(err) // a *consumer.PublishError says which messages failed
	}

	c, err := broker.NewConsumer(ctx, payments)
	if err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	n := 0
	err = c.Run(ctx, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		fmt.Printf("%s: %s trace-id=%q\n", m.Key, m.Body, m.Headers["trace-id"])
		if n++; n == 2 {
			cancel()
		}
		return nil
	}))
	if err != nil {
		log.Fatal(err)
	}
	// Output:
	// account-7: {"amount":100} trace-id=""
	// account-7: {"amount":-40} trace-id="4bf92f35"
}

// A handler reaches the SQS message itself, for attributes Ferry does not
// map.
func ExampleBroker_NewConsumer_as() {
	ctx := context.Background()
	endpoint := os.Getenv("FERRY_SQS_ENDPOINT")
	if endpoint == "" {
		endpoint = "http://127.0.0.1:9324"
	}
	broker, err := ferrysqs.New(awssqs.New(awssqs.Options{
		Region:       "us-east-1",
		BaseEndpoint: aws.String(endpoint),
		Credentials:  credentials.NewStaticCredentialsProvider("ferry", "ferry", ""),
	}))
	if err != nil {
		log.Fatal(err)
	}
	defer broker.Close()
	orders := "orders-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	if err := broker.CreateSource(ctx, orders, consumer.SourceConfig{}); err != nil {
		log.Fatal(err)
	}
	defer broker.DeleteSource(ctx, orders)
	if err := broker.Publish(ctx, orders, consumer.Message{Body: []byte("order 1 created")}); err != nil {
		log.Fatal(err)
	}

	c, err := broker.NewConsumer(ctx, orders)
	if err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	err = c.Run(ctx, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		var raw types.Message
		if m.As(&raw) {
			fmt.Println("receive count:", raw.Attributes["ApproximateReceiveCount"])
		}
		cancel()
		return nil
	}))
	if err != nil {
		log.Fatal(err)
	}
	// Output: receive count: 1
}
