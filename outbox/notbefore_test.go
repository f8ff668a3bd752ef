package outbox_test

import (
	"context"
	"hash/fnv"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/jackc/pgx/v5"

	"github.com/ferrymq/ferry/memory"
	"github.com/ferrymq/ferry/outbox"
	"github.com/ferrymq/ferry/outbox/pgoutbox"
)

// stamped is a Publisher that records when each message was published, by
// its id, in publish order.
type stamped struct {
	*memory.Broker
	mu  sync.Mutex
	at  map[string]time.Time
	ids []string
}

func newStamped(t *testing.T) *stamped {
	br, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { br.Close() })
	return &stamped{Broker: br, at: map[string]time.Time{}}
}

func (s *stamped) Publish(ctx context.Context, dest string, msgs ...consumer.Message) error {
	if err := s.Broker.Publish(ctx, dest, msgs...); err != nil {
		return err
	}
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range msgs {
		if _, ok := s.at[m.ID]; !ok {
			s.at[m.ID] = now
			s.ids = append(s.ids, m.ID)
		}
		if !m.NotBefore.IsZero() {
			panic("the relay published a message with a NotBefore of its own: " + m.ID)
		}
	}
	return nil
}

// when returns when id was first published, and whether it was.
func (s *stamped) when(id string) (time.Time, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	t, ok := s.at[id]
	return t, ok
}

// order returns the ids published so far, in the order of their first
// publish.
func (s *stamped) order() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.ids...)
}

// An event with a NotBefore ahead is not published before it, and is
// published soon after it (within the poll interval, here 200ms, with room
// for a loaded machine); an event without one, written after it, is
// published at once meanwhile.
func TestNotBeforeHoldsAnEventUntilItsTime(t *testing.T) {
	forEachBackend(t, func(t *testing.T, b *backend) {
		ctx := testenv.Context(t, 60*time.Second)
		pub := newStamped(t)
		notBefore := time.Now().Add(2 * time.Second)
		if err := b.add(ctx, outbox.Event{ID: "held", Destination: queue, Key: "a", NotBefore: notBefore}); err != nil {
			t.Fatal(err)
		}
		if err := b.add(ctx, outbox.Event{ID: "now", Destination: queue, Key: "b"}); err != nil {
			t.Fatal(err)
		}
		runRelay(t, b.store(t, ""), pub, fast()...)
		testenv.WaitFor(t, 30*time.Second, "the event without NotBefore was not published", func() bool {
			_, ok := pub.when("now")
			return ok
		})
		if at, ok := pub.when("held"); ok {
			t.Fatalf("the held event was published %s before its NotBefore", notBefore.Sub(at))
		}
		testenv.WaitFor(t, 30*time.Second, "the held event was not published", func() bool {
			_, ok := pub.when("held")
			return ok
		})
		at, _ := pub.when("held")
		if at.Before(notBefore) {
			t.Fatalf("the held event was published %s before its NotBefore", notBefore.Sub(at))
		}
		if late := at.Sub(notBefore); late > 5*time.Second {
			t.Fatalf("the held event was published %s after its NotBefore, with a poll interval of 200ms", late)
		}
	})
}

