package driverpeek_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/driverpeek"
	"github.com/ferrymq/ferry/memory"
)

// Peek reads what there is when it is less than it wants (it stops once
// nothing new comes within idle), in order, and hands every message back:
// the queue holds them visible, none in flight.
func TestPeekStopsWhenNothingNewComesAndHandsBack(t *testing.T) {
	b, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, id := range []string{"a", "b", "c"} {
		if err := b.Publish(ctx, "q", consumer.Message{ID: id, Body: []byte(id)}); err != nil {
			t.Fatal(err)
		}
	}
	d, err := b.Driver(ctx, "q", driver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	got, err := driverpeek.Peek(ctx, d, 10, 50*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 || got[0].ID != "a" || got[1].ID != "b" || got[2].ID != "c" || got[0].Source != "q" {
		t.Fatalf("Peek = %+v, want a, b, c of q", got)
	}
	if st := b.Stats("q"); st.Visible != 3 || st.InFlight != 0 {
		t.Fatalf("after Peek the queue has %+v, want the 3 visible and none in flight", st)
	}
}

// A message whose lease runs out during the read is delivered again; Peek
// shows it once and hands back only its latest delivery (the first one's
// handle is stale: settling it fails), so the read succeeds and the queue
// holds every message visible again. The read ends (idle after the first
// delivery) halfway through the second delivery's lease: ending as a lease
// ran out, as an idle wait of a whole number of leases did, raced the
// hand-back of the latest delivery with its own lease.
func TestPeekHandsBackOnlyTheLatestDeliveryOfAMessage(t *testing.T) {
	b, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	const lease = 200 * time.Millisecond
	if err := b.CreateQueue("q", memory.QueueConfig{VisibilityTimeout: lease}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := b.Publish(ctx, "q", consumer.Message{ID: "a", Body: []byte("a")}); err != nil {
		t.Fatal(err)
	}
	d, err := b.Driver(ctx, "q", driver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	// An idle wait of a lease and a half: "a" comes again within it, and
	// its second lease has half to run when the read ends.
	got, err := driverpeek.Peek(ctx, d, 10, lease*3/2)
	if err != nil {
		t.Fatalf("Peek = %v, want the read to succeed", err)
	}
	if len(got) != 1 || got[0].ID != "a" {
		t.Fatalf("Peek = %+v, want a once", got)
	}
	if st := b.Stats("q"); st.Visible != 1 || st.InFlight != 0 {
		t.Fatalf("after Peek the queue has %+v, want a visible and none in flight", st)
	}
}

// refusingSettle is a driver whose hand-back fails.
type refusingSettle struct{ driver.Driver }

func (refusingSettle) Settle(context.Context, []driver.Settlement) error {
	return errors.New("settle refused")
}

// A read whose hand-back fails still stands: Peek returns the messages,
// with an error wrapping ErrNotHandedBack (they come back after their
// lease), for the caller to say so rather than fail the read.
func TestPeekReturnsWhatItReadWhenTheHandBackFails(t *testing.T) {
	b, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := b.Publish(ctx, "q", consumer.Message{ID: "a", Body: []byte("a")}); err != nil {
		t.Fatal(err)
	}
	d, err := b.Driver(ctx, "q", driver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	got, err := driverpeek.Peek(ctx, refusingSettle{d}, 10, 50*time.Millisecond)
	if !errors.Is(err, driverpeek.ErrNotHandedBack) || !strings.Contains(err.Error(), "settle refused") {
		t.Fatalf("Peek error = %v, want one wrapping ErrNotHandedBack and the cause", err)
	}
	if len(got) != 1 || got[0].ID != "a" {
		t.Fatalf("Peek = %+v, want a with the error", got)
	}
}
