package idempotency_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
)

func TestCleanEveryRemovesExpiredKeysUntilCancelled(t *testing.T) {
	s := idempotency.NewMemoryStore()
	ctx := context.Background()
	cl, err := s.Claim(ctx, "done", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Complete(ctx, "done", cl.Token, time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Claim(ctx, "live", time.Hour); err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	var runErr error
	wg.Go(func() { runErr = idempotency.CleanEvery(cctx, s, 5*time.Millisecond, nil) })
	deadline := time.Now().Add(30 * time.Second)
	for s.Len() != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("store still holds %d keys, want 1 (the live claim)", s.Len())
		}
		time.Sleep(5 * time.Millisecond) // poll interval
	}
	cancel()
	wg.Wait()
	if !errors.Is(runErr, context.Canceled) {
		t.Fatalf("CleanEvery returned %v, want context.Canceled", runErr)
	}
	if cl, _ := s.Claim(ctx, "live", time.Hour); cl.Status != idempotency.InProgress {
		t.Fatalf("live claim = %v after cleanup, want in-progress", cl.Status)
	}
}

func TestCleanEveryRejectsBadArguments(t *testing.T) {
	var ce *consumer.ConfigError
	if err := idempotency.CleanEvery(context.Background(), nil, time.Second, nil); !errors.As(err, &ce) || ce.Field != "Cleaner" {
		t.Errorf("nil cleaner = %v", err)
	}
	if err := idempotency.CleanEvery(context.Background(), idempotency.NewMemoryStore(), 0, nil); !errors.As(err, &ce) || ce.Field != "Interval" {
		t.Errorf("zero interval = %v", err)
	}
}