// A key's events keep their order: an event written after a held event of
// its key, with no NotBefore or an earlier one, in the same Add or a later
// transaction, is published after it; an event of the key written before
// the held one, and events of other keys, are not held.
func TestNotBeforeKeepsEachKeysOrder(t *testing.T) {
	forEachBackend(t, func(t *testing.T, b *backend) {
		ctx := testenv.Context(t, 60*time.Second)
		pub := newStamped(t)
		notBefore := time.Now().Add(2 * time.Second)
		ev := func(id string, nb time.Time) outbox.Event {
			return outbox.Event{ID: id, Destination: queue, Key: "k", NotBefore: nb}
		}
		if err := b.add(ctx, ev("k0", time.Time{})); err != nil {
			t.Fatal(err)
		}
		// In one Add: the held event, one without NotBefore, one due earlier.
		if err := b.add(ctx, ev("k1", notBefore), ev("k2", time.Time{}), ev("k3", time.Now().Add(time.Second))); err != nil {
			t.Fatal(err)
		}
		// In later transactions.
		if err := b.add(ctx, ev("k4", time.Time{})); err != nil {
			t.Fatal(err)
		}
		if err := b.add(ctx, ev("k5", time.Now().Add(500*time.Millisecond)), outbox.Event{ID: "other", Destination: queue, Key: "other"}); err != nil {
			t.Fatal(err)
		}
		runRelay(t, b.store(t, ""), pub, fast()...)
		testenv.WaitFor(t, 30*time.Second, "every event was published", func() bool { return len(pub.order()) == 7 })
		for _, id := range []string{"k0", "other"} {
			if at, _ := pub.when(id); !at.Before(notBefore) {
				t.Errorf("%s, not held, was published %s after the held event's NotBefore", id, at.Sub(notBefore))
			}
		}
		var keyOrder []string
		for _, id := range pub.order() {
			if id != "other" {
				keyOrder = append(keyOrder, id)
			}
			if at, _ := pub.when(id); id != "k0" && id != "other" && at.Before(notBefore) {
				t.Errorf("%s was published %s before the NotBefore of k1, an earlier event of its key", id, notBefore.Sub(at))
			}
		}
		for i, id := range keyOrder {
			if want := "k" + strconv.Itoa(i); id != want {
				t.Fatalf("key k published in the order %v, want k0 to k5", keyOrder)
			}
		}
	})
}

// Events held far ahead, more than a read takes, do not stand in front of
// an event that is due: the relay reads past them (a store that read the
// lowest ids of its lanes whatever their time would read only held events).
func TestNotBeforeHeldEventsDoNotBlockDueOnes(t *testing.T) {
	forEachBackend(t, func(t *testing.T, b *backend) {
		ctx := testenv.Context(t, 60*time.Second)
		pub := newStamped(t)
		later := time.Now().Add(time.Hour)
		var held []outbox.Event
		for i := range 50 {
			held = append(held, outbox.Event{Destination: queue, Key: "held-" + strconv.Itoa(i), NotBefore: later})
		}
		if err := b.add(ctx, held...); err != nil {
			t.Fatal(err)
		}
		if err := b.add(ctx, outbox.Event{ID: "due", Destination: queue, Key: "due"}); err != nil {
			t.Fatal(err)
		}
		runRelay(t, b.store(t, ""), pub, fast(outbox.WithBatchSize(10))...)
		testenv.WaitFor(t, 30*time.Second, "the due event was not published", func() bool {
			_, ok := pub.when("due")
			return ok
		})
		time.Sleep(500 * time.Millisecond) // a few more polls
		if n := len(pub.order()); n != 1 {
			t.Fatalf("%d events published, want only the due one", n)
		}
	})
}

