package idempotency

import (
	"errors"
	"math/rand/v2"
	"testing"
	"time"
)

// These tests drive one shard of the memory store's table directly, with
// hashes chosen to collide, so that the probing, the removal that shifts
// slots back, the cleanup that places runs again and the resizing are each
// exercised at the edges a random hash of real keys rarely reaches: long
// runs of slots, runs that wrap around the end of the table, and holes in
// the middle of a run.

// modelEntry is what the reference model keeps of a key.
type modelEntry struct {
	num     uint64 // 0: done
	expires int64
}

// collidingHash returns a hash whose home slot is one of a few at the
// start and the end of any table (so runs are long and wrap), told apart by
// i.
func collidingHash(i int, r *rand.Rand) keyHash {
	top := []uint64{0, 1, 2, 1<<63 + 1<<62 + 1<<61, ^uint64(0) >> 1 << 1}[r.IntN(5)]
	return keyHash{top | uint64(i)<<1 | 1, uint64(i)}
}

// checkShard verifies that sh holds exactly the model's keys with the
// model's entries, that every key is reachable from its home slot without
// crossing an empty slot, and that its counts are right.
func checkShard(t *testing.T, sh *memShard, model map[keyHash]modelEntry) {
	t.Helper()
	if sh.used != len(model) {
		t.Fatalf("used = %d, model holds %d", sh.used, len(model))
	}
	if len(model) > 0 && (sh.slots == nil || sh.used > sh.limit) {
		t.Fatalf("%d keys in %d slots (limit %d)", sh.used, len(sh.slots), sh.limit)
	}
	taken := 0
	mask := len(sh.slots) - 1
	for i, s := range sh.slots {
		if s.h.a == 0 {
			if s != (memSlot{}) {
				t.Fatalf("slot %d is empty but not zero: %+v", i, s)
			}
			continue
		}
		taken++
		want, ok := model[s.h]
		if !ok {
			t.Fatalf("slot %d holds %x, which the model does not", i, s.h)
		}
		if s.token != want.num || s.expires != want.expires {
			t.Fatalf("slot %d: token %d expires %d, want %d %d", i, s.token, s.expires, want.num, want.expires)
		}
		for j := int(s.h.a >> sh.shift); j != i; j = (j + 1) & mask {
			if sh.slots[j].h.a == 0 {
				t.Fatalf("slot %d (%x) is not reachable from its home %d: slot %d is empty", i, s.h, s.h.a>>sh.shift, j)
			}
		}
	}
	if taken != len(model) {
		t.Fatalf("%d slots taken, model holds %d", taken, len(model))
	}
	for h := range model {
		if sh.lookup(h) == nil {
			t.Fatalf("key %x of the model not found", h)
		}
	}
}

