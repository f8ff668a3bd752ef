package redisstore_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/idempotency/redisstore"
	"github.com/ferrymq/ferry/idempotency/storetest"
	"github.com/ferrymq/ferry/internal/testenv"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func newClient(t testing.TB, addr string) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: 24})
	t.Cleanup(func() { c.Close() })
	return c
}

// listEffect is the handler's effect: an entry pushed onto a Redis list per
// run, so that a second run shows as a second entry.
type listEffect struct {
	c   *redis.Client
	key string
}

func (e *listEffect) Apply(ctx context.Context, key string) error {
	return e.c.RPush(ctx, e.key, key).Err()
}

func (e *listEffect) Counts(ctx context.Context) (map[string]int, error) {
	all, err := e.c.LRange(ctx, e.key, 0, -1).Result()
	if err != nil {
		return nil, err
	}
	m := map[string]int{}
	for _, k := range all {
		m[k]++
	}
	return m, nil
}

// cleanPrefix deletes every key under prefix when t ends.
func cleanPrefix(t testing.TB, c *redis.Client, prefix string) {
	t.Cleanup(func() {
		ctx := context.Background()
		iter := c.Scan(ctx, 0, prefix+"*", 1000).Iterator()
		for iter.Next(ctx) {
			c.Del(ctx, iter.Val())
		}
	})
}

func TestStore(t *testing.T) {
	c := newClient(t, testenv.RequireRedis(t))
	storetest.Run(t, storetest.Config{
		NewStore: func(t *testing.T) idempotency.Store {
			prefix := testenv.UniqueName(t, "idem") + ":"
			cleanPrefix(t, c, prefix)
			s, err := redisstore.NewStore(c, redisstore.WithPrefix(prefix))
			if err != nil {
				t.Fatal(err)
			}
			return s
		},
		NewEffect: func(t *testing.T) storetest.Effect {
			key := testenv.UniqueName(t, "effect")
			t.Cleanup(func() { c.Del(context.Background(), key) })
			return &listEffect{c: c, key: key}
		},
	})
}

func TestUnreachableRedisIsNotAckedAndHandlerNotCalled(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: 1, DialTimeout: 5 * time.Second})
	t.Cleanup(func() { c.Close() })
	s, err := redisstore.NewStore(c)
	if err != nil {
		t.Fatal(err)
	}
	dedup, err := idempotency.New(s, "billing")
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int32
	h := dedup.Wrap(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { calls.Add(1); return nil }))
	err = h.Handle(context.Background(), storetest.Message("ev", 1))
	var ra *consumer.RetryAfterError
	if err == nil || consumer.IsPermanent(err) || errors.As(err, &ra) || consumer.IsDeferred(err) {
		t.Fatalf("middleware = %v, want a plain error (not acked, redelivered)", err)
	}
	if n := calls.Load(); n != 0 {
		t.Fatalf("handler ran %d times without a reachable store", n)
	}
}

func TestUnreachableRedisThroughDeliveryLoop(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: 5 * time.Second})
	t.Cleanup(func() { c.Close() })
	s, err := redisstore.NewStore(c)
	if err != nil {
		t.Fatal(err)
	}
	storetest.StoreDown(t, s)
}

func TestCompletedKeyExpiresWithRetentionTTL(t *testing.T) {
	c := newClient(t, testenv.RequireRedis(t))
	ctx := context.Background()
	prefix := testenv.UniqueName(t, "idem") + ":"
	cleanPrefix(t, c, prefix)
	s, err := redisstore.NewStore(c, redisstore.WithPrefix(prefix))
	if err != nil {
		t.Fatal(err)
	}
	cl, err := s.Claim(ctx, "k", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Complete(ctx, "k", cl.Token, 48*time.Hour); err != nil {
		t.Fatal(err)
	}
	ttl, err := c.PTTL(ctx, prefix+"k").Result()
	if err != nil || ttl <= 47*time.Hour || ttl > 48*time.Hour {
		t.Fatalf("TTL of a completed key = %s, %v; want the 48h retention", ttl, err)
	}
}

func TestBadConfigurationNamesTheField(t *testing.T) {
	var ce *consumer.ConfigError
	if _, err := redisstore.NewStore(nil); !errors.As(err, &ce) || ce.Field != "Client" {
		t.Errorf("NewStore(nil) = %v, want a ConfigError naming Client", err)
	}
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer c.Close()
	if _, err := redisstore.NewStore(c, redisstore.WithPrefix("")); !errors.As(err, &ce) || ce.Field != "Prefix" {
		t.Errorf("WithPrefix(\"\") = %v, want a ConfigError naming Prefix", err)
	}
}
