// Package storetest is the conformance suite for idempotency.Store
// implementations. Every store in Ferry passes it against its real backend;
// a store written elsewhere is done when it passes it too.
//
// Run checks the claim, complete and release cycle, owner tokens, lease
// expiry and takeover, retention, Cleanup (for stores that are an
// idempotency.Cleaner), and that many concurrent workers receiving every
// message several times, in random order, produce each effect exactly once.
package storetest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
)

// Effect is the side effect a handler performs once per key in the
// exactly-once test: for a database store, a row in a table without a unique
// constraint, so that a duplicate would show.
type Effect interface {
	// Apply performs the effect for key once more.
	Apply(ctx context.Context, key string) error
	// Counts returns how often the effect happened, per key.
	Counts(ctx context.Context) (map[string]int, error)
}

// Config describes the store under test.
type Config struct {
	// NewStore returns a fresh, empty store for one test. Required.
	NewStore func(t *testing.T) idempotency.Store
	// NewEffect returns a fresh effect for the exactly-once test. Default an
	// in-memory list of applications (MemoryEffect).
	NewEffect func(t *testing.T) Effect
	// Keys is how many distinct keys the exactly-once test delivers.
	// Default 10000.
	Keys int
	// Copies is how often each key is delivered. Default 3.
	Copies int
	// Workers is how many goroutines deliver at once. Default 16.
	Workers int
	// Lease is the short lease used by the expiry tests. Default 200ms.
	Lease time.Duration
}

func (c *Config) defaults() {
	if c.Keys <= 0 {
		c.Keys = 10000
	}
	if c.Copies <= 0 {
		c.Copies = 3
	}
	if c.Workers <= 0 {
		c.Workers = 16
	}
	if c.Lease <= 0 {
		c.Lease = 200 * time.Millisecond
	}
	if c.NewEffect == nil {
		c.NewEffect = func(*testing.T) Effect { return NewMemoryEffect() }
	}
}

// Timeout bounds every wait of the suite (for a lease to expire, for the
// exactly-once run); generous, for loaded machines.
var Timeout = 30 * time.Second

// Run runs the conformance suite as subtests of t.
func Run(t *testing.T, c Config) {
	if c.NewStore == nil {
		t.Fatal("storetest: Config.NewStore is required")
	}
	c.defaults()
	t.Run("ClaimCompleteDuplicate", func(t *testing.T) { testClaimComplete(t, c) })
	t.Run("ReleaseLetsTheKeyBeClaimedAgain", func(t *testing.T) { testRelease(t, c) })
	t.Run("OnlyTheHolderCompletesOrReleases", func(t *testing.T) { testOwner(t, c) })
	t.Run("ExpiredClaimIsTakenOver", func(t *testing.T) { testTakeover(t, c) })
	t.Run("SlowWorkerCannotTouchNewHolder", func(t *testing.T) { testSlowWorker(t, c) })
	t.Run("RetentionEnds", func(t *testing.T) { testRetention(t, c) })
	t.Run("Cleanup", func(t *testing.T) { testCleanup(t, c) })
	t.Run("DeadWorkerTakenOverThroughMiddleware", func(t *testing.T) { testDeadWorkerMiddleware(t, c) })
	t.Run("HandlerErrorReleases", func(t *testing.T) { testHandlerError(t, c) })
	t.Run("ExactlyOnceUnderConcurrentDuplicates", func(t *testing.T) { testExactlyOnce(t, c) })
	t.Run("AnyKeyBytes", func(t *testing.T) { testAnyKeyBytes(t, c) })
	t.Run("OddKeyThroughDeliveryLoop", func(t *testing.T) { testOddKeyThroughLoop(t, c) })
}

