package integration_test

import (
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/ferrymq/ferry/internal/testenv"
)

// TestRedisRoundTrip checks SET NX with an expiry, the claim the idempotency
// store is built on: the first claim wins, a second does not, and the claim
// expires.
func TestRedisRoundTrip(t *testing.T) {
	t.Parallel()
	addr := testenv.RequireRedis(t)
	ctx := testenv.Context(t, 10*time.Second)
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	key := testenv.UniqueName(t, "")
	t.Cleanup(func() { c.Del(testenv.Context(t, 5*time.Second), key) })

	if ok, err := c.SetNX(ctx, key, "owner-1", 300*time.Millisecond).Result(); err != nil || !ok {
		t.Fatalf("first claim: %v, %v", ok, err)
	}
	if ok, err := c.SetNX(ctx, key, "owner-2", time.Minute).Result(); err != nil || ok {
		t.Fatalf("second claim of a held key succeeded: %v, %v", ok, err)
	}
	if v, err := c.Get(ctx, key).Result(); err != nil || v != "owner-1" {
		t.Fatalf("get: %q, %v", v, err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		ok, err := c.SetNX(ctx, key, "owner-2", time.Minute).Result()
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the claim did not expire")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestRedisNoPersistence checks that the test Redis keeps nothing on disk.
func TestRedisNoPersistence(t *testing.T) {
	t.Parallel()
	addr := testenv.RequireRedis(t)
	ctx := testenv.Context(t, 10*time.Second)
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	cfg, err := c.ConfigGet(ctx, "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	if cfg["save"] != "" || cfg["appendonly"] != "no" {
		t.Errorf("save = %q, appendonly = %q; want no persistence", cfg["save"], cfg["appendonly"])
	}
}
