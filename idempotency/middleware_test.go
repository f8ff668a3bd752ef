package idempotency_test

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
)

func msg(id, event string) *consumer.Message {
	m := &consumer.Message{ID: id, Headers: map[string]string{}, Offset: -1, Attempt: 1}
	if event != "" {
		m.Headers[idempotency.EventIDHeader] = event
	}
	return m
}

func counting(n *atomic.Int32) consumer.Handler {
	return consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		n.Add(1)
		return nil
	})
}

// mustNew returns the middleware of a new Dedup.
func mustNew(t *testing.T, s idempotency.Store, ns string, opts ...idempotency.Option) consumer.Middleware {
	t.Helper()
	dedup, err := idempotency.New(s, ns, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return dedup.Wrap
}

func TestEventIDHeaderIsTheOutboxHeader(t *testing.T) {
	if idempotency.EventIDHeader != "ferry-event-id" {
		t.Fatalf("EventIDHeader = %q; the outbox sets ferry-event-id", idempotency.EventIDHeader)
	}
}

func TestDuplicateOfCompletedKeyIsAckedWithoutHandler(t *testing.T) {
	ctx := context.Background()
	var n atomic.Int32
	h := mustNew(t, idempotency.NewMemoryStore(), "billing")(counting(&n))
	// Same event, published twice: different broker ids, same event id.
	if err := h.Handle(ctx, msg("a", "ev-1")); err != nil {
		t.Fatal(err)
	}
	if err := h.Handle(ctx, msg("b", "ev-1")); err != nil {
		t.Fatalf("duplicate = %v, want nil (acked)", err)
	}
	if n.Load() != 1 {
		t.Fatalf("handler ran %d times, want 1", n.Load())
	}
}

func TestKeyFallsBackToMessageID(t *testing.T) {
	ctx := context.Background()
	var n atomic.Int32
	h := mustNew(t, idempotency.NewMemoryStore(), "billing")(counting(&n))
	for range 2 {
		if err := h.Handle(ctx, msg("broker-id-1", "")); err != nil {
			t.Fatal(err)
		}
	}
	if err := h.Handle(ctx, msg("broker-id-2", "")); err != nil {
		t.Fatal(err)
	}
	if n.Load() != 2 {
		t.Fatalf("handler ran %d times, want 2 (one per broker id)", n.Load())
	}
}

func TestWithKeyUsesTheFunction(t *testing.T) {
	ctx := context.Background()
	var n atomic.Int32
	key := func(m *consumer.Message) (string, error) { return string(m.Body), nil }
	h := mustNew(t, idempotency.NewMemoryStore(), "billing", idempotency.WithKey(key))(counting(&n))
	for _, body := range []string{"x", "x", "y"} {
		m := msg("same-id", "same-event")
		m.Body = []byte(body)
		if err := h.Handle(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	if n.Load() != 2 {
		t.Fatalf("handler ran %d times, want 2 (keys x and y)", n.Load())
	}
}

func TestNamespacesAreIndependent(t *testing.T) {
	ctx := context.Background()
	store := idempotency.NewMemoryStore()
	var billing, shipping atomic.Int32
	hb := mustNew(t, store, "billing")(counting(&billing))
	hs := mustNew(t, store, "shipping")(counting(&shipping))
	for range 2 {
		for _, h := range []consumer.Handler{hb, hs} {
			if err := h.Handle(ctx, msg("m", "ev")); err != nil {
				t.Fatal(err)
			}
		}
	}
	if billing.Load() != 1 || shipping.Load() != 1 {
		t.Fatalf("billing ran %d, shipping ran %d; want 1 each", billing.Load(), shipping.Load())
	}
	cl, err := store.Claim(ctx, idempotency.Key("billing", "ev"), time.Minute)
	if err != nil || cl.Status != idempotency.Done {
		t.Fatalf("billing's key = %v, %v; want done under Key(namespace, key)", cl.Status, err)
	}
}

func TestMessageWithoutKeyIsPermanent(t *testing.T) {
	var n atomic.Int32
	h := mustNew(t, idempotency.NewMemoryStore(), "billing")(counting(&n))
	err := h.Handle(context.Background(), msg("", ""))
	if !errors.Is(err, idempotency.ErrNoKey) || !consumer.IsPermanent(err) {
		t.Fatalf("err = %v, want permanent ErrNoKey", err)
	}
	kerr := errors.New("bad body")
	h = mustNew(t, idempotency.NewMemoryStore(), "billing", idempotency.WithKey(func(*consumer.Message) (string, error) {
		return "", kerr
	}))(counting(&n))
	err = h.Handle(context.Background(), msg("id", "ev"))
	if !errors.Is(err, kerr) || !errors.Is(err, idempotency.ErrNoKey) || !consumer.IsPermanent(err) {
		t.Fatalf("err = %v, want permanent ErrNoKey wrapping the key function's error", err)
	}
	if n.Load() != 0 {
		t.Fatalf("handler ran %d times without a key", n.Load())
	}
}

func TestInProgressIsRetriedAfterDelay(t *testing.T) {
	ctx := context.Background()
	store := idempotency.NewMemoryStore()
	var n atomic.Int32
	h := mustNew(t, store, "billing", idempotency.WithInProgressDelay(3*time.Second))(counting(&n))
	if _, err := store.Claim(ctx, idempotency.Key("billing", "ev"), time.Hour); err != nil {
		t.Fatal(err)
	}
	err := h.Handle(ctx, msg("m", "ev"))
	var ra *consumer.DeferredError
	if !errors.As(err, &ra) || !errors.Is(err, idempotency.ErrInProgress) {
		t.Fatalf("err = %v, want RetryAfter(ErrInProgress)", err)
	}
	if ra.Delay != 3*time.Second {
		t.Errorf("delay = %s, want the configured 3s", ra.Delay)
	}
	if consumer.IsPermanent(err) {
		t.Error("in progress must not be permanent")
	}
	// A lease that ends sooner shortens the delay.
	if _, err := store.Claim(ctx, idempotency.Key("billing", "ev2"), time.Second); err != nil {
		t.Fatal(err)
	}
	err = h.Handle(ctx, msg("m", "ev2"))
	if !errors.As(err, &ra) || ra.Delay > time.Second || ra.Delay <= 0 {
		t.Errorf("err = %v, want a delay within (0, 1s]", err)
	}
	if n.Load() != 0 {
		t.Fatalf("handler ran %d times while the key was held elsewhere", n.Load())
	}
}

// downStore is a Store whose backend cannot be reached. (The real stores are
// tested against closed ports in their own packages.)
type downStore struct{}

var errDown = errors.New("connection refused")

func (downStore) Claim(context.Context, string, time.Duration) (idempotency.Claim, error) {
	return idempotency.Claim{}, errDown
}
func (downStore) Complete(context.Context, string, string, time.Duration) error { return errDown }
func (downStore) Release(context.Context, string, string) error                 { return errDown }

func TestStoreDownIsAPlainErrorAndHandlerNotCalled(t *testing.T) {
	var n atomic.Int32
	h := mustNew(t, downStore{}, "billing")(counting(&n))
	err := h.Handle(context.Background(), msg("m", "ev"))
	if !errors.Is(err, errDown) {
		t.Fatalf("err = %v, want the store's error wrapped", err)
	}
	var ra *consumer.RetryAfterError
	if consumer.IsPermanent(err) || errors.As(err, &ra) || consumer.IsDeferred(err) || errors.Is(err, idempotency.ErrInProgress) {
		t.Fatalf("err = %v, want a plain error (the loop redelivers with its backoff)", err)
	}
	if n.Load() != 0 {
		t.Fatal("handler ran without a claim")
	}
}

// failingComplete completes nothing: the store went down after the claim.
type failingComplete struct{ *idempotency.MemoryStore }

func (failingComplete) Complete(context.Context, string, string, time.Duration) error { return errDown }

func TestCompleteFailureIsNotAcked(t *testing.T) {
	var n atomic.Int32
	h := mustNew(t, failingComplete{idempotency.NewMemoryStore()}, "billing")(counting(&n))
	if err := h.Handle(context.Background(), msg("m", "ev")); !errors.Is(err, errDown) {
		t.Fatalf("err = %v, want the completion's error", err)
	}
}

// hungSettle is a store whose Complete and Release hang until their
// context ends, as a store behind a network partition does.
type hungSettle struct{ *idempotency.MemoryStore }

func (hungSettle) Complete(ctx context.Context, _, _ string, _ time.Duration) error {
	<-ctx.Done()
	return ctx.Err()
}

func (hungSettle) Release(ctx context.Context, _, _ string) error {
	<-ctx.Done()
	return ctx.Err()
}

// A completion or release that hangs is bounded by the settle timeout,
// even when the handler's own context has already ended (a shutdown): the
// message is not acked, the error says which call timed out and for which
// key, and the failure is counted and logged.
func TestHungStoreCallIsBoundedAndSaysSo(t *testing.T) {
	idempotency.SetSettleTimeout(t, 50*time.Millisecond)
	var logs strings.Builder // written by the handler's goroutine only
	dedup, err := idempotency.New(hungSettle{idempotency.NewMemoryStore()}, "billing",
		idempotency.WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	if err != nil {
		t.Fatal(err)
	}
	fails := errors.New("handler failed")
	for _, c := range []struct {
		name   string
		result error
	}{{"complete", nil}, {"release", fails}} {
		t.Run(c.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			h := dedup.Wrap(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
				cancel() // the consumer shuts down while the handler runs
				return c.result
			}))
			before := dedup.StoreErrors()
			start := time.Now()
			err := h.Handle(ctx, msg("m", "ev-"+c.name))
			if took := time.Since(start); took > 5*time.Second {
				t.Fatalf("Handle took %v with a hung store, want about the 50ms settle timeout", took)
			}
			if c.result != nil {
				if !errors.Is(err, fails) {
					t.Fatalf("err = %v, want the handler's own error", err)
				}
			} else if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), `complete "billing:ev-complete"`) {
				t.Fatalf("err = %v, want the completion's deadline, naming the call and the key", err)
			}
			if got := dedup.StoreErrors() - before; got != 1 {
				t.Fatalf("StoreErrors grew by %d, want 1", got)
			}
			if !strings.Contains(logs.String(), "ev-"+c.name) || !strings.Contains(logs.String(), "deadline exceeded") {
				t.Fatalf("no WARN line names the key and the deadline:\n%s", logs.String())
			}
		})
	}
}

