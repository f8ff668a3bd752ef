package sqs_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
)

// TestGracefulShutdownLeavesNothingInvisible: a consumer stopped while it
// holds many fetched messages runs them within its grace and acks them;
// when Run returns nothing of the queue is left invisible (the visibility
// timeout is a minute, so a message left behind would show), and a second
// consumer handles the rest, each message once, on its first delivery.
func TestGracefulShutdownLeavesNothingInvisible(t *testing.T) {
	c := newClient(t, nil)
	b := newBroker(t, c)
	name, url := createQueue(t, c, "drain", queueConfig{visibility: time.Minute})
	const n = 120
	msgs := make([]consumer.Message, n)
	for i := range msgs {
		msgs[i].Body = []byte(fmt.Sprint("m-", i))
	}
	if err := b.Publish(context.Background(), name, msgs...); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	handled := map[string][]int{}
	h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		time.Sleep(20 * time.Millisecond)
		mu.Lock()
		handled[string(m.Body)] = append(handled[string(m.Body)], m.Deliveries)
		mu.Unlock()
		return nil
	})
	count := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(handled)
	}
	l, err := b.NewConsumer(context.Background(), name, consumer.WithConcurrency(4), consumer.WithMaxInFlight(40), consumer.WithShutdownGrace(30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	r := start(t, l, h)
	testenv.WaitFor(t, 30*time.Second, "10 messages handled", func() bool { return count() >= 10 })
	r.stop(t)
	first := count()
	if _, inflight, _ := depth(t, c, url); inflight != 0 {
		t.Fatalf("%d messages left invisible after a graceful stop (the first consumer handled %d)", inflight, first)
	}
	l2, err := b.NewConsumer(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	start(t, l2, h)
	testenv.WaitFor(t, 30*time.Second, "every message handled", func() bool { return count() == n })
	mu.Lock()
	defer mu.Unlock()
	for id, ds := range handled {
		if len(ds) != 1 || ds[0] != 1 {
			t.Errorf("%s handled at deliveries %v, want once, on the first", id, ds)
		}
	}
	t.Logf("the first consumer handled %d before and during its stop", first)
}

// TestShutdownPastTheGraceGivesMessagesBackAtOnce: messages fetched and
// not started when the grace ends are made visible again at once, and
// those whose handlers were cancelled after their redelivery backoff, not
// after the minute of visibility; a second consumer gets them all.
func TestShutdownPastTheGraceGivesMessagesBackAtOnce(t *testing.T) {
	c := newClient(t, nil)
	b := newBroker(t, c)
	name, url := createQueue(t, c, "cut", queueConfig{visibility: time.Minute})
	const n = 12
	msgs := make([]consumer.Message, n)
	for i := range msgs {
		msgs[i].Body = []byte(fmt.Sprint("m-", i))
	}
	if err := b.Publish(context.Background(), name, msgs...); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	started := 0
	l, err := b.NewConsumer(context.Background(), name, consumer.WithConcurrency(2), consumer.WithMaxInFlight(n), consumer.WithShutdownGrace(200*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	r := start(t, l, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		started++
		mu.Unlock()
		<-ctx.Done()
		return ctx.Err()
	}))
	testenv.WaitFor(t, 30*time.Second, "two handlers to start", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return started >= 2
	})
	r.stop(t)
	// The unstarted ones at once; the cancelled runs after their redelivery
	// backoff (at least a second on SQS, which counts in whole seconds).
	stopped := time.Now()
	if visible, _, _ := depth(t, c, url); visible != n-2 {
		t.Errorf("right after the stop %d messages are visible, want the %d not started", visible, n-2)
	}
	testenv.WaitFor(t, 5*time.Second, "every message to be visible again", func() bool {
		visible, inflight, _ := depth(t, c, url)
		return visible == n && inflight == 0
	})
	t.Logf("all visible %s after the stop", time.Since(stopped).Round(time.Millisecond))
	got := consumeN(t, b, name, n)
	if len(got) != n {
		t.Errorf("second consumer got %d", len(got))
	}
}
