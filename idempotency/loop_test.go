package idempotency_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/memory"
)

// Through the real delivery loop and the memory broker: every event is
// published three times (three broker messages, one event id), and the
// handler's effect happens once per event.
func TestThroughDeliveryLoopEachEventOnce(t *testing.T) {
	b, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	ctx := context.Background()
	const events, copies = 300, 3
	var msgs []consumer.Message
	for c := range copies {
		for e := range events {
			msgs = append(msgs, consumer.Message{
				ID:      fmt.Sprintf("m-%d-%d", e, c),
				Headers: map[string]string{idempotency.EventIDHeader: fmt.Sprintf("ev-%d", e)},
			})
		}
	}
	if err := b.Publish(ctx, "orders", msgs...); err != nil {
		t.Fatal(err)
	}
	dedup, err := idempotency.New(idempotency.NewMemoryStore(), "orders-consumer")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	effects := map[string]int{}
	h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		effects[m.Header(idempotency.EventIDHeader)]++
		mu.Unlock()
		return nil
	}), dedup.Wrap)
	loop, err := b.NewConsumer(ctx, "orders", consumer.WithConcurrency(8), consumer.WithOrdering(consumer.Unordered),
		consumer.WithRedeliveryBackoff(time.Millisecond, 10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- loop.Run(rctx, h) }()
	deadline := time.Now().Add(30 * time.Second)
	for b.Stats("orders").Acked < events*copies {
		if time.Now().After(deadline) {
			cancel()
			<-done
			t.Fatalf("acked %d of %d after 30s: %+v", b.Stats("orders").Acked, events*copies, b.Stats("orders"))
		}
		time.Sleep(5 * time.Millisecond) // poll interval
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(effects) != events {
		t.Fatalf("%d events had an effect, want %d", len(effects), events)
	}
	for k, n := range effects {
		if n != 1 {
			t.Errorf("effect of %s happened %d times, want 1", k, n)
		}
	}
}
