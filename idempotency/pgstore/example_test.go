package pgstore_test

import (
	"context"
	"log"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/idempotency/pgstore"
)

// The transactional inbox: the order row and the message's key commit
// together, so a redelivery never inserts the order twice.
func ExampleNewInbox() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://ferry:ferry@127.0.0.1:5432/ferry")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := pgstore.Migrate(ctx, pool); err != nil {
		log.Fatal(err)
	}
	h, err := pgstore.NewInbox(pool, "orders", func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		_, err := tx.Exec(ctx, "INSERT INTO orders (body) VALUES ($1)", m.Body)
		return err
	})
	if err != nil {
		log.Fatal(err)
	}
	_ = h // run it with a consumer: c.Run(ctx, h)
}

// The store behind the idempotency middleware, for handlers whose effects
// are not writes to this database; with a cleaner that runs hourly.
func ExampleNewStore() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel() // stops the cleaner
	pool, err := pgxpool.New(ctx, "postgres://ferry:ferry@127.0.0.1:5432/ferry")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := pgstore.Migrate(ctx, pool); err != nil {
		log.Fatal(err)
	}
	store, err := pgstore.NewStore(pool)
	if err != nil {
		log.Fatal(err)
	}
	go func() { _ = idempotency.CleanEvery(ctx, store, time.Hour, nil) }()
	dedup, err := idempotency.New(store, "shipping", idempotency.WithLease(2*time.Minute))
	if err != nil {
		log.Fatal(err)
	}
	_ = dedup // consumer.Chain(handler, stack.Wrap, dedup.Wrap)
}
