package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/outbox"
)

// recorder is a Publisher that keeps every message it is given, with its
// destination, and takes them all.
type recorder struct {
	mu   sync.Mutex
	sent []sent
}

type sent struct {
	dest string
	msg  consumer.Message
}

func (r *recorder) Publish(_ context.Context, dest string, msgs ...consumer.Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, m := range msgs {
		m.Headers = maps.Clone(m.Headers)
		m.Body = append([]byte(nil), m.Body...)
		r.sent = append(r.sent, sent{dest, m})
	}
	return nil
}

func (r *recorder) all() []sent {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]sent(nil), r.sent...)
}

// awkward are events whose ids, destinations, keys, header names and values
// hold NUL, invalid UTF-8 (\xff, \xfe) and header names that differ only in
// invalid bytes: Kafka keys and header values are bytes, and so is an id
// taken from one.
func awkward() []outbox.Event {
	return []outbox.Event{
		{
			ID:          "id-\x00\xff\xfe",
			Destination: "dest-\x00\xff",
			Key:         "key-\x00\xff\xfe",
			Body:        []byte("body-\x00\xff\xfe"),
			Headers: map[string]string{
				"h\xff":    "v\xff\xfe",
				"h\xfe":    "v\x00",
				"nul\x00h": "\x00",
				"plain":    "text",
				"empty":    "",
				"\x00":     "\xff\xff",
			},
		},
		{ID: "\xff", Destination: "dest-\x00\xff", Key: "\x00", Headers: map[string]string{"\xff\xfe": "\xfe\xff"}},
		{ID: "plain", Destination: "\xfe", Key: "key-\x00\xff\xfe"},
		{ID: "\x00\x00", Destination: queue},
	}
}

// Events round-trip byte for byte, from Add through the relay to the
// Publisher: nothing is replaced with U+FFFD, no header names collapse into
// one, and NUL is a byte like any other.
func TestEventsRoundTripByteForByte(t *testing.T) {
	forEachBackend(t, func(t *testing.T, b *backend) {
		ctx := testenv.Context(t, 30*time.Second)
		want := awkward()
		if err := b.add(ctx, want...); err != nil {
			t.Fatalf("Add: %v", err)
		}
		pub := &recorder{}
		st := b.store(t, "")
		runRelay(t, st, pub, fast()...)
		drain(t, st)
		got := pub.all()
		if len(got) != len(want) {
			t.Fatalf("%d messages published, want %d", len(got), len(want))
		}
		for i, e := range want {
			s := got[i]
			h := maps.Clone(e.Headers)
			if h == nil {
				h = map[string]string{}
			}
			h[outbox.EventIDHeader] = e.ID
			if s.dest != e.Destination || s.msg.ID != e.ID || s.msg.Key != e.Key ||
				string(s.msg.Body) != string(e.Body) || !maps.Equal(s.msg.Headers, h) {
				t.Errorf("event %d:\n got dest %q id %q key %q body %q headers %q\nwant dest %q id %q key %q body %q headers %q",
					i, s.dest, s.msg.ID, s.msg.Key, s.msg.Body, s.msg.Headers,
					e.Destination, e.ID, e.Key, e.Body, h)
			}
		}
	})
}

// Whatever Add makes of an event, accepted or refused with an *EventError,
// the caller's transaction stays usable: its other writes, before and after,
// commit.
func TestAddLeavesTheCallersTransactionUsable(t *testing.T) {
	forEachBackend(t, func(t *testing.T, b *backend) {
		ctx := testenv.Context(t, 30*time.Second)
		refused := []outbox.Event{
			{ID: "no-dest", Key: "k"},
			{ID: "too-big", Destination: queue, Body: make([]byte, 256<<10+1)},
			{ID: "own-id-header", Destination: queue, Headers: map[string]string{outbox.EventIDHeader: "another"}},
		}
		var accepted int
		err := b.tx(ctx, func(add addFunc, exec execFunc) error {
			if _, err := exec(ctx, b.counter, "before"); err != nil {
				return err
			}
			for _, e := range awkward() {
				err := add(ctx, e)
				var ee *outbox.EventError
				switch {
				case err == nil:
					accepted++
				case !errors.As(err, &ee):
					t.Errorf("Add(%q) = %v: neither accepted nor an *outbox.EventError", e.ID, err)
				}
			}
			for _, e := range refused {
				if err := add(ctx, e); !errors.Is(err, outbox.ErrInvalidEvent) {
					t.Errorf("Add(%q) = %v, want an *outbox.EventError", e.ID, err)
				}
			}
			if _, err := exec(ctx, b.counter, "after"); err != nil {
				return err
			}
			if err := add(ctx, outbox.Event{ID: "after", Destination: queue, Key: "k"}); err != nil {
				return err
			}
			accepted++
			return nil
		})
		if err != nil {
			t.Fatalf("the transaction failed after Add: %v", err)
		}
		for _, key := range []string{"before", "after"} {
			err := b.tx(ctx, func(_ addFunc, exec execFunc) error {
				n, err := exec(ctx, b.counter, key)
				if err == nil && n != 2 {
					t.Errorf("counter %s is %d after a second bump: the first write did not commit", key, n)
				}
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
		}
		bl, err := b.store(t, "").Backlog(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if bl.Events != int64(accepted) {
			t.Fatalf("backlog %d, want the %d accepted events", bl.Events, accepted)
		}
	})
}

// A publisher's reason for refusing an event may quote the event's bytes;
// the event still moves to the failed-events table (its reason column is
// text, so the reason is made text first).
func TestRefusalReasonWithAwkwardBytesIsRecorded(t *testing.T) {
	forEachBackend(t, func(t *testing.T, b *backend) {
		ctx := testenv.Context(t, 30*time.Second)
		if err := b.add(ctx, outbox.Event{ID: "bad", Destination: queue, Key: "k\x00\xff"}); err != nil {
			t.Fatal(err)
		}
		pub := &refuser{}
		st := b.store(t, "")
		r, _ := runRelay(t, st, pub, fast()...)
		testenv.WaitFor(t, 20*time.Second, "the refused event did not reach the failed events", func() bool {
			bl, err := st.Backlog(ctx)
			return err == nil && bl.Events == 0 && bl.Failed == 1 && r.Stats().Failed == 1
		})
	})
}

// refuser refuses every message for good, quoting its key.
type refuser struct{}

func (refuser) Publish(_ context.Context, _ string, msgs ...consumer.Message) error {
	return consumer.Permanent(fmt.Errorf("key %s is not allowed", msgs[0].Key))
}
