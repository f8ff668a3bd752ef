package idempotency

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"hash/maphash"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// MemoryStore is a [Store] in the process's memory: for tests and for a
// single process. Its keys do not survive a restart and are not shared with
// other processes, so it dedups only deliveries that reach this process.
// Expired entries are treated as absent at once but take memory until
// [MemoryStore.Cleanup]. Keys are kept as they are, any bytes and any length;
// each costs its own length in memory for its retention.
//
// It answers without blocking, so the middleware calls it directly, with no
// deadline and no copy of the namespaced key per message.
type MemoryStore struct {
	epoch time.Time     // expiries are monotonic nanoseconds since epoch
	seed  maphash.Seed  // picks a key's shard
	seq   atomic.Uint64 // owner tokens handed out, in blocks
	mu    sync.RWMutex  // guards tables
	tabs  map[string]*memTable
	bare  *memTable // keys without ':', which name no namespace
}

// A key "ns:id" lives in the table of namespace ns under id, so that the
// middleware, which knows ns and id apart, never concatenates them; a key
// without ':' lives in the bare table. The mapping is one to one: a
// namespace never contains ':'.

// memShards is how many independently locked maps a table spreads its keys
// over, so that workers claiming different keys rarely wait for each other.
const memShards = 16

type memTable struct {
	store  *MemoryStore
	shards [memShards]memShard
}

type memShard struct {
	mu   sync.Mutex
	keys map[string]memEntry
	toks string // a block of unused owner tokens, tokenLen bytes each
	_    [64]byte
}

// memEntry is a claim (token set) or a completion (token ""), until expires
// (nanoseconds since the store's epoch).
type memEntry struct {
	token   string
	expires int64
}

// tokenLen is the length of a memory owner token: a sequence number of the
// store, in hex. Tokens are cut from blocks of tokensPerBlock, one string
// allocation per block.
const (
	tokenLen       = 16
	tokensPerBlock = 256
)

// NewMemoryStore returns an empty MemoryStore.
func NewMemoryStore() *MemoryStore {
	s := &MemoryStore{epoch: time.Now(), seed: maphash.MakeSeed(), tabs: make(map[string]*memTable)}
	s.bare = s.newTable()
	return s
}

func (s *MemoryStore) newTable() *memTable {
	t := &memTable{store: s}
	for i := range t.shards {
		t.shards[i].keys = make(map[string]memEntry)
	}
	return t
}

func (s *MemoryStore) clock() int64 { return int64(time.Since(s.epoch)) }

// table returns the table of namespace ns, creating it.
func (s *MemoryStore) table(ns string) *memTable {
	s.mu.RLock()
	t := s.tabs[ns]
	s.mu.RUnlock()
	if t != nil {
		return t
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if t = s.tabs[ns]; t == nil {
		t = s.newTable()
		s.tabs[ns] = t
	}
	return t
}

// locate returns the table and id under which key lives.
func (s *MemoryStore) locate(key string) (*memTable, string) {
	ns, id, ok := strings.Cut(key, ":")
	if !ok {
		return s.bare, key
	}
	return s.table(ns), id
}

func (t *memTable) shard(id string) *memShard {
	return &t.shards[maphash.String(t.store.seed, id)%memShards]
}

// token returns a fresh owner token, unique in the store. Call with sh.mu
// held.
func (t *memTable) token(sh *memShard) string {
	if sh.toks == "" {
		first := t.store.seq.Add(tokensPerBlock) - tokensPerBlock
		buf := make([]byte, tokensPerBlock*tokenLen)
		var n [8]byte
		for i := range uint64(tokensPerBlock) {
			binary.BigEndian.PutUint64(n[:], first+i)
			hex.Encode(buf[i*tokenLen:], n[:])
		}
		sh.toks = string(buf)
	}
	tok := sh.toks[:tokenLen]
	sh.toks = sh.toks[tokenLen:]
	return tok
}

func (t *memTable) claim(id string, lease time.Duration) Claim {
	sh := t.shard(id)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	now := t.store.clock()
	if e, ok := sh.keys[id]; ok && now < e.expires {
		if e.token == "" {
			return Claim{Status: Done}
		}
		return Claim{Status: InProgress, LeaseLeft: time.Duration(e.expires - now)}
	}
	tok := t.token(sh)
	sh.keys[id] = memEntry{token: tok, expires: now + int64(lease)}
	return Claim{Status: Claimed, Token: tok}
}

func (t *memTable) complete(id, token string, retention time.Duration) error {
	sh := t.shard(id)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e, ok := sh.keys[id]
	if !ok || token == "" || e.token != token {
		return ErrNotOwner
	}
	sh.keys[id] = memEntry{expires: t.store.clock() + int64(retention)}
	return nil
}

func (t *memTable) release(id, token string) error {
	sh := t.shard(id)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e, ok := sh.keys[id]
	if !ok || token == "" || e.token != token {
		return ErrNotOwner
	}
	delete(sh.keys, id)
	return nil
}

// Claim implements Store.
func (s *MemoryStore) Claim(ctx context.Context, key string, lease time.Duration) (Claim, error) {
	if err := ctx.Err(); err != nil {
		return Claim{}, err
	}
	t, id := s.locate(key)
	return t.claim(id, lease), nil
}

// Complete implements Store.
func (s *MemoryStore) Complete(ctx context.Context, key, token string, retention time.Duration) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	t, id := s.locate(key)
	return t.complete(id, token, retention)
}

// Release implements Store.
func (s *MemoryStore) Release(ctx context.Context, key, token string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	t, id := s.locate(key)
	return t.release(id, token)
}

// tables returns every table of the store.
func (s *MemoryStore) tables() []*memTable {
	s.mu.RLock()
	defer s.mu.RUnlock()
	ts := make([]*memTable, 0, len(s.tabs)+1)
	ts = append(ts, s.bare)
	for _, t := range s.tabs {
		ts = append(ts, t)
	}
	return ts
}

// Cleanup implements Cleaner.
func (s *MemoryStore) Cleanup(ctx context.Context) (int64, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	var n int64
	for _, t := range s.tables() {
		for i := range t.shards {
			sh := &t.shards[i]
			sh.mu.Lock()
			now := s.clock()
			for k, e := range sh.keys {
				if now >= e.expires {
					delete(sh.keys, k)
					n++
				}
			}
			sh.mu.Unlock()
		}
	}
	return n, nil
}

// Len returns how many keys the store holds, expired ones included.
func (s *MemoryStore) Len() int {
	n := 0
	for _, t := range s.tables() {
		for i := range t.shards {
			sh := &t.shards[i]
			sh.mu.Lock()
			n += len(sh.keys)
			sh.mu.Unlock()
		}
	}
	return n
}
