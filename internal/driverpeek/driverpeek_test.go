package driverpeek_test

import (
	"context"
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
