package ferrytest_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/ferrytest"
)

// A billing consumer's integration test, on the broker FERRY_TEST_BROKER
// names (the in-process one when unset): throwaway queues, fixtures, the
// handler run through the Standard middleware until both good orders are
// paid and the bad one is dead-lettered, and the dead letter's story.
//
// With the brokers running (docker compose up --wait, or make brokers), the
// same Example runs on each of them:
//
//	FERRY_TEST_BROKER=kafka go test -run '^Example$' ./ferrytest
//
// (and sqs, rabbitmq). In a test, ferrytest.Open(t, kind) does what
// Connect and Close do here, and skips the test when the broker is not
// running.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	kind, err := ferrytest.KindFromEnv()
	if err != nil {
		panic(err)
	}
	b, err := ferrytest.Connect(ctx, kind)
	if err != nil {
		panic(err)
	}
	defer b.Close() // removes the queues

	orders, err := b.NewQueue(ctx, "orders")
	if err != nil {
		panic(err)
	}
	dlq, err := b.NewQueue(ctx, "orders-dlq")
	if err != nil {
		panic(err)
	}
	err = orders.Publish(ctx,
		consumer.Message{Key: "o-1", Body: []byte("120")},
		consumer.Message{Key: "o-2", Body: []byte("-5")},
		consumer.Message{Key: "o-3", Body: []byte("80")},
	)
	if err != nil {
		panic(err)
	}

	// The service's handler, through its middleware.
	var mu sync.Mutex
	var paid []string
	billing := consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
		amount, err := strconv.Atoi(string(m.Body))
		if err != nil || amount <= 0 {
			return consumer.Permanent(errors.New("amount must be positive"))
		}
		mu.Lock()
		defer mu.Unlock()
		paid = append(paid, m.Key)
		return nil
	})
	stack, err := consumer.Standard(b, dlq.Name)
	if err != nil {
		panic(err)
	}

	err = orders.RunUntil(ctx, stack.Wrap(billing), func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(paid) == 2 && stack.DeadLetter.Count() == 1
	})
	if err != nil {
		panic(err)
	}
	slices.Sort(paid)
	fmt.Println("paid:", paid)

	dead, err := dlq.DeadLetters(ctx)
	if err != nil {
		panic(err)
	}
	for _, d := range dead {
		fmt.Printf("dead letter %s from the orders queue: %t\n", d.Key, d.Source == orders.Name)
		fmt.Printf("reason %s after %d attempt(s): %s\n", d.Reason, d.Attempts, d.Error)
	}
	// Output:
	// paid: [o-1 o-3]
	// dead letter o-2 from the orders queue: true
	// reason permanent after 1 attempt(s): permanent: amount must be positive
}

// ParseDeadLetter reads the story a DeadLetter middleware wrote into a
// message's headers, for messages read from a dead-letter queue by other
// means.
func ExampleParseDeadLetter() {
	m := consumer.Message{Key: "o-2", Body: []byte("-5"), Headers: map[string]string{
		consumer.HeaderDLQSource:   "orders",
		consumer.HeaderDLQReason:   consumer.DLQReasonMaxAttempts,
		consumer.HeaderDLQAttempts: "10",
		consumer.HeaderDLQError:    "payments: 503 Service Unavailable",
	}}
	d, err := ferrytest.ParseDeadLetter(m)
	if err != nil {
		panic(err)
	}
	fmt.Printf("%s from %s after %d attempts: %s\n", d.Reason, d.Source, d.Attempts, d.Error)
	// Output: max-attempts from orders after 10 attempts: payments: 503 Service Unavailable
}
