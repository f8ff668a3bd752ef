package memory_test

import (
	"context"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/memory"
)

// patience bounds every wait in these tests; it is generous on purpose, for
// a slow machine. Nothing waits for it unless a test is failing.
const patience = 30 * time.Second

func newBroker(t testing.TB, opts ...memory.Option) *memory.Broker {
	t.Helper()
	b, err := memory.New(opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return b
}

func createQueue(t testing.TB, b *memory.Broker, name string, cfg memory.QueueConfig) {
	t.Helper()
	if err := b.CreateQueue(name, cfg); err != nil {
		t.Fatalf("CreateQueue(%q): %v", name, err)
	}
}

func newDriver(t testing.TB, b *memory.Broker, queue string) driver.Driver {
	t.Helper()
	d, err := b.Driver(t.Context(), queue, driver.Config{})
	if err != nil {
		t.Fatalf("Driver(%q): %v", queue, err)
	}
	t.Cleanup(func() { _ = d.Close() })
	return d
}

func publish(t testing.TB, b *memory.Broker, queue string, msgs ...consumer.Message) {
	t.Helper()
	if err := b.Publish(context.Background(), queue, msgs...); err != nil {
		t.Fatalf("Publish(%q): %v", queue, err)
	}
}

// fetch waits (up to patience) for up to max deliveries.
func fetch(t testing.TB, d driver.Driver, max int) []driver.Message {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	ms, err := d.Fetch(ctx, nil, max)
	if err != nil {
		t.Fatalf("Fetch: %v", err)
	}
	if len(ms) == 0 {
		t.Fatal("Fetch returned no message")
	}
	return ms
}

// fetchNothing asserts that nothing is delivered within wait. It can only
// fail when a message is visible, so a slow machine makes it pass, never fail.
func fetchNothing(t testing.TB, d driver.Driver, wait time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	ms, err := d.Fetch(ctx, nil, 10)
	if len(ms) > 0 {
		t.Fatalf("Fetch delivered %d message(s) (first %q, attempt %d), want none", len(ms), ms[0].ID, ms[0].Deliveries)
	}
	if err == nil {
		t.Fatal("Fetch returned no message and no error")
	}
}

func settle(t testing.TB, d driver.Driver, ss ...driver.Settlement) {
	t.Helper()
	if err := d.Settle(context.Background(), ss); err != nil {
		t.Fatalf("Settle: %v", err)
	}
}

func ack(m driver.Message) driver.Settlement {
	return driver.Settlement{Handle: m.Handle, Action: driver.Ack}
}

func ret(m driver.Message, delay time.Duration) driver.Settlement {
	return driver.Settlement{Handle: m.Handle, Action: driver.Return, Delay: delay}
}

func wantStats(t testing.TB, b *memory.Broker, queue string, want memory.QueueStats) {
	t.Helper()
	if got := b.Stats(queue); got != want {
		t.Fatalf("Stats(%q) = %+v, want %+v", queue, got, want)
	}
}

func msg(id, body string) consumer.Message {
	return consumer.Message{ID: id, Body: []byte(body)}
}

// waitUntilFetching waits until a fetch blocks on the queue.
func waitUntilFetching(t testing.TB, b *memory.Broker, queue string) {
	t.Helper()
	deadline := time.Now().Add(patience)
	for memory.Waiting(b, queue) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no fetch waits on %q", queue)
		}
		time.Sleep(time.Millisecond)
	}
}
