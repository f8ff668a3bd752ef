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
// [MemoryStore.Cleanup]. A key may be any bytes of any length; the store
// keeps a 128-bit hash of it (two independently seeded 64-bit hashes), so
// each key costs the same few bytes for its retention however long it is,
// and the garbage collector has no pointers to follow through the entries.
// Two keys in a billion share a hash with a probability below 10^-20.
//
// It answers without blocking, so the middleware calls it directly, with no
// deadline and no copy of the namespaced key per message.
type MemoryStore struct {
	epoch time.Time       // expiries are monotonic nanoseconds since epoch
	seeds [2]maphash.Seed // of the two halves of a key's hash
	seq   atomic.Uint64   // owner tokens handed out, in blocks
	mu    sync.RWMutex    // guards tables
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
	mu      sync.Mutex
	keys    map[keyHash]memEntry
	toks    string // a block of unused owner tokens, tokenLen bytes each
	nextTok uint64 // the number of the first token in toks
	_       [64]byte
}

// keyHash is what a table keeps of a key.
type keyHash [2]uint64

// memEntry is a claim (token set: its number) or a completion (token 0),
// until expires (nanoseconds since the store's epoch).
type memEntry struct {
	token   uint64
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
	s := &MemoryStore{epoch: time.Now(), seeds: [2]maphash.Seed{maphash.MakeSeed(), maphash.MakeSeed()}, tabs: make(map[string]*memTable)}
	s.bare = s.newTable()
	return s
}

func (s *MemoryStore) newTable() *memTable {
	t := &memTable{store: s}
	for i := range t.shards {
		t.shards[i].keys = make(map[keyHash]memEntry)
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

// hash returns what the table keeps of id, and the shard it lives in.
func (t *memTable) hash(id string) (keyHash, *memShard) {
	h := keyHash{maphash.String(t.store.seeds[0], id), maphash.String(t.store.seeds[1], id)}
	return h, &t.shards[h[0]%memShards]
}

// token returns a fresh owner token, unique in the store, and its number
// (never 0). Call with sh.mu held.
func (t *memTable) token(sh *memShard) (string, uint64) {
	if sh.toks == "" {
		first := t.store.seq.Add(tokensPerBlock) - tokensPerBlock + 1
		buf := make([]byte, tokensPerBlock*tokenLen)
		var n [8]byte
		for i := range uint64(tokensPerBlock) {
			binary.BigEndian.PutUint64(n[:], first+i)
			hex.Encode(buf[i*tokenLen:], n[:])
		}
		sh.toks = string(buf)
		sh.nextTok = first
	}
	tok, num := sh.toks[:tokenLen], sh.nextTok
	sh.toks = sh.toks[tokenLen:]
	sh.nextTok++
	return tok, num
}

// tokenNumber returns the number of a token this store handed out, or 0.
func tokenNumber(token string) uint64 {
	var n [8]byte
	if len(token) != tokenLen {
		return 0
	}
	if _, err := hex.Decode(n[:], []byte(token)); err != nil {
		return 0
	}
	return binary.BigEndian.Uint64(n[:])
}

func (t *memTable) claim(id string, lease time.Duration) Claim {
	h, sh := t.hash(id)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	now := t.store.clock()
	if e, ok := sh.keys[h]; ok && now < e.expires {
		if e.token == 0 {
			return Claim{Status: Done}
		}
		return Claim{Status: InProgress, LeaseLeft: time.Duration(e.expires - now)}
	}
	tok, num := t.token(sh)
	sh.keys[h] = memEntry{token: num, expires: now + int64(lease)}
	return Claim{Status: Claimed, Token: tok}
}

func (t *memTable) complete(id, token string, retention time.Duration) error {
	num := tokenNumber(token)
	h, sh := t.hash(id)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e, ok := sh.keys[h]
	if !ok || num == 0 || e.token != num {
		return ErrNotOwner
	}
	sh.keys[h] = memEntry{expires: t.store.clock() + int64(retention)}
	return nil
}

func (t *memTable) release(id, token string) error {
	num := tokenNumber(token)
	h, sh := t.hash(id)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e, ok := sh.keys[h]
	if !ok || num == 0 || e.token != num {
		return ErrNotOwner
	}
	delete(sh.keys, h)
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
