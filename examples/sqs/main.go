// Command sqs is an order service and a billing consumer on Amazon SQS, or
// on an SQS-compatible server such as ElasticMQ.
//
// The order service commits each order and its OrderPlaced event in one
// SQLite transaction (the transactional outbox); a relay publishes the
// events to a queue. The billing consumer pays each order through
// consumer.Standard (retry, circuit breaker, dead letter, timeout, recover)
// and idempotency, so an event delivered twice is paid once. It prints each
// payment and ends once every order is paid.
//
// Start the brokers (docker compose up --wait, or make brokers), then, in
// the examples folder (a Go module of its own):
//
//	go run ./sqs
//	go run ./sqs -endpoint http://127.0.0.1:9324 -orders 20
//
// With -endpoint "" it talks to AWS, with the default credential chain and
// the region of -region. A real service keeps its queues; this example
// makes its own, under a fresh name, and deletes them at the end, so that
// runs never see each other's messages.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/credentials"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/idempotency/sqlitestore"
	"github.com/ferrymq/ferry/outbox"
	"github.com/ferrymq/ferry/outbox/sqliteoutbox"
	"github.com/ferrymq/ferry/sqs"
)

// OrderPlaced is the event the order service publishes for each order.
type OrderPlaced struct {
	OrderID     string `json:"order_id"`
	AmountCents int64  `json:"amount_cents"`
}

