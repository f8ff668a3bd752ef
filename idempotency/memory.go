package idempotency

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"hash/maphash"
	"math"
	"math/bits"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// MemoryStore is a [Store] in the process's memory: for tests and for a
// single process. Its keys do not survive a restart and are not shared with
// other processes, so it dedups only deliveries that reach this process.
// Expired entries are treated as absent at once but take memory until
// [MemoryStore.Cleanup], which also gives back the memory of a table left
// mostly empty. A key may be any bytes of any length; the store keeps a
// 128-bit hash of it (two independently seeded 64-bit hashes), so each key
// costs the same for its retention however long it is (a 32-byte slot, in
// tables kept at most 70% full: 46 to 92 bytes a key as they grow), and the
// garbage collector has no pointers to follow through the entries.
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

// memShards is how many independently locked tables a namespace spreads its
// keys over, so that workers claiming different keys rarely wait for each
// other.
const memShards = 16

type memTable struct {
	store  *MemoryStore
	shards [memShards]memShard
}

// A shard keeps its keys in an open-addressing table of its own rather than
// a Go map: a claim finds the key's slot, or the empty slot where it goes,
// in one probe sequence and fills it in place, and a completion finds it in
// one more, where a map needs a lookup and an assignment for each. With
// millions of keys every first probe misses the CPU's caches, so the
// lookups saved are most of a claim's cost. Slots are probed linearly from
// a key's home slot (the top bits of its hash); a removal shifts the slots
// behind it back, so the table needs no tombstones.
type memShard struct {
	mu      sync.Mutex
	slots   []memSlot // a power of two long; nil while the shard has no key
	shift   uint      // 64 - log2(len(slots)): a hash's home slot is h.a >> shift
	used    int       // slots taken, expired entries included
	limit   int       // the most slots taken before the table grows
	nextNum uint64    // the next claim number of the block the shard holds
	endNum  uint64    // the end of that block
	toks    string    // the tokens of the block, tokenLen bytes each, once one was asked for
	_       [64]byte
}

// keyHash is what a table keeps of a key: two independently seeded hashes.
// a is never 0 (see memTable.hash), which marks an empty slot. (A struct,
// not an array: Go passes a struct of words in registers and an array of
// two on the stack, which made every claim's result a copy through memory.)
type keyHash struct{ a, b uint64 }

// memSlot is a slot of a shard's table: a key's hash, and its claim (token
// set: the claim's number) or completion (token 0), until expires
// (nanoseconds since the store's epoch). 32 bytes, two to a cache line.
type memSlot struct {
	h       keyHash
	token   uint64
	expires int64
}

// memRef names a claim the memory store handed out: the key's hash and the
// token's number. The middleware keeps it from claim to completion, so that
// completing neither hashes the key again nor parses the token.
type memRef struct {
	h   keyHash
	num uint64
}

// A shard's table grows (doubles) before a claim would fill more than
// memMaxLoadPct percent of it, and shrinks after a cleanup left it under a quarter of
// that. Linear probing stays short at this load: a claim of a new key
// probes about three slots on average, mostly in the cache line of the
// first.
const (
	memMinSlots   = 16
	memMaxLoadPct = 70
)

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

func (s *MemoryStore) newTable() *memTable { return &memTable{store: s} }

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

// hash returns what the table keeps of id. Its first half picks the shard
// (low bits) and the home slot in it (high bits); it is made non-zero, which
// costs nothing measurable in collisions (one value of 2^64 shares a hash
// with another).
func (t *memTable) hash(id string) keyHash {
	h := keyHash{maphash.String(t.store.seeds[0], id), maphash.String(t.store.seeds[1], id)}
	if h.a == 0 {
		h.a = 1
	}
	return h
}

func (t *memTable) shard(h keyHash) *memShard { return &t.shards[h.a%memShards] }

// number returns a fresh claim number, unique in the store and never 0.
// Numbers are reserved from the store in blocks of tokensPerBlock, one
// atomic addition per block. Call with sh.mu held.
func (t *memTable) number(sh *memShard) uint64 {
	if sh.nextNum == sh.endNum {
		sh.endNum = t.store.seq.Add(tokensPerBlock) + 1
		sh.nextNum = sh.endNum - tokensPerBlock
		sh.toks = ""
	}
	sh.nextNum++
	return sh.nextNum - 1
}

