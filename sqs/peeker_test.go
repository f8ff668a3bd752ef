package sqs_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
)

// Peek returns the messages of a queue oldest first and makes them visible
// again at once: a second Peek, and then a consumer, get them all.
func TestPeekerGivesTheMessagesBack(t *testing.T) {
	c := newClient(t, nil)
	b := newBroker(t, c)
	var p consumer.Peeker = b
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// FIFO: the order SQS hands them out in is the publish order.
	name := testenv.UniqueName(t, "peeker") + ".fifo"
	if err := b.CreateSource(ctx, name, consumer.SourceConfig{FIFO: true}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.DeleteSource(context.Background(), name) })
	var msgs []consumer.Message
	for _, id := range []string{"a", "b", "c"} {
		msgs = append(msgs, consumer.Message{ID: id, Key: "k", Body: []byte(id)})
	}
	if err := b.Publish(ctx, name, msgs...); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		got, err := p.Peek(ctx, name, 10)
		if err != nil {
			t.Fatal(err)
		}
		if peekedBodies(got) != "abc" {
			t.Fatalf("Peek = %q, want abc", peekedBodies(got))
		}
	}
	if got, err := p.Peek(ctx, name, 2); err != nil || peekedBodies(got) != "ab" {
		t.Fatalf("Peek(2) = %q, %v; want ab", peekedBodies(got), err)
	}
	d, err := b.Driver(ctx, name, driver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	var got []driver.Message
	for len(got) < 3 {
		if got, err = d.Fetch(ctx, got, 10); err != nil {
			t.Fatalf("a consumer after Peek got %d messages: %v", len(got), err)
		}
	}

	if _, err := p.Peek(ctx, testenv.UniqueName(t, "missing"), 1); !errors.Is(err, consumer.ErrSourceNotFound) {
		t.Fatalf("Peek of a missing queue = %v, want ErrSourceNotFound", err)
	}
	var ce *consumer.ConfigError
	if _, err := p.Peek(ctx, name, 0); !errors.As(err, &ce) {
		t.Fatalf("Peek(0) = %v, want a *consumer.ConfigError", err)
	}
}

// peekedBodies is the messages' bodies, one after the other.
func peekedBodies(ms []consumer.Message) string {
	var s string
	for _, m := range ms {
		s += string(m.Body)
	}
	return s
}