// TestMemoryShardAgreesWithAModel runs random claims, completions,
// releases and cleanups on colliding keys against a map that does the same,
// and checks the table after every step.
func TestMemoryShardAgreesWithAModel(t *testing.T) {
	for seed := range uint64(20) {
		r := rand.New(rand.NewPCG(seed, 1))
		tab := NewMemoryStore().newTable()
		sh := &tab.shards[0]
		model := map[keyHash]modelEntry{}
		var refs []memRef // claims handed out, some stale
		now := int64(1000)
		keys := 8 + r.IntN(200)
		for step := range 3000 {
			h := collidingHash(r.IntN(keys), r)
			switch op := r.IntN(10); {
			case op < 4: // claim
				lease := time.Duration(r.IntN(50))
				cl, ref := sh.claim(tab, h, now, lease, true)
				e, ok := model[h]
				switch {
				case ok && now < e.expires && e.num == 0:
					if cl.Status != Done {
						t.Fatalf("seed %d step %d: claim of a done key = %v", seed, step, cl.Status)
					}
				case ok && now < e.expires:
					if cl.Status != InProgress || cl.LeaseLeft != time.Duration(e.expires-now) {
						t.Fatalf("seed %d step %d: claim of a held key = %+v", seed, step, cl)
					}
				default:
					if cl.Status != Claimed || ref.num == 0 || tokenNumber(cl.Token) != ref.num {
						t.Fatalf("seed %d step %d: claim of a free key = %+v %+v", seed, step, cl, ref)
					}
					model[h] = modelEntry{num: ref.num, expires: now + int64(lease)}
					refs = append(refs, ref)
				}
			case op < 6 && len(refs) > 0: // complete
				ref := refs[r.IntN(len(refs))]
				ret := time.Duration(r.IntN(100))
				err := sh.complete(ref, now, ret)
				if e, ok := model[ref.h]; ok && e.num == ref.num {
					if err != nil {
						t.Fatalf("seed %d step %d: complete by the holder: %v", seed, step, err)
					}
					model[ref.h] = modelEntry{expires: now + int64(ret)}
				} else if !errors.Is(err, ErrNotOwner) {
					t.Fatalf("seed %d step %d: complete by a stale holder = %v, want ErrNotOwner", seed, step, err)
				}
			case op < 8 && len(refs) > 0: // release
				ref := refs[r.IntN(len(refs))]
				err := sh.release(ref)
				if e, ok := model[ref.h]; ok && e.num == ref.num {
					if err != nil {
						t.Fatalf("seed %d step %d: release by the holder: %v", seed, step, err)
					}
					delete(model, ref.h)
				} else if !errors.Is(err, ErrNotOwner) {
					t.Fatalf("seed %d step %d: release by a stale holder = %v, want ErrNotOwner", seed, step, err)
				}
			case op == 8: // cleanup
				want := 0
				for k, e := range model {
					if now >= e.expires {
						delete(model, k)
						want++
					}
				}
				if got := sh.cleanup(now); got != int64(want) {
					t.Fatalf("seed %d step %d: cleanup removed %d, want %d", seed, step, got, want)
				}
			default:
				now += int64(r.IntN(20))
			}
			checkShard(t, sh, model)
		}
	}
}

// A table grows as keys come and shrinks once a cleanup has removed most
// of them, so the memory a burst took is given back; its claims' numbers
// stay unique whether or not a token string was made for them.
func TestMemoryShardGrowsAndShrinks(t *testing.T) {
	tab := NewMemoryStore().newTable()
	sh := &tab.shards[0]
	r := rand.New(rand.NewPCG(1, 2))
	seen := map[uint64]bool{}
	for i := range 10000 {
		h := keyHash{r.Uint64() | 1, uint64(i)}
		// Claims with and without a token string share the shard's
		// blocks of numbers: each token names its own claim's number.
		withToken := i%3 == 0
		cl, ref := sh.claim(tab, h, 0, time.Duration(1+i%2), withToken)
		if cl.Status != Claimed || seen[ref.num] {
			t.Fatalf("claim %d = %v, number %d (seen before: %v)", i, cl.Status, ref.num, seen[ref.num])
		}
		seen[ref.num] = true
		if withToken && tokenNumber(cl.Token) != ref.num || !withToken && cl.Token != "" {
			t.Fatalf("claim %d: token %q for number %d (token asked: %v)", i, cl.Token, ref.num, withToken)
		}
	}
	if n := len(sh.slots); n < 10000*100/memMaxLoadPct || n > 4*10000*100/memMaxLoadPct {
		t.Fatalf("%d slots for 10000 keys", n)
	}
	grown := len(sh.slots)
	if got := sh.cleanup(1); got != 5000 {
		t.Fatalf("cleanup at 1 removed %d, want the 5000 of lease 1", got)
	}
	if got := sh.cleanup(2); got != 5000 || sh.used != 0 {
		t.Fatalf("cleanup at 2 removed %d (left %d), want the other 5000", got, sh.used)
	}
	if sh.slots != nil {
		t.Fatalf("an empty shard keeps %d slots (had %d)", len(sh.slots), grown)
	}
}

// The expiry of a lease or retention too long to add to now is the end of
// time, not a time in the past.
func TestMemoryExpirySaturates(t *testing.T) {
	if got := expiry(5, time.Duration(1<<63-1)); got != 1<<63-1 {
		t.Fatalf("expiry(5, max) = %d", got)
	}
	if got := expiry(5, -3); got != 2 {
		t.Fatalf("expiry(5, -3) = %d", got)
	}
}
