package outbox_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/outbox"
)

func keyed(prefix string, keys ...string) []outbox.Event {
	evs := make([]outbox.Event, len(keys))
	for i, k := range keys {
		evs[i] = outbox.Event{ID: prefix + "-" + k + "-" + strconv.Itoa(i), Destination: queue, Key: k}
	}
	return evs
}

func manyKeys(n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = "k" + strconv.Itoa(i)
	}
	return keys
}

// One Add of 70,000 distinct keys on PostgreSQL, more than it takes
// parameters in a statement (65,535) and more advisory locks than its lock
// table holds by default, commits, and every event is published. (SQLite
// has neither limit, and inserts at most 100 events a statement.)
func TestPostgresAddOfSeventyThousandKeys(t *testing.T) {
	b := openPostgres(t)
	ctx := testenv.Context(t, 120*time.Second)
	const n = 70_000
	evs := keyed("e", manyKeys(n)...)
	if err := b.add(ctx, evs...); err != nil {
		t.Fatalf("Add of %d keys: %v", n, err)
	}
	pub := &recorder{}
	st := b.store(t, "")
	runRelay(t, st, pub, fast(outbox.WithBatchSize(1000))...)
	testenv.WaitFor(t, 90*time.Second, "not every event was published", func() bool {
		return len(pub.all()) >= n
	})
	seen := make(map[string]bool, n)
	for _, s := range pub.all() {
		seen[s.msg.ID] = true
	}
	for _, e := range evs {
		if !seen[e.ID] {
			t.Fatalf("event %s was not published", e.ID)
		}
	}
}

// Two transactions writing one key take turns, whatever the size of their
// Add calls: up to a thousand keys an Add locks each key, above that it
// takes the outbox's write lock, and the two kinds exclude each other.
func TestPostgresWritersOfOneKeyTakeTurns(t *testing.T) {
	b := openPostgres(t)
	ctx := testenv.Context(t, 60*time.Second)
	small := keyed("small", "a")
	large := keyed("large", append(manyKeys(1500), "a")...)
	for _, c := range []struct {
		name          string
		first, second []outbox.Event
	}{
		{"small then small", small, small},
		{"small then large", small, large},
		{"large then small", large, small},
		{"large then large", large, large},
	} {
		t.Run(c.name, func(t *testing.T) {
			waited, err := secondWaits(ctx, b, c.first, c.second)
			if err != nil {
				t.Fatal(err)
			}
			if !waited {
				t.Fatal("the second transaction wrote the key while the first held it")
			}
		})
	}
	// Small writers of different keys do not wait for each other.
	waited, err := secondWaits(ctx, b, keyed("x", "x1", "x2"), keyed("y", "y1", "y2"))
	if err != nil {
		t.Fatal(err)
	}
	if waited {
		t.Fatal("a writer of other keys waited")
	}
}

// secondWaits runs a transaction that adds first and stays open, then one
// that adds second, and reports whether the second Add waited until the
// first transaction committed.
func secondWaits(ctx context.Context, b *backend, first, second []outbox.Event) (bool, error) {
	added, release := make(chan error, 1), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		done <- b.tx(ctx, func(add addFunc, _ execFunc) error {
			err := add(ctx, first...)
			added <- err
			<-release
			return err
		})
	}()
	if err := <-added; err != nil {
		close(release)
		<-done
		return false, err
	}
	secondAdded := make(chan error, 1)
	go func() {
		secondAdded <- b.tx(ctx, func(add addFunc, _ execFunc) error { return add(ctx, second...) })
	}()
	waited := true
	select {
	case err := <-secondAdded:
		waited = false
		close(release)
		return waited, errors.Join(err, <-done)
	case <-time.After(300 * time.Millisecond):
	}
	close(release)
	if err := <-done; err != nil {
		return waited, err
	}
	select {
	case err := <-secondAdded:
		return waited, err
	case <-time.After(10 * time.Second):
		return waited, errors.New("the second transaction still waits after the first committed")
	}
}

// Writers adding small and large sets of overlapping keys, in any order,
// one Add per transaction, never deadlock: every transaction commits at its
// first try.
func TestPostgresConcurrentAddsOfOverlappingKeysDoNotDeadlock(t *testing.T) {
	b := openPostgres(t)
	ctx := testenv.Context(t, 90*time.Second)
	keys := manyKeys(3000)
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for w := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 8 {
				n := 1 + rand.IntN(50)
				if i%3 == 0 {
					n = 1001 + rand.IntN(2000) // above the per-key locks
				}
				pick := make([]string, n)
				for j := range pick {
					pick[j] = keys[rand.IntN(len(keys))]
				}
				evs := keyed("w"+strconv.Itoa(w)+"-"+strconv.Itoa(i), pick...)
				if err := b.add(ctx, evs...); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}
