package memory_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/memory"
)

// Peek returns the oldest max messages a queue holds and changes nothing:
// no receive is counted and a consumer still gets them all.
func TestPeekerLeavesTheQueueAsItWas(t *testing.T) {
	b := newBroker(t, memory.WithAutoCreate(false))
	var p consumer.Peeker = b
	ctx := context.Background()
	createQueue(t, b, "orders", memory.QueueConfig{})
	publish(t, b, "orders", msg("a", "1"), msg("b", "2"), msg("c", "3"))
	got, err := p.Peek(ctx, "orders", 2)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].ID != "a" || got[1].ID != "b" || got[0].Deliveries != 0 {
		t.Fatalf("Peek(2) = %+v, want a and b, never received", got)
	}
	wantStats(t, b, "orders", memory.QueueStats{Visible: 3})
	if ms := fetch(t, newDriver(t, b, "orders"), 10); len(ms) != 3 || ms[0].Deliveries != 1 {
		t.Fatalf("a fetch after Peek got %d messages (first delivered %d times), want 3 first delivered once", len(ms), ms[0].Deliveries)
	}

	if _, err := p.Peek(ctx, "missing", 1); !errors.Is(err, consumer.ErrSourceNotFound) || !errors.Is(err, memory.ErrQueueNotFound) {
		t.Fatalf("Peek of a missing queue = %v, want ErrSourceNotFound and ErrQueueNotFound", err)
	}
	var ce *consumer.ConfigError
	if _, err := p.Peek(ctx, "orders", 0); !errors.As(err, &ce) {
		t.Fatalf("Peek(0) = %v, want a *consumer.ConfigError", err)
	}
}
