package kafka_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/kafka"
)

// Publish two records of one key and handle them with a consumer group
// member. The key picks the partition (murmur2, as the Java client does),
// so the two records keep their order; each is committed once its handler
// returned nil.
func Example() {
	ctx := context.Background()
	seeds := os.Getenv("FERRY_KAFKA_BROKERS")
	if seeds == "" {
		seeds = "127.0.0.1:9092"
	}
	b, err := kafka.New(strings.Split(seeds, ","))
	if err != nil {
		log.Fatal(err)
	}
	defer b.Close()

	topic := "orders-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	if err := b.CreateTopic(ctx, topic, kafka.TopicConfig{Partitions: 3, Retention: time.Hour}); err != nil {
		log.Fatal(err)
	}
	defer b.DeleteTopic(ctx, topic)

	err = b.Publish(ctx, topic,
		consumer.Message{Key: "order-1", Body: []byte("created")},
		consumer.Message{Key: "order-1", Body: []byte("paid")},
	)
	if err != nil {
		log.Fatal(err)
	}

	// Every consumer of this topic named "billing" is a member of the
	// group "billing".
	c, err := b.NewConsumer(ctx, topic, consumer.WithName("billing"))
	if err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	n := 0
	err = c.Run(ctx, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		fmt.Printf("%s: %s (attempt %d)\n", m.Key, m.Body, m.Attempt)
		if n++; n == 2 {
			cancel() // Run drains, commits, leaves the group and returns nil
		}
		return nil
	}))
	if err != nil {
		log.Fatal(err)
	}
	// Output:
	// order-1: created (attempt 1)
	// order-1: paid (attempt 1)
}

// Many keys in one partition, handled at once: OrderByKey runs one record
// at a time per key, and the commit never passes a record that is not done,
// whatever finished after it.
func ExampleBroker_NewConsumer_orderByKey() {
	b, err := kafka.New([]string{"127.0.0.1:9092"})
	if err != nil {
		log.Fatal(err)
	}
	defer b.Close()
	c, err := b.NewConsumer(context.Background(), "payments",
		consumer.WithName("ledger"),
		consumer.WithOrdering(consumer.OrderByKey),
		consumer.WithConcurrency(64),
	)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(c.Name())
	// Output: ledger
}

// A broker reached through SASL_SSL: SCRAM over TLS. A wrong password makes
// Publish fail, and Run return, within seconds with an error matching
// ErrAuthentication; the password appears in no error and no log line.
func ExampleWithSASL() {
	// In real code:
	//
	//	kafka.WithTLS(&tls.Config{RootCAs: pool}),
	//	kafka.WithSASL(scram.Auth{User: user, Pass: pass}.AsSha512Mechanism()),
	//
	// Here, a nil TLS config shows the error that names the field.
	b, err := kafka.New([]string{"kafka.internal:9094"},
		kafka.WithTLS(nil),
		kafka.WithSASL(nil),
	)
	var ce *consumer.ConfigError
	fmt.Println(errors.As(err, &ce), ce.Field, b == nil)
	// Output: true TLS true
}

// franz-go options pass through; those that would break Ferry's commits or
// groups are refused at construction with a ConfigError naming the field.
func ExampleWithClientOpts() {
	_, err := kafka.New([]string{"127.0.0.1:9092"},
		kafka.WithClientOpts(kgo.FetchMaxBytes(16<<20), kgo.AutoCommitMarks()))
	fmt.Println(err)
	b, err := kafka.New([]string{"127.0.0.1:9092"},
		kafka.WithClientOpts(kgo.FetchMaxBytes(16<<20)), kafka.WithGroupProtocol(kafka.NextGen))
	fmt.Println(err)
	b.Close()
	// Output:
	// ferry: invalid configuration: ClientOpts kgo.AutoCommitMarks is not allowed: Ferry commits only what handlers finished
	// <nil>
}

// A record that fails for good goes to a dead-letter topic with its story
// (source, partition, offset, attempts, last error) through the Standard
// stack, and its partition moves on.
func ExampleBroker_Publish_deadLetter() {
	b, err := kafka.New([]string{"127.0.0.1:9092"})
	if err != nil {
		log.Fatal(err)
	}
	defer b.Close()
	stack, err := consumer.Standard(b, "orders-dlq")
	if err != nil {
		log.Fatal(err)
	}
	h := stack.Wrap(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return consumer.Permanent(errors.New("cannot parse"))
	}))
	_ = h // c.Run(ctx, h)
	fmt.Fprintln(os.Stdout, stack.DeadLetter.MaxAttempts())
	// Output: 10
}

// A service deployed as a StatefulSet makes each pod a static member of its
// groups, named after the pod, so that a rolling restart moves no
// partitions: a pod back within the session timeout gets its own again.
// A second consumer of one group on the Broker would join as the same
// member, and is refused.
func ExampleWithInstanceID() {
	pod := os.Getenv("HOSTNAME") // billing-0, billing-1, ...
	if pod == "" {
		pod = "billing-0"
	}
	b, err := kafka.New([]string{"127.0.0.1:9092"},
		kafka.WithInstanceID(pod),
		kafka.WithSessionTimeout(2*time.Minute), // longer than a pod's restart
	)
	if err != nil {
		log.Fatal(err)
	}
	defer b.Close()
	ctx := context.Background()
	if _, err := b.NewConsumer(ctx, "orders", consumer.WithName("billing")); err != nil {
		log.Fatal(err)
	}
	_, err = b.NewConsumer(ctx, "refunds", consumer.WithName("billing"))
	var ce *consumer.ConfigError
	fmt.Println(errors.As(err, &ce), ce.Field)
	// Output: true InstanceID
}

// A consumer whose failing records go to retry topics, and whose
// partitions go on: one retry topic per delay, then the dead-letter topic.
// The handler keeps its own Retry for quick retries in process.
func ExampleBroker_NewRetryingConsumer() {
	b, err := kafka.New([]string{"127.0.0.1:9092"})
	if err != nil {
		log.Fatal(err)
	}
	defer b.Close()
	rc, err := b.NewRetryingConsumer(context.Background(), "payments", kafka.RetryTopics{
		Delays:          []time.Duration{30 * time.Second, 5 * time.Minute},
		DeadLetterTopic: "payments.dlq",
		GiveUpOrder:     true, // a record in a retry topic is overtaken by later ones
	}, consumer.WithName("ledger"))
	if err != nil {
		log.Fatal(err)
	}
	// Then: rc.Run(ctx, retry.Wrap(handler)), with retry a consumer.Retry.
	fmt.Println(rc.Topics(), len(rc.Loops()))
	for _, t := range append(rc.Topics(), "payments.dlq") {
		_ = b.DeleteTopic(context.Background(), t) // the example's own, made above
	}
	// Output: [payments.retry.1 payments.retry.2] 3
}