// token returns the owner token of num, a number of the block sh holds:
// num in hex. The tokens of a block are made together, one string
// allocation per block, and only when a caller of Claim asks for one: the
// middleware keeps the number and needs no token. Call with sh.mu held.
func (t *memTable) token(sh *memShard, num uint64) string {
	first := sh.endNum - tokensPerBlock
	if sh.toks == "" {
		buf := make([]byte, tokensPerBlock*tokenLen)
		var n [8]byte
		for i := range uint64(tokensPerBlock) {
			binary.BigEndian.PutUint64(n[:], first+i)
			hex.Encode(buf[i*tokenLen:], n[:])
		}
		sh.toks = string(buf)
	}
	i := (num - first) * tokenLen
	return sh.toks[i : i+tokenLen]
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

// expiry returns now+d, held at the end of the range instead of wrapping
// (a lease or retention of math.MaxInt64 means for ever).
func expiry(now int64, d time.Duration) int64 {
	if e := now + int64(d); d < 0 || e >= now {
		return e
	}
	return math.MaxInt64
}

// find returns the index of h's slot and true, or the index of the empty
// slot where h would go and false. Call with sh.mu held and sh.slots
// non-nil.
func (sh *memShard) find(h keyHash) (int, bool) {
	mask := len(sh.slots) - 1
	for i := int(h.a >> sh.shift); ; i = (i + 1) & mask {
		s := &sh.slots[i]
		if s.h == h {
			return i, true
		}
		if s.h.a == 0 {
			return i, false
		}
	}
}

// lookup returns h's slot, or nil. Call with sh.mu held.
func (sh *memShard) lookup(h keyHash) *memSlot {
	if sh.slots == nil {
		return nil
	}
	if i, ok := sh.find(h); ok {
		return &sh.slots[i]
	}
	return nil
}

// resize moves the shard's entries into a table of n slots (a power of two,
// more than sh.used), or drops the table when n is 0. Entries are visited in
// the order of their home slots, which the bigger table keeps, so the moves
// write it front to back.
func (sh *memShard) resize(n int) {
	old := sh.slots
	if n == 0 {
		sh.slots, sh.shift, sh.limit = nil, 0, 0
		return
	}
	sh.slots = make([]memSlot, n)
	sh.shift = uint(64 - bits.TrailingZeros(uint(n)))
	sh.limit = n * memMaxLoadPct / 100
	for _, s := range old {
		if s.h.a != 0 {
			sh.place(s)
		}
	}
}

// place puts s in the first empty slot from its home. Call with room in
// the table.
func (sh *memShard) place(s memSlot) {
	mask := len(sh.slots) - 1
	for i := int(s.h.a >> sh.shift); ; i = (i + 1) & mask {
		if sh.slots[i].h.a == 0 {
			sh.slots[i] = s
			return
		}
	}
}

// remove empties slot i, moving back each slot behind it whose probe
// sequence passes through the hole, so that every key stays reachable from
// its home without tombstones.
func (sh *memShard) remove(i int) {
	mask := len(sh.slots) - 1
	for j := (i + 1) & mask; sh.slots[j].h.a != 0; j = (j + 1) & mask {
		home := int(sh.slots[j].h.a >> sh.shift)
		// The slot at j may move to i unless its home lies in (i, j].
		if (j-home)&mask >= (j-i)&mask {
			sh.slots[i] = sh.slots[j]
			i = j
		}
	}
	sh.slots[i] = memSlot{}
	sh.used--
}

// cleanup removes the entries expired at now and returns how many. It scans
// the table once from an empty slot, so that no run of taken slots is split
// by where the scan starts; behind a removed entry, every entry of the same
// run is placed again from its home, which moves it back or leaves it. A
// table left mostly empty shrinks.
func (sh *memShard) cleanup(now int64) int64 {
	if sh.used == 0 {
		sh.resize(0)
		return 0
	}
	n := len(sh.slots)
	mask := n - 1
	start := 0
	for sh.slots[start].h.a != 0 {
		start++ // the table is never full, so an empty slot exists
	}
	var removed int64
	holes := false // a slot of the current run was emptied
	for k := 1; k <= n; k++ {
		s := &sh.slots[(start+k)&mask]
		switch {
		case s.h.a == 0:
			holes = false
		case now >= s.expires:
			*s = memSlot{}
			sh.used--
			removed++
			holes = true
		case holes:
			e := *s
			*s = memSlot{}
			sh.place(e)
		}
	}
	if want := memSlotsFor(sh.used); sh.used == 0 {
		sh.resize(0)
	} else if want*4 <= n {
		sh.resize(want)
	}
	return removed
}

// memSlotsFor returns the smallest table that holds used entries at no more
// than half the maximal load.
func memSlotsFor(used int) int {
	n := memMinSlots
	for used*200 > n*memMaxLoadPct {
		n *= 2
	}
	return n
}

// claim claims h at now for lease; the Claim has its Token only when
// withToken. Call with sh.mu held.
func (sh *memShard) claim(t *memTable, h keyHash, now int64, lease time.Duration, withToken bool) (Claim, memRef) {
	if sh.used >= sh.limit {
		sh.resize(max(2*len(sh.slots), memMinSlots))
	}
	i, found := sh.find(h)
	s := &sh.slots[i]
	if found && now < s.expires {
		if s.token == 0 {
			return Claim{Status: Done}, memRef{}
		}
		return Claim{Status: InProgress, LeaseLeft: time.Duration(s.expires - now)}, memRef{}
	}
	if !found {
		s.h = h
		sh.used++
	}
	num := t.number(sh)
	s.token, s.expires = num, expiry(now, lease)
	cl := Claim{Status: Claimed}
	if withToken {
		cl.Token = t.token(sh, num)
	}
	return cl, memRef{h: h, num: num}
}

// complete records the claim ref done at now for retention. Call with sh.mu
// held.
func (sh *memShard) complete(ref memRef, now int64, retention time.Duration) error {
	s := sh.lookup(ref.h)
	if s == nil || ref.num == 0 || s.token != ref.num {
		return ErrNotOwner
	}
	s.token, s.expires = 0, expiry(now, retention)
	return nil
}

// release removes the claim ref. Call with sh.mu held.
func (sh *memShard) release(ref memRef) error {
	if sh.slots == nil {
		return ErrNotOwner
	}
	i, found := sh.find(ref.h)
	if !found || ref.num == 0 || sh.slots[i].token != ref.num {
		return ErrNotOwner
	}
	sh.remove(i)
	return nil
}

// The shard's methods do not panic (but for running out of memory, which
// ends the process), so the lock is released without a defer: a defer
// here made a duplicate's claim a third slower.

// claimID claims id for lease; the Claim has its Token only when
// withToken.
func (t *memTable) claimID(id string, lease time.Duration, withToken bool) (Claim, memRef) {
	h := t.hash(id)
	sh := t.shard(h)
	now := t.store.clock()
	sh.mu.Lock()
	cl, ref := sh.claim(t, h, now, lease, withToken)
	sh.mu.Unlock()
	return cl, ref
}

// complete records the claim ref done for retention.
func (t *memTable) complete(ref memRef, retention time.Duration) error {
	sh := t.shard(ref.h)
	now := t.store.clock()
	sh.mu.Lock()
	err := sh.complete(ref, now, retention)
	sh.mu.Unlock()
	return err
}

// release removes the claim ref.
func (t *memTable) release(ref memRef) error {
	sh := t.shard(ref.h)
	sh.mu.Lock()
	err := sh.release(ref)
	sh.mu.Unlock()
	return err
}

// ref returns the reference of the claim on id that token names.
func (t *memTable) ref(id, token string) memRef {
	return memRef{h: t.hash(id), num: tokenNumber(token)}
}

// Claim implements Store.
func (s *MemoryStore) Claim(ctx context.Context, key string, lease time.Duration) (Claim, error) {
	if err := ctx.Err(); err != nil {
		return Claim{}, err
	}
	t, id := s.locate(key)
	cl, _ := t.claimID(id, lease, true)
	return cl, nil
}

// Complete implements Store.
func (s *MemoryStore) Complete(ctx context.Context, key, token string, retention time.Duration) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	t, id := s.locate(key)
	return t.complete(t.ref(id, token), retention)
}

// Release implements Store.
func (s *MemoryStore) Release(ctx context.Context, key, token string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	t, id := s.locate(key)
	return t.release(t.ref(id, token))
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
			n += sh.cleanup(s.clock())
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
			n += sh.used
			sh.mu.Unlock()
		}
	}
	return n
}
