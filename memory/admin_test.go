package memory_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/memory"
)

// CreateSource makes a FIFO queue that dead-letters to a queue it makes too
// after MaxDeliveries receives; making it again is not an error, making it
// otherwise is; DeleteSource removes the queue and its messages, and
// deleting a queue that is gone is not an error.
func TestAdminCreatesAndDeletesQueues(t *testing.T) {
	b := newBroker(t, memory.WithAutoCreate(false))
	var adm consumer.Admin = b
	ctx := context.Background()
	cfg := consumer.SourceConfig{FIFO: true, DeadLetter: "orders-dlq", MaxDeliveries: 1}
	if err := adm.CreateSource(ctx, "orders", cfg); err != nil {
		t.Fatal(err)
	}
	if err := adm.CreateSource(ctx, "orders", cfg); err != nil {
		t.Fatalf("creating the queue again: %v", err)
	}
	if err := adm.CreateSource(ctx, "orders", consumer.SourceConfig{}); !errors.Is(err, memory.ErrQueueExists) {
		t.Fatalf("creating it as a standard queue = %v, want ErrQueueExists", err)
	}
	publish(t, b, "orders", consumer.Message{ID: "m-1", Key: "k", Body: []byte("one")})
	d := newDriver(t, b, "orders")
	m := fetch(t, d, 10)[0]
	if m.Lane != "k" {
		t.Fatalf("Lane = %q, want the key: a FIFO queue's lane is its group", m.Lane)
	}
	settle(t, d, ret(m, 0))
	// Past MaxDeliveries the next fetch moves the message to the
	// dead-letter queue instead of delivering it again.
	fetchNothing(t, d, 50*time.Millisecond)
	if got := b.Messages("orders-dlq"); len(got) != 1 || got[0].ID != "m-1" {
		t.Fatalf("the dead-letter queue holds %v, want m-1", got)
	}

	publish(t, b, "orders", consumer.Message{ID: "m-2", Key: "k", Body: []byte("two")})
	if err := adm.DeleteSource(ctx, "orders"); err != nil {
		t.Fatal(err)
	}
	if got := b.Messages("orders"); got != nil {
		t.Fatalf("the deleted queue still holds %v", got)
	}
	err := b.Publish(ctx, "orders", consumer.Message{Key: "k", Body: []byte("three")})
	if !errors.Is(err, memory.ErrQueueNotFound) {
		t.Fatalf("Publish to the deleted queue = %v, want ErrQueueNotFound", err)
	}
	if err := adm.DeleteSource(ctx, "orders"); err != nil {
		t.Fatalf("deleting a queue that is gone: %v", err)
	}
}

// A delivery limit with nowhere to dead-letter to, and a negative lease, are
// refused, naming the field.
func TestAdminRefusesDeliveryLimitWithoutDeadLetter(t *testing.T) {
	b := newBroker(t)
	for _, tc := range []struct {
		cfg   consumer.SourceConfig
		field string
	}{
		{consumer.SourceConfig{MaxDeliveries: 2}, "SourceConfig.MaxDeliveries"},
		{consumer.SourceConfig{Lease: -time.Second}, "SourceConfig.Lease"},
	} {
		err := b.CreateSource(context.Background(), "orders", tc.cfg)
		var ce *consumer.ConfigError
		if !errors.As(err, &ce) || ce.Field != tc.field {
			t.Fatalf("CreateSource(%+v) = %v, want a *consumer.ConfigError naming %s", tc.cfg, err, tc.field)
		}
	}
	if b.Messages("orders") != nil {
		t.Fatal("a refused CreateSource made the queue")
	}
}

// SourceConfig.Lease is the queue's visibility timeout: the driver holds a
// fetched message for that long.
func TestAdminLeaseIsTheVisibilityTimeout(t *testing.T) {
	b := newBroker(t, memory.WithAutoCreate(false))
	if err := b.CreateSource(context.Background(), "orders", consumer.SourceConfig{Lease: 42 * time.Second}); err != nil {
		t.Fatal(err)
	}
	d := newDriver(t, b, "orders")
	if got := d.(driver.Extender).Lease(); got != 42*time.Second {
		t.Fatalf("Lease() = %v, want 42s", got)
	}
}

var _ driver.Opener = (*memory.Broker)(nil)