func TestPanicReleasesTheClaim(t *testing.T) {
	ctx := context.Background()
	store := idempotency.NewMemoryStore()
	var calls atomic.Int32
	h := mustNew(t, store, "billing")(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		if calls.Add(1) == 1 {
			panic("boom")
		}
		return nil
	}))
	func() {
		defer func() {
			if r := recover(); r != "boom" {
				t.Fatalf("recovered %v, want the handler's panic to pass through", r)
			}
		}()
		_ = h.Handle(ctx, msg("m", "ev"))
	}()
	if err := h.Handle(ctx, msg("m", "ev")); err != nil {
		t.Fatalf("redelivery after the panic = %v, want it to run (claim released)", err)
	}
	if calls.Load() != 2 {
		t.Fatalf("handler ran %d times, want 2", calls.Load())
	}
}

func TestCancelledHandlerStillReleases(t *testing.T) {
	store := idempotency.NewMemoryStore()
	ctx, cancel := context.WithCancel(context.Background())
	h := mustNew(t, store, "billing")(consumer.HandlerFunc(func(ctx context.Context, _ *consumer.Message) error {
		cancel() // shutdown while the handler runs
		return ctx.Err()
	}))
	if err := h.Handle(ctx, msg("m", "ev")); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
	cl, err := store.Claim(context.Background(), idempotency.Key("billing", "ev"), time.Minute)
	if err != nil || cl.Status != idempotency.Claimed {
		t.Fatalf("claim after the cancelled run = %v, %v; want claimed (released)", cl.Status, err)
	}
}

