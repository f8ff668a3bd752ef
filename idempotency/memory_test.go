package idempotency_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/idempotency/storetest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestMemoryStore(t *testing.T) {
	storetest.Run(t, storetest.Config{
		NewStore: func(*testing.T) idempotency.Store { return idempotency.NewMemoryStore() },
	})
}

// The memory store files "ns:id" under its namespace; keys with no ':', or
// with an empty part, must stay apart from each other all the same.
func TestMemoryStoreKeepsKeysApartWhateverTheirColons(t *testing.T) {
	s := idempotency.NewMemoryStore()
	ctx := context.Background()
	keys := []string{"x", ":x", "x:", "x::", ":", "::", "", "a:b:c", "a:b", "a::b", "b:a"}
	for _, k := range keys {
		cl, err := s.Claim(ctx, k, time.Minute)
		if err != nil || cl.Status != idempotency.Claimed {
			t.Fatalf("Claim(%q) = %v, %v; want claimed (a key of its own)", k, cl.Status, err)
		}
		if err := s.Complete(ctx, k, cl.Token, time.Hour); err != nil {
			t.Fatalf("Complete(%q): %v", k, err)
		}
	}
	for _, k := range keys {
		if cl, err := s.Claim(ctx, k, time.Minute); err != nil || cl.Status != idempotency.Done {
			t.Fatalf("Claim(%q) again = %v, %v; want done", k, cl.Status, err)
		}
	}
	if n := s.Len(); n != len(keys) {
		t.Fatalf("Len = %d, want %d", n, len(keys))
	}
}

// Owner tokens are never reused, across keys and namespaces, so a stale
// token can never complete someone else's claim.
func TestMemoryStoreTokensAreUnique(t *testing.T) {
	s := idempotency.NewMemoryStore()
	ctx := context.Background()
	seen := map[string]bool{}
	for i := range 5000 {
		k := fmt.Sprintf("ns%d:k", i%7)
		cl, err := s.Claim(ctx, k, time.Minute)
		if err != nil || cl.Status != idempotency.Claimed {
			t.Fatalf("Claim(%q) = %v, %v", k, cl.Status, err)
		}
		if seen[cl.Token] {
			t.Fatalf("token %q handed out twice", cl.Token)
		}
		seen[cl.Token] = true
		if err := s.Release(ctx, k, cl.Token); err != nil {
			t.Fatal(err)
		}
	}
}
