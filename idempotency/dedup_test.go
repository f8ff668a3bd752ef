package idempotency_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
)

// opaqueStore hides the *MemoryStore inside it, so that the middleware
// calls it through the Store interface as it calls every other store.
type opaqueStore struct{ idempotency.Store }

// stores returns the two paths of the middleware: the memory store called
// directly, and a store called through the interface.
func stores() map[string]func() idempotency.Store {
	return map[string]func() idempotency.Store{
		"MemoryStore": func() idempotency.Store { return idempotency.NewMemoryStore() },
		"Interface":   func() idempotency.Store { return opaqueStore{idempotency.NewMemoryStore()} },
	}
}

// Each outcome of a delivery moves its own counter, and only its own.
func TestDedupCountsEachOutcome(t *testing.T) {
	for name, newStore := range stores() {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			store := newStore()
			const lease = 50 * time.Millisecond
			dedup, err := idempotency.New(store, "billing", idempotency.WithLease(lease))
			if err != nil {
				t.Fatal(err)
			}
			h := dedup.Wrap(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
				switch m.Header(idempotency.EventIDHeader) {
				case "fails":
					return errors.New("boom")
				case "slow":
					// Outlive the lease, and let another worker take the key.
					for {
						cl, err := store.Claim(ctx, idempotency.Key("billing", "slow"), time.Minute)
						if err != nil {
							return err
						}
						if cl.Status == idempotency.Claimed {
							return nil
						}
						time.Sleep(5 * time.Millisecond) // poll interval
					}
				}
				return nil
			}))
			if _, err := store.Claim(ctx, idempotency.Key("billing", "held"), time.Hour); err != nil {
				t.Fatal(err)
			}
			deliveries := []struct {
				event string
				ok    func(error) bool
			}{
				{"a", isNil},
				{"a", isNil},                  // duplicate
				{"b", isNil},                  // completed
				{"fails", isErr},              // released
				{"held", consumer.IsDeferred}, // deferred
				{"", consumer.IsPermanent},    // no key (and no message id)
				{"slow", notOwner},            // claim lost
			}
			for _, d := range deliveries {
				if err := h.Handle(ctx, msg("", d.event)); !d.ok(err) {
					t.Fatalf("delivery of %q = %v", d.event, err)
				}
			}
			got := counts(dedup)
			want := map[string]int64{"Completed": 2, "Duplicates": 1, "Deferred": 1, "ClaimsLost": 1, "Released": 1, "StoreErrors": 0, "NoKey": 1}
			for k, v := range want {
				if got[k] != v {
					t.Errorf("%s = %d, want %d (all: %v)", k, got[k], v, got)
				}
			}
		})
	}
}

func isNil(err error) bool    { return err == nil }
func isErr(err error) bool    { return err != nil }
func notOwner(err error) bool { return errors.Is(err, idempotency.ErrNotOwner) }

func counts(d *idempotency.Dedup) map[string]int64 {
	return map[string]int64{
		"Completed": d.Completed(), "Duplicates": d.Duplicates(), "Deferred": d.Deferred(),
		"ClaimsLost": d.ClaimsLost(), "Released": d.Released(), "StoreErrors": d.StoreErrors(), "NoKey": d.NoKey(),
	}
}

func TestDedupCountsStoreErrors(t *testing.T) {
	dedup, err := idempotency.New(downStore{}, "billing")
	if err != nil {
		t.Fatal(err)
	}
	var n atomic.Int32
	if err := dedup.Wrap(counting(&n)).Handle(context.Background(), msg("m", "ev")); !errors.Is(err, errDown) {
		t.Fatalf("err = %v", err)
	}
	fc, err := idempotency.New(failingComplete{idempotency.NewMemoryStore()}, "billing")
	if err != nil {
		t.Fatal(err)
	}
	if err := fc.Wrap(counting(&n)).Handle(context.Background(), msg("m", "ev")); !errors.Is(err, errDown) {
		t.Fatalf("err = %v", err)
	}
	if dedup.StoreErrors() != 1 || fc.StoreErrors() != 1 || fc.Completed() != 0 || fc.ClaimsLost() != 0 {
		t.Fatalf("claim failure: %v; completion failure: %v", counts(dedup), counts(fc))
	}
}

// next is a comparable handler, to check what Unwrap returns.
type next struct{}

func (*next) Handle(context.Context, *consumer.Message) error { return nil }

func TestWrappedHandlerUnwrapsToNext(t *testing.T) {
	dedup, err := idempotency.New(idempotency.NewMemoryStore(), "billing")
	if err != nil {
		t.Fatal(err)
	}
	n := &next{}
	u, ok := dedup.Wrap(n).(interface{ Unwrap() consumer.Handler })
	if !ok {
		t.Fatalf("%T has no Unwrap() consumer.Handler", dedup.Wrap(n))
	}
	if got := u.Unwrap(); got != consumer.Handler(n) {
		t.Fatalf("Unwrap() = %v, want the wrapped handler", got)
	}
}

func TestRegisterMetricsReportsTheCounters(t *testing.T) {
	ctx := context.Background()
	dedup, err := idempotency.New(idempotency.NewMemoryStore(), "billing")
	if err != nil {
		t.Fatal(err)
	}
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(ctx)
	reg, err := dedup.RegisterMetrics(mp, "billing")
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Unregister()
	h := dedup.Wrap(&next{})
	for _, ev := range []string{"a", "a", "a", "b"} {
		if err := h.Handle(ctx, msg("m", ev)); err != nil {
			t.Fatal(err)
		}
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if d, ok := m.Data.(metricdata.Sum[int64]); ok {
				got[m.Name] = d.DataPoints[0].Value
				if v, _ := d.DataPoints[0].Attributes.Value("messaging.consumer.group.name"); v.AsString() != "billing" {
					t.Errorf("%s: consumer name %q, want billing", m.Name, v.AsString())
				}
			}
		}
	}
	want := map[string]int64{idempotency.MetricCompleted: 2, idempotency.MetricDuplicates: 2,
		idempotency.MetricDeferred: 0, idempotency.MetricClaimsLost: 0, idempotency.MetricReleased: 0,
		idempotency.MetricStoreErrors: 0, idempotency.MetricNoKey: 0}
	for k, v := range want {
		if n, ok := got[k]; !ok || n != v {
			t.Errorf("%s = %d (reported %v), want %d", k, n, ok, v)
		}
	}
	var ce *consumer.ConfigError
	if _, err := dedup.RegisterMetrics(nil, "billing"); !errors.As(err, &ce) || ce.Field != "MeterProvider" {
		t.Errorf("RegisterMetrics(nil) = %v, want a ConfigError naming MeterProvider", err)
	}
}
