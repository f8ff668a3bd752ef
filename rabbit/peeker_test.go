package rabbit_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
)

// Peek returns the ready messages of a queue oldest first and hands them
// back: a second Peek reads them again, and the queue counts them ready.
func TestPeekerGivesTheMessagesBack(t *testing.T) {
	b := dial(t)
	var p consumer.Peeker = b
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	name := testenv.UniqueName(t, "peeker")
	deleteLater(t, []string{name}, nil)
	if err := b.CreateSource(ctx, name, consumer.SourceConfig{}); err != nil {
		t.Fatal(err)
	}
	var msgs []consumer.Message
	for _, id := range []string{"a", "b", "c"} {
		msgs = append(msgs, consumer.Message{ID: id, Key: id, Body: []byte(id)})
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
	q, err := rawChannel(t).QueueDeclarePassive(name, true, false, false, false, nil)
	if err != nil || q.Messages != 3 {
		t.Fatalf("after Peek the queue counts %d ready messages (%v), want 3", q.Messages, err)
	}

	if _, err := p.Peek(ctx, name+"-missing", 1); !errors.Is(err, consumer.ErrSourceNotFound) {
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
