// Package redisstore keeps idempotency keys in Redis, over go-redis/v9.
//
// [Store] (from [NewStore]) is an [idempotency.Store] for the idempotency
// middleware ([idempotency.New]). A claim is SET key token NX PX lease: one
// round trip when the key is new. A duplicate costs a second round trip (GET
// and PTTL, pipelined) to tell a completed key from one in progress.
// Complete and Release are Lua scripts that act only when the key still
// holds the caller's owner token, so a slow worker whose lease expired
// cannot touch the claim of the worker that took the key over; each is one
// round trip (EVALSHA). Unlike the SQL stores, a claim whose lease ran out
// is gone even if nobody took the key over (Redis deleted it): its holder's
// Complete then gets [idempotency.ErrNotOwner] and the message runs again.
// Choose a lease longer than the handler runs.
//
// Redis keys are binary safe, so the store keeps the namespaced key as it is,
// after the prefix ([WithPrefix]): any bytes, NUL and invalid UTF-8
// included, readable in redis-cli. A key costs its own length in memory for
// its retention.
//
// Redis expires claims and completions by itself (their TTL is the lease or
// the retention), so the store needs no Cleanup, and Redis no schema or
// migration. Its cost is memory: one key per message handled within the
// retention (15 days by default). Keys outlive a Redis restart only as far
// as its persistence (AOF or RDB) is configured to keep them; without
// persistence a restart forgets every completion, and duplicates delivered
// after it run again.
package redisstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
)

// DefaultPrefix is put before every key unless WithPrefix says otherwise.
const DefaultPrefix = "ferry:idem:"

// doneValue marks a completed key. Owner tokens are hex, so no token equals it.
const doneValue = "!done"

var (
	completeScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[2])
  return 1
end
return 0`)
	releaseScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0`)
)

// Client is what the Store needs from go-redis: *redis.Client,
// *redis.ClusterClient and *redis.Ring all are one.
type Client interface {
	redis.Cmdable
	redis.Scripter
}

// Option configures NewStore. An invalid value makes NewStore fail with a
// *consumer.ConfigError naming the field.
type Option func(*config) error

type config struct {
	prefix string
}

// WithPrefix sets the prefix of every Redis key the store writes (the
// namespaced idempotency key follows it). It must not be empty. Default
// DefaultPrefix ("ferry:idem:").
func WithPrefix(p string) Option {
	return func(c *config) error {
		if p == "" {
			return &consumer.ConfigError{Field: "Prefix", Reason: "must not be empty"}
		}
		c.prefix = p
		return nil
	}
}

// Store is an idempotency.Store in Redis. Build one with NewStore.
type Store struct {
	c      Client
	prefix string
}

var _ idempotency.Store = (*Store)(nil)

// NewStore returns a Store over c.
func NewStore(c Client, opts ...Option) (*Store, error) {
	if c == nil {
		return nil, &consumer.ConfigError{Field: "Client", Reason: "must not be nil"}
	}
	cfg := config{prefix: DefaultPrefix}
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o(&cfg); err != nil {
			return nil, err
		}
	}
	return &Store{c: c, prefix: cfg.prefix}, nil
}

// Claim implements idempotency.Store.
func (s *Store) Claim(ctx context.Context, key string, lease time.Duration) (idempotency.Claim, error) {
	k := s.prefix + key
	for {
		tok := idempotency.NewToken()
		ok, err := s.c.SetNX(ctx, k, tok, lease).Result()
		if err != nil {
			return idempotency.Claim{}, fmt.Errorf("redisstore: claim: %w", err)
		}
		if ok {
			return idempotency.Claim{Status: idempotency.Claimed, Token: tok}, nil
		}
		var get *redis.StringCmd
		var ttl *redis.DurationCmd
		_, err = s.c.Pipelined(ctx, func(p redis.Pipeliner) error {
			get = p.Get(ctx, k)
			ttl = p.PTTL(ctx, k)
			return nil
		})
		v, gerr := get.Result()
		if errors.Is(gerr, redis.Nil) {
			continue // expired or released in between: claim again
		}
		if err != nil {
			return idempotency.Claim{}, fmt.Errorf("redisstore: claim: %w", err)
		}
		if v == doneValue {
			return idempotency.Claim{Status: idempotency.Done}, nil
		}
		return idempotency.Claim{Status: idempotency.InProgress, LeaseLeft: max(ttl.Val(), 0)}, nil
	}
}

// Complete implements idempotency.Store.
func (s *Store) Complete(ctx context.Context, key, token string, retention time.Duration) error {
	return s.settle(ctx, "complete", completeScript, key, token, retention.Milliseconds(), doneValue)
}

// Release implements idempotency.Store.
func (s *Store) Release(ctx context.Context, key, token string) error {
	return s.settle(ctx, "release", releaseScript, key, token)
}

func (s *Store) settle(ctx context.Context, op string, script *redis.Script, key, token string, args ...any) error {
	if token == "" {
		return idempotency.ErrNotOwner
	}
	n, err := script.Run(ctx, s.c, []string{s.prefix + key}, append([]any{token}, args...)...).Int()
	if err != nil {
		return fmt.Errorf("redisstore: %s: %w", op, err)
	}
	if n == 0 {
		return idempotency.ErrNotOwner
	}
	return nil
}