func main() {
	endpoint := flag.String("endpoint", "http://127.0.0.1:9324", `the SQS-compatible server ("" for AWS)`)
	region := flag.String("region", "us-east-1", "the AWS region")
	orders := flag.Int("orders", 10, "how many orders to place")
	timeout := flag.Duration("timeout", time.Minute, "give up when the orders are not all paid by then")
	payTime := flag.Duration("pay-time", 0, "how long each payment takes (the payments API)")
	flag.Parse()

	// SIGTERM is how a container is stopped, SIGINT is Ctrl-C: either
	// stops the consumer, which drains (what it fetched runs and is acked)
	// before the program exits.
	signalled, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(signalled, *timeout)
	defer cancel()
	err := run(ctx, *endpoint, *region, *orders, *payTime)
	if err != nil && errors.Is(err, context.Canceled) && signalled.Err() != nil {
		fmt.Printf("stopped (%v): %v\n", context.Cause(signalled), err)
		return
	}
	if err != nil {
		slog.Error("example failed", "err", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, endpoint, region string, n int, payTime time.Duration) error {
	// The SQS client, the broker over it, and the queues of this run.
	client, err := newClient(ctx, endpoint, region)
	if err != nil {
		return err
	}
	b, err := sqs.New(client)
	if err != nil {
		return err
	}
	defer b.Close()
	id := randomID()
	queue, dlq := "orders-"+id, "orders-"+id+"-dlq"
	for _, q := range []string{queue, dlq} {
		if err := b.CreateSource(ctx, q, consumer.SourceConfig{}); err != nil {
			return err
		}
		defer b.DeleteSource(context.WithoutCancel(ctx), q)
	}

	dir, err := os.MkdirTemp("", "ferry-example-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)

	// The order service: each order and its event in one transaction.
	db, err := sqliteoutbox.Open(filepath.Join(dir, "orders.db"))
	if err != nil {
		return err
	}
	defer db.Close()
	if err := sqliteoutbox.Migrate(ctx, db); err != nil {
		return err
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE orders (id TEXT PRIMARY KEY, amount_cents INTEGER NOT NULL)`); err != nil {
		return err
	}
	w, err := sqliteoutbox.NewWriter()
	if err != nil {
		return err
	}
	for i := 1; i <= n; i++ {
		o := OrderPlaced{OrderID: fmt.Sprintf("o-%04d", i), AmountCents: int64(1000 + 250*i)}
		body, _ := json.Marshal(o)
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO orders (id, amount_cents) VALUES (?, ?)`, o.OrderID, o.AmountCents); err != nil {
			tx.Rollback()
			return err
		}
		if err := w.Add(ctx, tx, outbox.Event{Destination: queue, Key: o.OrderID, Body: body}); err != nil {
			tx.Rollback()
			return err
		}
		if err := tx.Commit(); err != nil {
			return err
		}
		fmt.Printf("order service: placed %s (%d cents)\n", o.OrderID, o.AmountCents)
	}

	// The relay publishes what the transactions committed.
	store, err := sqliteoutbox.NewStore(db)
	if err != nil {
		return err
	}
	relay, err := outbox.NewRelay(store, b)
	if err != nil {
		return err
	}
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(ctx) }()
	defer func() { stop(); <-relayDone }()

	// Billing: the standard middleware, then idempotency on the event id the
	// outbox sets, with its keys in billing's own database.
	bdb, err := sqlitestore.Open(filepath.Join(dir, "billing.db"))
	if err != nil {
		return err
	}
	defer bdb.Close()
	if err := sqlitestore.Migrate(ctx, bdb); err != nil {
		return err
	}
	keys, err := sqlitestore.NewStore(bdb)
	if err != nil {
		return err
	}
	defer keys.Close()
	dedup, err := idempotency.New(keys, "billing")
	if err != nil {
		return err
	}
	stack, err := consumer.Standard(b, dlq)
	if err != nil {
		return err
	}

	var paid atomic.Int64
	allPaid := make(chan struct{})
	pay := consumer.JSON(func(ctx context.Context, o OrderPlaced, m *consumer.Message) error {
		// Charge the customer here; an error comes back later, a
		// consumer.Permanent error goes to the dead-letter queue.
		fmt.Printf("billing: paying %s\n", o.OrderID)
		select {
		case <-time.After(payTime):
		case <-ctx.Done():
			return ctx.Err()
		}
		fmt.Printf("billing: paid %s (%d cents, attempt %d)\n", o.OrderID, o.AmountCents, m.Attempt)
		if paid.Add(1) == int64(n) {
			close(allPaid)
		}
		return nil
	})
	// While a handler runs, the consumer extends the message's visibility.
	c, err := b.NewConsumer(ctx, queue, consumer.WithName("billing"))
	if err != nil {
		return err
	}
	runDone := make(chan error, 1)
	go func() { runDone <- c.Run(ctx, consumer.Chain(pay, stack.Wrap, dedup.Wrap)) }()

	select {
	case <-allPaid:
	case <-ctx.Done(): // a signal or the timeout
	}
	// Stopping the consumer drains it: what it fetched runs, within its
	// shutdown grace, and is acked; Run returns once that is done.
	stop()
	if err := <-runDone; err != nil {
		return err
	}
	if paid.Load() < int64(n) {
		return fmt.Errorf("%d of %d orders paid: %w", paid.Load(), n, ctx.Err())
	}
	fmt.Printf("billing: paid %d of %d orders\n", paid.Load(), n)
	return nil
}

// newClient returns the SQS client of the region, at endpoint unless it is
// "" (AWS).
func newClient(ctx context.Context, endpoint, region string) (*awssqs.Client, error) {
	var opts []func(*config.LoadOptions) error
	if endpoint != "" {
		// A local server takes any credentials.
		opts = append(opts, config.WithCredentialsProvider(credentials.NewStaticCredentialsProvider("x", "x", "")))
	}
	cfg, err := config.LoadDefaultConfig(ctx, append(opts, config.WithRegion(region))...)
	if err != nil {
		return nil, err
	}
	return awssqs.NewFromConfig(cfg, func(o *awssqs.Options) {
		if endpoint != "" {
			o.BaseEndpoint = aws.String(endpoint)
		}
		// A consumer keeps several receives and batch calls open at once:
		// with the SDK's 10 idle connections per host, connections are
		// closed and opened all the time, and a receive cut on a closing
		// one leaves its messages invisible until their visibility timeout
		// (see package sqs).
		o.HTTPClient = awshttp.NewBuildableClient().WithTransportOptions(func(tr *http.Transport) {
			tr.MaxIdleConnsPerHost = idleConnsPerHost
		})
	}), nil
}

// idleConnsPerHost is how many idle connections the SQS client keeps.
const idleConnsPerHost = 100

// randomID names this run's queues.
func randomID() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
