package sqs_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
)

// TestBreakerOpenStopsReceivingAndKeepsHeldMessages: while a circuit
// breaker in the chain is open (30 s), the consumer makes no ReceiveMessage
// call, and the messages it holds keep their visibility (2 s, extended
// fifteen times over): none is delivered again, and once the breaker
// closes each is handled on the delivery it was held on.
func TestBreakerOpenStopsReceivingAndKeepsHeldMessages(t *testing.T) {
	const openFor = 30 * time.Second
	var cs calls
	c := newClient(t, &cs)
	b := newBroker(t, c)
	name, url := createQueue(t, c, "breaker", queueConfig{visibility: 2 * time.Second})

	var mu sync.Mutex
	var opened, halfOpen time.Time
	br, err := consumer.NewBreaker(consumer.BreakerFailures(3), consumer.BreakerOpenFor(openFor),
		consumer.BreakerOnStateChange(func(from, to consumer.BreakerState) {
			mu.Lock()
			defer mu.Unlock()
			switch {
			case to == consumer.BreakerOpen && opened.IsZero():
				opened = time.Now()
			case to == consumer.BreakerHalfOpen && halfOpen.IsZero():
				halfOpen = time.Now()
			}
		}))
	if err != nil {
		t.Fatal(err)
	}
	var receives []time.Time
	cs.setHook(func(op string, in any) {
		if op == "ReceiveMessage" {
			mu.Lock()
			receives = append(receives, time.Now())
			mu.Unlock()
		}
	})

	var down atomic.Bool
	down.Store(true)
	heldAt := map[string]int{} // message id -> delivery it was held on
	var firstHold time.Time
	var redelivered []string
	succeeded := map[string]int{}
	inner := br.Wrap(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if down.Load() {
			return errDown
		}
		return nil
	}))
	h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		err := inner.Handle(ctx, m)
		mu.Lock()
		defer mu.Unlock()
		if d, ok := heldAt[m.ID]; ok && d != m.Deliveries {
			redelivered = append(redelivered, m.ID)
		}
		switch {
		case consumer.IsHeld(err):
			if firstHold.IsZero() {
				firstHold = time.Now()
				down.Store(false) // the dependency is back; the breaker stays open its 30 s
			}
			heldAt[m.ID] = m.Deliveries
		case err == nil:
			succeeded[m.ID]++
		}
		return err
	})
	l, err := b.NewConsumer(context.Background(), name, consumer.WithConcurrency(4), consumer.WithMaxInFlight(16),
		consumer.WithRedeliveryBackoff(time.Second, time.Second))
	if err != nil {
		t.Fatal(err)
	}
	const n = 30
	msgs := make([]consumer.Message, n)
	for i := range msgs {
		msgs[i].Body = []byte("m")
	}
	if err := b.Publish(context.Background(), name, msgs...); err != nil {
		t.Fatal(err)
	}
	start(t, l, h)
	testenv.WaitFor(t, 90*time.Second, "every message to succeed after the breaker closed", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(succeeded) == n
	})
	mu.Lock()
	defer mu.Unlock()
	if firstHold.IsZero() || halfOpen.IsZero() {
		t.Fatalf("the breaker was never held (first hold %v) or never half-open (%v)", firstHold, halfOpen)
	}
	// From shortly after the first hold (a receive may already be on its
	// way) until the open period ends (the breaker turns half-open lazily,
	// on the first call after it): no receive.
	var during []time.Duration
	for _, r := range receives {
		if r.After(firstHold.Add(200*time.Millisecond)) && r.Before(opened.Add(openFor)) {
			during = append(during, r.Sub(opened))
		}
	}
	if len(during) > 0 {
		t.Errorf("%d ReceiveMessage call(s) while the breaker was open (at %v after it opened)", len(during), during)
	}
	if len(heldAt) == 0 {
		t.Error("no message was held")
	}
	if len(redelivered) > 0 {
		t.Errorf("%d held message(s) were delivered again: %v", len(redelivered), redelivered)
	}
	for id, k := range succeeded {
		if k != 1 {
			t.Errorf("message %s succeeded %d times", id, k)
		}
	}
	mu.Unlock()
	testenv.WaitFor(t, 10*time.Second, "the queue to be empty", func() bool {
		v, f, _ := depth(t, c, url)
		return v+f == 0
	})
	mu.Lock()
	t.Logf("held %d messages; open %s; %d receives in all", len(heldAt), halfOpen.Sub(opened).Round(time.Millisecond), len(receives))
}
