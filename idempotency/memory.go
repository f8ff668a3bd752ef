package idempotency

import (
	"context"
	"sync"
	"time"
)

// MemoryStore is a Store in the process's memory: for tests and for a single
// process. Its keys do not survive a restart and are not shared with other
// processes, so it dedups only deliveries that reach this process. Expired
// entries are treated as absent at once but take memory until Cleanup.
type MemoryStore struct {
	mu   sync.Mutex
	keys map[string]memEntry
	now  func() time.Time
}

type memEntry struct {
	token   string // "" once done
	done    bool
	expires time.Time
}

// NewMemoryStore returns an empty MemoryStore.
func NewMemoryStore() *MemoryStore {
	return &MemoryStore{keys: make(map[string]memEntry), now: time.Now}
}

// Claim implements Store.
func (s *MemoryStore) Claim(ctx context.Context, key string, lease time.Duration) (Claim, error) {
	if err := ctx.Err(); err != nil {
		return Claim{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	if e, ok := s.keys[key]; ok && now.Before(e.expires) {
		if e.done {
			return Claim{Status: Done}, nil
		}
		return Claim{Status: InProgress, LeaseLeft: e.expires.Sub(now)}, nil
	}
	tok := NewToken()
	s.keys[key] = memEntry{token: tok, expires: now.Add(lease)}
	return Claim{Status: Claimed, Token: tok}, nil
}

// Complete implements Store.
func (s *MemoryStore) Complete(ctx context.Context, key, token string, retention time.Duration) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.keys[key]
	if !ok || e.done || token == "" || e.token != token {
		return ErrNotOwner
	}
	s.keys[key] = memEntry{done: true, expires: s.now().Add(retention)}
	return nil
}

// Release implements Store.
func (s *MemoryStore) Release(ctx context.Context, key, token string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.keys[key]
	if !ok || e.done || token == "" || e.token != token {
		return ErrNotOwner
	}
	delete(s.keys, key)
	return nil
}

// Cleanup implements Cleaner.
func (s *MemoryStore) Cleanup(ctx context.Context) (int64, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	var n int64
	for k, e := range s.keys {
		if !now.Before(e.expires) {
			delete(s.keys, k)
			n++
		}
	}
	return n, nil
}

// Len returns how many keys the store holds, expired ones included.
func (s *MemoryStore) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.keys)
}