func TestBadConfigurationNamesTheField(t *testing.T) {
	s := idempotency.NewMemoryStore()
	cases := []struct {
		field string
		store idempotency.Store
		ns    string
		opt   idempotency.Option
	}{
		{"Store", nil, "x", nil},
		{"Namespace", s, "", nil},
		{"Namespace", s, "a:b", nil},
		{"Key", s, "x", idempotency.WithKey(nil)},
		{"Lease", s, "x", idempotency.WithLease(0)},
		{"Retention", s, "x", idempotency.WithRetention(-time.Second)},
		{"InProgressDelay", s, "x", idempotency.WithInProgressDelay(0)},
		{"Logger", s, "x", idempotency.WithLogger(nil)},
	}
	for _, c := range cases {
		_, err := idempotency.New(c.store, c.ns, c.opt)
		var ce *consumer.ConfigError
		if !errors.As(err, &ce) || ce.Field != c.field || !errors.Is(err, consumer.ErrInvalidConfig) {
			t.Errorf("%s: err = %v, want a ConfigError naming %s", c.field, err, c.field)
		}
		if err != nil && !strings.Contains(err.Error(), c.field) {
			t.Errorf("%s: message %q does not name the field", c.field, err)
		}
	}
}

// refusingStore refuses every key with an error no retry can fix, as a
// database refuses data it cannot store. (The real stores' refusals are
// tested against their real databases in their own packages.)
type refusingStore struct{ downStore }

