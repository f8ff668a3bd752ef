package outbox_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/memory"
	"github.com/ferrymq/ferry/outbox"
)

// scripted publishes to the memory broker through a script that may refuse
// some messages, and records every message it published, in order.
type scripted struct {
	br     *memory.Broker
	mu     sync.Mutex
	calls  int
	got    []string // ids published, in order, over all destinations
	script func(call int, msgs []consumer.Message) (publish []bool, err error)
}

func (s *scripted) Publish(ctx context.Context, dest string, msgs ...consumer.Message) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls++
	ok, err := s.script(s.calls, msgs)
	for i, m := range msgs {
		if ok == nil || ok[i] {
			if perr := s.br.Publish(ctx, dest, m); perr != nil {
				return perr
			}
			s.got = append(s.got, m.ID)
		}
	}
	return err
}

func (s *scripted) published() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.got)
}

func drain(t *testing.T, st outbox.Store) {
	t.Helper()
	testenv.WaitFor(t, 30*time.Second, "the outbox did not drain", func() bool {
		bl, err := st.Backlog(context.Background())
		return err == nil && bl.Events == 0
	})
}

// A publisher that took a key's later event but failed its earlier one: the
// relay keeps both and publishes them again in order; other keys' events
// that went through are not published again.
func TestPartialFailureRepublishesTheKeyInOrder(t *testing.T) {
	b := openSQLite(t)
	ctx := testenv.Context(t, 30*time.Second)
	br, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer br.Close()
	if err := b.add(ctx,
		outbox.Event{ID: "k1", Destination: queue, Key: "k"},
		outbox.Event{ID: "k2", Destination: queue, Key: "k"},
		outbox.Event{ID: "j1", Destination: queue, Key: "j"},
	); err != nil {
		t.Fatal(err)
	}
	pub := &scripted{br: br, script: func(call int, msgs []consumer.Message) ([]bool, error) {
		if call > 1 {
			return nil, nil
		}
		ok := make([]bool, len(msgs))
		var pe consumer.PublishError
		for i, m := range msgs {
			if m.ID == "k1" {
				pe.Failed = append(pe.Failed, consumer.FailedMessage{Index: i, Err: errors.New("throttled")})
			} else {
				ok[i] = true
			}
		}
		return ok, &pe
	}}
	st := b.store(t, "")
	runRelay(t, st, pub, fast()...)
	drain(t, st)
	if got, want := strings.Join(pub.published(), " "), "k2 j1 k1 k2"; got != want {
		t.Fatalf("published %q, want %q", got, want)
	}
}

// A publisher that refuses a whole batch for good without saying which
// message was at fault: the relay publishes the batch one event at a time and
// moves only the bad one to the failed events.
func TestBatchRefusedForGoodIsTriedOneByOne(t *testing.T) {
	b := openSQLite(t)
	ctx := testenv.Context(t, 30*time.Second)
	br, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer br.Close()
	if err := b.add(ctx,
		outbox.Event{ID: "a", Destination: queue, Key: "k"},
		outbox.Event{ID: "bad", Destination: queue, Key: "k", Body: []byte("poison")},
		outbox.Event{ID: "c", Destination: queue, Key: "k"},
	); err != nil {
		t.Fatal(err)
	}
	pub := &scripted{br: br, script: func(call int, msgs []consumer.Message) ([]bool, error) {
		for _, m := range msgs {
			if string(m.Body) == "poison" {
				return make([]bool, len(msgs)), consumer.Permanent(errors.New("batch too large"))
			}
		}
		return nil, nil
	}}
	st := b.store(t, "")
	r, _ := runRelay(t, st, pub, fast()...)
	drain(t, st)
	if got, want := strings.Join(pub.published(), " "), "a c"; got != want {
		t.Fatalf("published %q, want %q", got, want)
	}
	bl, err := st.Backlog(ctx)
	if err != nil || bl.Failed != 1 {
		t.Fatalf("backlog %+v, %v: want 1 failed event", bl, err)
	}
	testenv.WaitFor(t, 10*time.Second, "the failed event was not counted", func() bool { return r.Stats().Failed == 1 })
}

// Events of one key going to two destinations are published in commit
// order, even though the relay publishes destination by destination.
func TestKeyAcrossDestinationsKeepsOrder(t *testing.T) {
	b := openSQLite(t)
	ctx := testenv.Context(t, 30*time.Second)
	br, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer br.Close()
	if err := b.add(ctx,
		outbox.Event{ID: "1", Destination: "a", Key: "k"},
		outbox.Event{ID: "2", Destination: "b", Key: "k"},
		outbox.Event{ID: "3", Destination: "a", Key: "k"},
		outbox.Event{ID: "4", Destination: "b", Key: "k"},
	); err != nil {
		t.Fatal(err)
	}
	pub := &scripted{br: br, script: func(int, []consumer.Message) ([]bool, error) { return nil, nil }}
	st := b.store(t, "")
	runRelay(t, st, pub, fast()...)
	drain(t, st)
	if got, want := strings.Join(pub.published(), " "), "1 2 3 4"; got != want {
		t.Fatalf("published %q, want %q", got, want)
	}
}