func ctxFor(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func mustClaim(t *testing.T, s idempotency.Store, key string, lease time.Duration, want idempotency.Status) idempotency.Claim {
	t.Helper()
	cl, err := s.Claim(ctxFor(t), key, lease)
	if err != nil {
		t.Fatalf("Claim(%q): %v", key, err)
	}
	if cl.Status != want {
		t.Fatalf("Claim(%q) = %v, want %v", key, cl.Status, want)
	}
	if want == idempotency.Claimed && cl.Token == "" {
		t.Fatalf("Claim(%q) claimed with an empty token", key)
	}
	return cl
}

// WaitClaim claims key again and again until the store answers Claimed (a
// lease or a retention ended), failing t after Timeout.
func WaitClaim(t *testing.T, s idempotency.Store, key string, lease time.Duration) idempotency.Claim {
	t.Helper()
	deadline := time.Now().Add(Timeout)
	for {
		cl, err := s.Claim(ctxFor(t), key, lease)
		if err != nil {
			t.Fatalf("Claim(%q): %v", key, err)
		}
		if cl.Status == idempotency.Claimed {
			return cl
		}
		if time.Now().After(deadline) {
			t.Fatalf("Claim(%q) still answers %v after %s", key, cl.Status, Timeout)
		}
		time.Sleep(10 * time.Millisecond) // poll interval, not synchronisation
	}
}

func testClaimComplete(t *testing.T, c Config) {
	s := c.NewStore(t)
	ctx := ctxFor(t)
	cl := mustClaim(t, s, "k1", time.Minute, idempotency.Claimed)
	in := mustClaim(t, s, "k1", time.Minute, idempotency.InProgress)
	if in.Token != "" {
		t.Errorf("InProgress claim carries a token %q", in.Token)
	}
	if in.LeaseLeft < 0 || in.LeaseLeft > time.Minute+time.Second {
		t.Errorf("LeaseLeft = %s, want within (0, 1m]", in.LeaseLeft)
	}
	mustClaim(t, s, "k2", time.Minute, idempotency.Claimed) // other keys are independent
	if err := s.Complete(ctx, "k1", cl.Token, time.Hour); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	mustClaim(t, s, "k1", time.Minute, idempotency.Done)
	if err := s.Complete(ctx, "k1", cl.Token, time.Hour); !errors.Is(err, idempotency.ErrNotOwner) {
		t.Errorf("second Complete = %v, want ErrNotOwner", err)
	}
	if err := s.Release(ctx, "k1", cl.Token); !errors.Is(err, idempotency.ErrNotOwner) {
		t.Errorf("Release after Complete = %v, want ErrNotOwner", err)
	}
	mustClaim(t, s, "k1", time.Minute, idempotency.Done)
}

func testRelease(t *testing.T, c Config) {
	s := c.NewStore(t)
	ctx := ctxFor(t)
	cl := mustClaim(t, s, "k", time.Minute, idempotency.Claimed)
	if err := s.Release(ctx, "k", cl.Token); err != nil {
		t.Fatalf("Release: %v", err)
	}
	cl2 := mustClaim(t, s, "k", time.Minute, idempotency.Claimed)
	if cl2.Token == cl.Token {
		t.Errorf("a new claim reused the old token %q", cl.Token)
	}
	if err := s.Release(ctx, "k", cl.Token); !errors.Is(err, idempotency.ErrNotOwner) {
		t.Errorf("Release with the released token = %v, want ErrNotOwner", err)
	}
	mustClaim(t, s, "k", time.Minute, idempotency.InProgress)
}

func testOwner(t *testing.T, c Config) {
	s := c.NewStore(t)
	ctx := ctxFor(t)
	cl := mustClaim(t, s, "k", time.Minute, idempotency.Claimed)
	for _, tok := range []string{"", idempotency.NewToken()} {
		if err := s.Complete(ctx, "k", tok, time.Hour); !errors.Is(err, idempotency.ErrNotOwner) {
			t.Errorf("Complete with token %q = %v, want ErrNotOwner", tok, err)
		}
		if err := s.Release(ctx, "k", tok); !errors.Is(err, idempotency.ErrNotOwner) {
			t.Errorf("Release with token %q = %v, want ErrNotOwner", tok, err)
		}
	}
	if err := s.Complete(ctx, "absent", cl.Token, time.Hour); !errors.Is(err, idempotency.ErrNotOwner) {
		t.Errorf("Complete of an absent key = %v, want ErrNotOwner", err)
	}
	if err := s.Release(ctx, "absent", cl.Token); !errors.Is(err, idempotency.ErrNotOwner) {
		t.Errorf("Release of an absent key = %v, want ErrNotOwner", err)
	}
	mustClaim(t, s, "k", time.Minute, idempotency.InProgress) // the wrong tokens changed nothing
	if err := s.Complete(ctx, "k", cl.Token, time.Hour); err != nil {
		t.Fatalf("Complete by the holder: %v", err)
	}
}

func testTakeover(t *testing.T, c Config) {
	s := c.NewStore(t)
	ctx := ctxFor(t)
	mustClaim(t, s, "k", c.Lease, idempotency.Claimed) // its holder dies
	cl := WaitClaim(t, s, "k", time.Minute)
	if err := s.Complete(ctx, "k", cl.Token, time.Hour); err != nil {
		t.Fatalf("Complete by the new holder: %v", err)
	}
	mustClaim(t, s, "k", time.Minute, idempotency.Done)
}

func testSlowWorker(t *testing.T, c Config) {
	s := c.NewStore(t)
	ctx := ctxFor(t)
	slow := mustClaim(t, s, "k", c.Lease, idempotency.Claimed)
	holder := WaitClaim(t, s, "k", time.Minute)
	if err := s.Release(ctx, "k", slow.Token); !errors.Is(err, idempotency.ErrNotOwner) {
		t.Errorf("slow worker's Release = %v, want ErrNotOwner", err)
	}
	if err := s.Complete(ctx, "k", slow.Token, time.Hour); !errors.Is(err, idempotency.ErrNotOwner) {
		t.Errorf("slow worker's Complete = %v, want ErrNotOwner", err)
	}
	mustClaim(t, s, "k", time.Minute, idempotency.InProgress) // still the new holder's
	if err := s.Complete(ctx, "k", holder.Token, time.Hour); err != nil {
		t.Fatalf("new holder's Complete: %v", err)
	}
	mustClaim(t, s, "k", time.Minute, idempotency.Done)
}

func testRetention(t *testing.T, c Config) {
	s := c.NewStore(t)
	ctx := ctxFor(t)
	cl := mustClaim(t, s, "k", time.Minute, idempotency.Claimed)
	if err := s.Complete(ctx, "k", cl.Token, c.Lease); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	mustClaim(t, s, "long", time.Minute, idempotency.Claimed)
	WaitClaim(t, s, "k", time.Minute) // claimable again once its retention ended
}

func testCleanup(t *testing.T, c Config) {
	s := c.NewStore(t)
	cleaner, ok := s.(idempotency.Cleaner)
	if !ok {
		t.Skipf("%T expires keys by itself (not an idempotency.Cleaner)", s)
	}
	ctx := ctxFor(t)
	// Two keys that will expire: a completion with a short retention and a
	// claim with a short lease whose holder died.
	short := mustClaim(t, s, "done-short", time.Minute, idempotency.Claimed)
	if err := s.Complete(ctx, "done-short", short.Token, c.Lease); err != nil {
		t.Fatal(err)
	}
	mustClaim(t, s, "claim-short", c.Lease, idempotency.Claimed)
	// Two that will not.
	long := mustClaim(t, s, "done-long", time.Minute, idempotency.Claimed)
	if err := s.Complete(ctx, "done-long", long.Token, time.Hour); err != nil {
		t.Fatal(err)
	}
	live := mustClaim(t, s, "claim-long", time.Hour, idempotency.Claimed)

	var removed int64
	deadline := time.Now().Add(Timeout)
	for removed < 2 {
		n, err := cleaner.Cleanup(ctx)
		if err != nil {
			t.Fatalf("Cleanup: %v", err)
		}
		removed += n
		if removed < 2 {
			if time.Now().After(deadline) {
				t.Fatalf("Cleanup removed %d keys after %s, want 2", removed, Timeout)
			}
			time.Sleep(20 * time.Millisecond) // poll interval
		}
	}
	if removed != 2 {
		t.Errorf("Cleanup removed %d keys, want 2", removed)
	}
	if n, err := cleaner.Cleanup(ctx); err != nil || n != 0 {
		t.Errorf("second Cleanup = %d, %v; want 0, nil", n, err)
	}
	mustClaim(t, s, "done-long", time.Minute, idempotency.Done)
	mustClaim(t, s, "claim-long", time.Minute, idempotency.InProgress)
	if err := s.Complete(ctx, "claim-long", live.Token, time.Hour); err != nil {
		t.Errorf("the live claim's holder lost it to Cleanup: %v", err)
	}
	// The expired ones are gone: both can be claimed afresh.
	mustClaim(t, s, "done-short", time.Minute, idempotency.Claimed)
	mustClaim(t, s, "claim-short", time.Minute, idempotency.Claimed)
}

// Message returns a delivery of the event key (in the EventIDHeader), as the
// copy-th delivery: every copy has its own broker id, as when a publisher
// published the event twice.
func Message(key string, copy int) *consumer.Message {
	return &consumer.Message{
		ID:      key + "#" + strconv.Itoa(copy),
		Headers: map[string]string{idempotency.EventIDHeader: key},
		Source:  "storetest",
		Offset:  -1,
		Attempt: 1,
	}
}

func effectHandler(e Effect) consumer.Handler {
	return consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return e.Apply(ctx, m.Header(idempotency.EventIDHeader))
	})
}

