package redisstore_test

import (
	"log"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/idempotency/redisstore"
)

// The idempotency middleware over Redis. Redis expires the keys by itself,
// so there is no cleaner to run.
func ExampleNewStore() {
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	defer client.Close()
	store, err := redisstore.NewStore(client, redisstore.WithPrefix("billing:idem:"))
	if err != nil {
		log.Fatal(err)
	}
	dedup, err := idempotency.New(store, "billing", idempotency.WithLease(2*time.Minute))
	if err != nil {
		log.Fatal(err)
	}
	_ = dedup // consumer.Chain(handler, stack.Wrap, dedup.Wrap)
}