var errRefused = errors.New("invalid byte sequence")

func (refusingStore) Claim(context.Context, string, time.Duration) (idempotency.Claim, error) {
	return idempotency.Claim{}, consumer.Permanent(errRefused)
}

func TestStoreRefusalIsPermanent(t *testing.T) {
	var n atomic.Int32
	h := mustNew(t, refusingStore{}, "billing")(counting(&n))
	err := h.Handle(context.Background(), msg("m", "ev\xff"))
	if !consumer.IsPermanent(err) || !errors.Is(err, errRefused) {
		t.Fatalf("err = %v, want a permanent error wrapping the store's", err)
	}
	if consumer.DefaultBreakerCounts(err) {
		t.Fatal("a breaker would count the refusal")
	}
	if n.Load() != 0 {
		t.Fatal("handler ran without a claim")
	}
}

// A store that is down fails every claim: the on-call sees it in a WARN
// line naming the key and the error, a few times a minute, not once per
// message.
func TestStoreDownIsLoggedRateLimited(t *testing.T) {
	var buf strings.Builder
	d, err := idempotency.New(downStore{}, "billing", idempotency.WithLogger(slog.New(slog.NewTextHandler(&buf, nil))))
	if err != nil {
		t.Fatal(err)
	}
	var n atomic.Int32
	h := d.Wrap(counting(&n))
	for i := range 1000 {
		_ = h.Handle(context.Background(), msg("m", "ev-"+strconv.Itoa(i)))
	}
	lines := strings.Count(buf.String(), "claiming the key failed")
	if lines < 1 || lines > 5 || !strings.Contains(buf.String(), "connection refused") || !strings.Contains(buf.String(), "level=WARN") {
		t.Fatalf("%d WARN lines for 1000 failed claims, want 1 to 5 naming the error:\n%s", lines, buf.String())
	}
	if d.StoreErrors() != 1000 {
		t.Fatalf("StoreErrors = %d, want every failure counted", d.StoreErrors())
	}
}