func testDeadWorkerMiddleware(t *testing.T, c Config) {
	s := c.NewStore(t)
	ctx := ctxFor(t)
	e := c.NewEffect(t)
	dedup, err := idempotency.New(s, "dead", idempotency.WithLease(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	h := dedup.Wrap(effectHandler(e))
	// A worker claimed the key and died: it never completes nor releases.
	mustClaim(t, s, idempotency.Key("dead", "ev"), c.Lease, idempotency.Claimed)

	err = h.Handle(ctx, Message("ev", 1))
	var ra *consumer.DeferredError
	if !errors.As(err, &ra) || !errors.Is(err, idempotency.ErrInProgress) {
		t.Fatalf("delivery while the dead claim lives = %v, want RetryAfter(ErrInProgress)", err)
	}
	if ra.Delay <= 0 || ra.Delay > idempotency.DefaultInProgressDelay {
		t.Errorf("retry delay = %s, want within (0, %s]", ra.Delay, idempotency.DefaultInProgressDelay)
	}
	deadline := time.Now().Add(Timeout)
	for copy := 2; ; copy++ {
		err := h.Handle(ctx, Message("ev", copy))
		if err == nil {
			break
		}
		if !errors.Is(err, idempotency.ErrInProgress) || time.Now().After(deadline) {
			t.Fatalf("redelivery %d: %v", copy, err)
		}
		time.Sleep(10 * time.Millisecond) // the broker's redelivery delay
	}
	if err := h.Handle(ctx, Message("ev", 1000)); err != nil {
		t.Fatalf("duplicate after completion: %v", err)
	}
	assertCounts(t, e, map[string]int{"ev": 1})
}

func testHandlerError(t *testing.T, c Config) {
	s := c.NewStore(t)
	ctx := ctxFor(t)
	e := c.NewEffect(t)
	dedup, err := idempotency.New(s, "errs")
	if err != nil {
		t.Fatal(err)
	}
	boom := consumer.Permanent(errors.New("boom"))
	var calls atomic.Int32
	h := dedup.Wrap(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if calls.Add(1) == 1 {
			return boom
		}
		return e.Apply(ctx, m.Header(idempotency.EventIDHeader))
	}))
	if err := h.Handle(ctx, Message("ev", 1)); err != boom {
		t.Fatalf("first delivery = %v, want the handler's error unchanged", err)
	}
	// Released: the redelivery runs at once, not after the 5-minute lease.
	if err := h.Handle(ctx, Message("ev", 2)); err != nil {
		t.Fatalf("redelivery: %v", err)
	}
	if err := h.Handle(ctx, Message("ev", 3)); err != nil {
		t.Fatalf("duplicate: %v", err)
	}
	if n := calls.Load(); n != 2 {
		t.Errorf("handler ran %d times, want 2", n)
	}
	assertCounts(t, e, map[string]int{"ev": 1})
}