// The backlog counts held events among Events and in Scheduled, but their
// wait is not an age: OldestAge is the time since an event fell due (its
// writing, or its NotBefore), so an alert on it does not fire for events
// scheduled ahead, and does for one whose time passed unpublished.
func TestNotBeforeBacklogAgesOnlyDueEvents(t *testing.T) {
	forEachBackend(t, func(t *testing.T, b *backend) {
		ctx := testenv.Context(t, 60*time.Second)
		st := b.store(t, "")
		if err := b.add(ctx, outbox.Event{Destination: queue, Key: "a", NotBefore: time.Now().Add(time.Hour)}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(300 * time.Millisecond)
		bl, err := st.Backlog(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if bl.Events != 1 || bl.Scheduled != 1 || bl.OldestAge != 0 {
			t.Fatalf("backlog of one event held an hour ahead: %+v, want 1 event, 1 scheduled, no age", bl)
		}
		if err := b.add(ctx, outbox.Event{Destination: queue, Key: "b", NotBefore: time.Now().Add(200 * time.Millisecond)}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(700 * time.Millisecond)
		bl, err = st.Backlog(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if bl.Events != 2 || bl.Scheduled != 1 || bl.OldestAge < 400*time.Millisecond || bl.OldestAge > time.Minute {
			t.Fatalf("backlog with an event due 500ms ago: %+v, want 2 events, 1 scheduled, an age of about 500ms", bl)
		}
	})
}

// Fetch reads the events of the lanes it is given and of no other, lane 0
// and lane 63 included (the stores pass the lanes as the bits of a 64-bit
// integer, whose sign bit is lane 63).
func TestFetchReadsExactlyItsLanes(t *testing.T) {
	forEachBackend(t, func(t *testing.T, b *backend) {
		ctx := testenv.Context(t, 60*time.Second)
		var evs []outbox.Event
		for i := range 2000 { // every lane gets events
			evs = append(evs, outbox.Event{Destination: queue, Key: "key-" + strconv.Itoa(i)})
		}
		if err := b.add(ctx, evs...); err != nil {
			t.Fatal(err)
		}
		st := b.store(t, "")
		many := []int{63}
		for l := range 33 {
			many = append(many, l)
		}
		// Few lanes are read lane by lane on PostgreSQL, many across lanes.
		for _, lanes := range [][]int{{0}, {63}, {1, 62}, {0, 31, 32, 63}, many} {
			recs, err := st.Fetch(ctx, lanes, 5000)
			if err != nil {
				t.Fatal(err)
			}
			seen := map[int]bool{}
			for _, r := range recs {
				if !slices.Contains(lanes, r.Lane) {
					t.Fatalf("Fetch of lanes %v returned an event of lane %d", lanes, r.Lane)
				}
				seen[r.Lane] = true
			}
			if len(seen) != len(lanes) {
				t.Fatalf("Fetch of lanes %v returned events of lanes %v only", lanes, seen)
			}
		}
	})
}

// On PostgreSQL, a writer whose transaction took its snapshot before a held
// event of its key committed (REPEATABLE READ or SERIALIZABLE, having read
// something before Add) cannot see that event, and writes its own event due
// now; the relay still holds it behind the held one, so the key keeps its
// order.
func TestNotBeforeKeepsOrderForWritersOfAnOlderSnapshot(t *testing.T) {
	for _, iso := range []pgx.TxIsoLevel{pgx.RepeatableRead, pgx.Serializable} {
		t.Run(string(iso), func(t *testing.T) {
			b := openPostgres(t)
			ctx := testenv.Context(t, 30*time.Second)
			w, err := pgoutbox.NewWriter()
			if err != nil {
				t.Fatal(err)
			}
			tx2, err := b.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
			if err != nil {
				t.Fatal(err)
			}
			defer tx2.Rollback(ctx)
			if _, err := tx2.Exec(ctx, `SELECT count(*) FROM ferry_outbox_lanes`); err != nil { // the snapshot is taken
				t.Fatal(err)
			}
			if err := b.add(ctx, outbox.Event{ID: "held", Destination: queue, Key: "k", NotBefore: time.Now().Add(time.Hour)}); err != nil {
				t.Fatal(err)
			}
			if err := w.Add(ctx, tx2, outbox.Event{ID: "behind", Destination: queue, Key: "k"},
				outbox.Event{ID: "other", Destination: queue, Key: "other"}); err != nil {
				t.Fatal(err)
			}
			if err := tx2.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			st := b.store(t, "")
			all := make([]int, outbox.Lanes)
			for i := range all {
				all[i] = i
			}
			for _, lanes := range [][]int{all, {laneOf("other"), laneOf("k")}} {
				recs, err := st.Fetch(ctx, lanes, 100)
				if err != nil {
					t.Fatal(err)
				}
				if len(recs) != 1 || recs[0].ID != "other" {
					var ids []string
					for _, r := range recs {
						ids = append(ids, r.ID)
					}
					t.Fatalf("Fetch of lanes %v read %v; want only the event of the other key, the one behind the held event of its key held too", lanes, ids)
				}
			}
		})
	}
}

// laneOf is the lane of key, as outbox.Lanes documents it: the FNV-1a hash
// of the key modulo Lanes.
func laneOf(key string) int {
	h := fnv.New32a()
	h.Write([]byte(key))
	return int(h.Sum32() % outbox.Lanes)
}
