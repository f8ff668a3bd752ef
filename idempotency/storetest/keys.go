package storetest

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/memory"
)

// OddKeys are keys that a store keeping keys as text would refuse, change or
// confuse: invalid UTF-8, NUL bytes, U+FFFD (what invalid bytes become when
// a driver "repairs" them), and a key longer than a database index entry may
// be. Kafka keys, and event ids taken from them, are arbitrary bytes, and
// every store must keep each of these apart from the others. The exactly-once
// tests (ExactlyOnce) prefix one key in ten with one of them.
var OddKeys = []string{
	"bad\xffkey",
	"bad\xfekey",
	"bad\uFFFDkey",
	"nul\x00key",
	"nul\x00\x00key",
	"\x00",
	"\xff",
	"\xc3\x28",                         // an invalid two-byte sequence
	strings.Repeat("long-key/", 8<<10), // 72 KiB
}

// testAnyKeyBytes claims, completes and releases keys of any bytes, and
// checks that keys which differ only in their odd bytes stay apart.
func testAnyKeyBytes(t *testing.T, c Config) {
	s := c.NewStore(t)
	ctx := ctxFor(t)
	claims := make([]idempotency.Claim, len(OddKeys))
	for i, k := range OddKeys {
		claims[i] = mustClaim(t, s, k, time.Minute, idempotency.Claimed)
	}
	for i, k := range OddKeys {
		mustClaim(t, s, k, time.Minute, idempotency.InProgress)
		if i%2 == 0 {
			if err := s.Complete(ctx, k, claims[i].Token, time.Hour); err != nil {
				t.Fatalf("Complete(%q): %v", k, err)
			}
		} else if err := s.Release(ctx, k, claims[i].Token); err != nil {
			t.Fatalf("Release(%q): %v", k, err)
		}
	}
	for i, k := range OddKeys {
		if i%2 == 0 {
			mustClaim(t, s, k, time.Minute, idempotency.Done)
		} else {
			mustClaim(t, s, k, time.Minute, idempotency.Claimed)
		}
	}
	// And through the middleware: one event with an odd id, three copies.
	e := c.NewEffect(t)
	dedup, err := idempotency.New(s, "odd")
	if err != nil {
		t.Fatal(err)
	}
	h := dedup.Wrap(effectHandler(e))
	for copy := range 3 {
		if err := h.Handle(ctx, Message("ev\xff\x00", copy)); err != nil {
			t.Fatalf("delivery %d of an event whose id has \\xff and \\x00: %v", copy, err)
		}
	}
	assertCounts(t, e, map[string]int{"ev\xff\x00": 1})
}

// testOddKeyThroughLoop runs the middleware over the store in a real
// delivery loop (see throughStack). The first message has an odd key; the
// others are plain. Every message must be handled once, quickly, with the
// breaker never opened and nothing dead-lettered: one odd key must not stall
// everything else.
func testOddKeyThroughLoop(t *testing.T, c Config) {
	s := c.NewStore(t)
	dedup, err := idempotency.New(s, "orders-consumer")
	if err != nil {
		t.Fatal(err)
	}
	e := NewMemoryEffect()
	msgs := withPlain(*Message("bad\xff\x00key", 1))
	stack := throughStack(t, dedup.Wrap(effectHandler(e)), msgs)
	if n := stack.DeadLetter.Count(); n != 0 {
		t.Errorf("%d message(s) dead-lettered", n)
	}
	want := map[string]int{}
	for _, m := range msgs {
		want[m.Header(idempotency.EventIDHeader)] = 1
	}
	assertCounts(t, e, want)
}

// PermanentThroughDeliveryLoop checks that h, a handler (a middleware over a
// store, or an inbox) that fails with a permanent error on the event
// refused, does not stall the others: in a real delivery loop on the memory
// broker (see throughStack), the refused message is dead-lettered once, the
// breaker never opens, and every other message is acked at once.
func PermanentThroughDeliveryLoop(t *testing.T, h consumer.Handler, refused string) {
	t.Helper()
	stack := throughStack(t, h, withPlain(*Message(refused, 1)))
	if n := stack.DeadLetter.Count(); n != 1 {
		t.Errorf("%d message(s) dead-lettered, want 1 (the refused one)", n)
	}
}

// withPlain returns first followed by plainMessages plain messages.
func withPlain(first consumer.Message) []consumer.Message {
	msgs := []consumer.Message{first}
	for i := range plainMessages {
		msgs = append(msgs, *Message("ev-"+strconv.Itoa(i), 1))
	}
	return msgs
}

const plainMessages = 40

// stallBound is how soon every message must be acked: well short of the
// minute the breaker of throughStack stays open.
const stallBound = 20 * time.Second

// throughStack publishes msgs to a memory broker and runs h under the
// Standard stack (a breaker that opens on the first failure it counts and
// stays open a minute, one run per delivery) in a real delivery loop, until
// every message is acked or stallBound passed. It fails t if the breaker
// opened or a message was not acked in time, and returns the stack.
func throughStack(t *testing.T, h consumer.Handler, msgs []consumer.Message) *consumer.Stack {
	t.Helper()
	b, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	ctx := ctxFor(t)
	if err := b.Publish(ctx, "orders", msgs...); err != nil {
		t.Fatal(err)
	}
	stack, err := consumer.Standard(b, "orders-dlq",
		consumer.StandardBreaker(consumer.BreakerFailures(1), consumer.BreakerOpenFor(time.Minute)),
		consumer.StandardRetry(consumer.RetryAttempts(1)))
	if err != nil {
		t.Fatal(err)
	}
	loop, err := b.NewConsumer(ctx, "orders", consumer.WithConcurrency(4),
		consumer.WithRedeliveryBackoff(time.Millisecond, 10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- loop.Run(rctx, stack.Wrap(h)) }()
	deadline := time.Now().Add(stallBound)
	for b.Stats("orders").Acked < int64(len(msgs)) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond) // poll interval
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if n := stack.Breaker.Opened(); n != 0 {
		t.Errorf("the breaker opened %d time(s)", n)
	}
	if st := b.Stats("orders"); st.Acked != int64(len(msgs)) {
		t.Fatalf("acked %d of %d within %s: %+v", st.Acked, len(msgs), stallBound, st)
	}
	return stack
}