func testExactlyOnce(t *testing.T, c Config) {
	s := c.NewStore(t)
	e := c.NewEffect(t)
	dedup, err := idempotency.New(s, "once", idempotency.WithLease(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	ExactlyOnce(t, dedup.Wrap(effectHandler(e)), e, c.Keys, c.Copies, c.Workers)
}

// ExactlyOnce delivers copies deliveries of each of keys distinct events to
// h, shuffled, from workers goroutines, as a consumer would: a delivery that
// fails with ErrInProgress is delivered again, any other error fails t. Then
// it checks that e happened exactly once per key.
func ExactlyOnce(t *testing.T, h consumer.Handler, e Effect, keys, copies, workers int) {
	t.Helper()
	ctx := ctxFor(t)
	type delivery struct {
		key  string
		copy int
	}
	all := make([]delivery, 0, keys*copies)
	want := make(map[string]int, keys)
	for i := range keys {
		k := fmt.Sprintf("ev-%06d", i)
		if i%10 == 0 { // one key in ten has bytes no text column takes
			k = OddKeys[(i/10)%len(OddKeys)] + k
		}
		want[k] = 1
		for cp := range copies {
			all = append(all, delivery{k, cp})
		}
	}
	rand.Shuffle(len(all), func(i, j int) { all[i], all[j] = all[j], all[i] })
	queue := make(chan delivery, len(all))
	for _, d := range all {
		queue <- d
	}
	var (
		pending  atomic.Int64
		requeued atomic.Int64
		wg       sync.WaitGroup
		errOnce  sync.Once
		firstErr error
	)
	pending.Store(int64(len(all)))
	stop := make(chan struct{})
	fail := func(err error) {
		errOnce.Do(func() { firstErr = err; close(stop) })
	}
	for range workers {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				case d := <-queue:
					err := h.Handle(ctx, Message(d.key, d.copy))
					switch {
					case err == nil:
						if pending.Add(-1) == 0 {
							fail(nil)
						}
					case errors.Is(err, idempotency.ErrInProgress):
						requeued.Add(1)
						queue <- d // never blocks: the queue holds every delivery
					default:
						fail(fmt.Errorf("delivery of %s copy %d: %w", d.key, d.copy, err))
					}
				}
			}
		})
	}
	wg.Wait()
	if firstErr != nil {
		t.Fatal(firstErr)
	}
	t.Logf("%d deliveries of %d keys by %d workers; %d returned while in progress", len(all), keys, workers, requeued.Load())
	assertCounts(t, e, want)
}

