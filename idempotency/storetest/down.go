package storetest

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/memory"
)

// StoreDown runs the idempotency middleware over s, a store whose backend
// cannot be reached, in a real delivery loop on the memory broker, and
// checks that the message is delivered again and again but never acked, and
// that the handler is never called.
func StoreDown(t *testing.T, s idempotency.Store) {
	t.Helper()
	b, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	ctx := ctxFor(t)
	if err := b.Publish(ctx, "orders", *Message("ev", 1)); err != nil {
		t.Fatal(err)
	}
	dedup, err := idempotency.New(s, "orders-consumer")
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int32
	h := dedup.Wrap(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		calls.Add(1)
		return nil
	}))
	loop, err := b.NewConsumer(ctx, "orders", consumer.WithRedeliveryBackoff(time.Millisecond, 10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- loop.Run(rctx, h) }()
	deadline := time.Now().Add(Timeout)
	for {
		ms := b.Messages("orders")
		if len(ms) == 1 && ms[0].Deliveries >= 3 {
			break
		}
		if time.Now().After(deadline) {
			cancel()
			<-done
			t.Fatalf("the message was not redelivered 3 times within %s: %+v", Timeout, b.Stats("orders"))
		}
		time.Sleep(5 * time.Millisecond) // poll interval
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if st := b.Stats("orders"); st.Acked != 0 || st.DeadLettered != 0 {
		t.Fatalf("stats = %+v; the message must stay on the broker", st)
	}
	if len(b.Messages("orders")) != 1 {
		t.Fatal("the message left the queue")
	}
	if n := calls.Load(); n != 0 {
		t.Fatalf("handler ran %d times without a claim", n)
	}
}