func assertCounts(t *testing.T, e Effect, want map[string]int) {
	t.Helper()
	got, err := e.Counts(ctxFor(t))
	if err != nil {
		t.Fatalf("Counts: %v", err)
	}
	bad := 0
	for k, n := range want {
		if got[k] != n {
			if bad < 5 {
				t.Errorf("effect of %s happened %d times, want %d", k, got[k], n)
			}
			bad++
		}
	}
	for k, n := range got {
		if _, ok := want[k]; !ok {
			if bad < 5 {
				t.Errorf("unexpected effect for %s (%d times)", k, n)
			}
			bad++
		}
	}
	if bad > 0 {
		t.Errorf("%d keys with a wrong effect count out of %d", bad, len(want))
	}
}

// MemoryEffect is an Effect that appends to a list in memory.
type MemoryEffect struct {
	mu   sync.Mutex
	list []string
}

// NewMemoryEffect returns an empty MemoryEffect.
func NewMemoryEffect() *MemoryEffect { return &MemoryEffect{} }

// Apply implements Effect.
func (e *MemoryEffect) Apply(_ context.Context, key string) error {
	e.mu.Lock()
	e.list = append(e.list, key)
	e.mu.Unlock()
	return nil
}

// Counts implements Effect.
func (e *MemoryEffect) Counts(context.Context) (map[string]int, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	m := make(map[string]int)
	for _, k := range e.list {
		m[k]++
	}
	return m, nil
}
