package consumertest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
)

// errFail is what the suite's handlers return when a test wants a failure.
var errFail = errors.New("consumertest: handler failed on purpose")

// Run runs the conformance suite against the broker behind h, one subtest
// per clause of the contract, each on a fresh source, one after another.
// Select clauses with go test -run 'TestX/Clause'. Subtests that need a
// capability the harness does not report are skipped, saying which.
func Run(t *testing.T, h Harness) {
	t.Helper()
	if h == nil {
		t.Fatal("consumertest: nil Harness")
	}
	caps := h.Capabilities()
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) { tc.fn(newSuite(t, h, caps)) })
	}
}

// tests are the suite's clauses, named like the contract they check.
var tests = []struct {
	name string
	fn   func(*suite)
}{
	{"EveryMessageDeliveredOnceWhenHandlersSucceed", testDeliveredOnce},
	{"HandlerErrorRedeliversWithNextAttempt", testErrorRedelivers},
	{"RetryAfterNotRedeliveredBeforeDelay", testRetryAfter},
	{"AtMostOnceNeverRedelivers", testAtMostOnce},
	{"OrderedSourceKeepsKeyOrderWithConcurrency", func(s *suite) { testKeyOrder(s, consumer.OrderByLane) }},
	{"OrderByKeyKeepsKeyOrderWithConcurrency", func(s *suite) { testKeyOrder(s, consumer.OrderByKey) }},
	{"MaxInFlightBoundsRunningAndUnackedMessages", testMaxInFlight},
	{"LongHandlerKeepsItsLease", testLease},
	{"CancelMidHandlerLosesNothing", testCancelMidHandler},
	{"ShutdownLetsRunningHandlerFinishAndAcks", testShutdownDrains},
	{"PanicIsRedeliveredAndRunGoesOn", testPanic},
	{"BodyKeyAndHeadersRoundTrip", testRoundTrip},
	{"TwoConsumersNeverHoldTheSameMessage", testTwoConsumers},
	{"RunReturnsPromptlyAfterCancel", testPromptReturn},
	{"NilHandlerIsAnError", testNilHandler},
	{"HoldDoesNotCountAsAnAttempt", testHold},
	{"AsReachesTheBrokersDelivery", testAs},
	{"GracefulShutdownHandsNothingBack", testShutdownHandsNothingBack},
	{"PoisonAmongTransientFailuresNeverOpensTheBreaker", testPoisonMix},
	{"NotBeforeHoldsAMessageOrIsRefused", testNotBefore},
}

// testAs: a handler reaches the broker's own representation of its delivery
// through Message.As, and As refuses a type it does not know.
func testAs(s *suite) {
	src := s.source(SourceConfig{})
	var asErr errBox
	var rec recorder
	s.start("consumer", src, grace, rec.handler("consumer", func(ctx context.Context, m *consumer.Message) error {
		var unknown struct{ consumertest int }
		switch {
		case m.As(&unknown):
			asErr.set(fmt.Errorf("Message.As set a %T, a type no broker knows", &unknown))
		case m.As(nil):
			asErr.set(errors.New("Message.As(nil) reported true"))
		default:
			asErr.set(s.h.AsCheck(m))
		}
		return nil
	}))
	s.publish(src, message("as"))
	s.waitFor("the message to be handled", func() bool { return len(rec.of("as")) == 1 })
	if err := asErr.get(); err != nil {
		s.t.Fatal(err)
	}
}

// testShutdownHandsNothingBack: a consumer that has fetched more than it has
// run, stopped gracefully, runs what it fetched before Run returns instead
// of handing it back: a second consumer handles only what the first never
// fetched, each message once, on its first delivery (every message handed
// back would count a delivery, and cost the message one of its retries).
func testShutdownHandsNothingBack(s *suite) {
	const n = 20
	src := s.source(SourceConfig{})
	s.publish(src, messages("fetched", n)...)
	var rec recorder
	first := s.start("first", src, 20*time.Second, rec.handler("first", func(ctx context.Context, m *consumer.Message) error {
		return sleepCtx(ctx, 20*time.Millisecond)
	}), consumer.WithConcurrency(1), consumer.WithMaxInFlight(n))
	s.waitFor("the first handler to run", func() bool { return rec.total() >= 1 })
	first.stop()
	s.start("second", src, grace, rec.handler("second", nil))
	s.waitFor(fmt.Sprintf("all %d messages to be handled", n), func() bool { return rec.distinct() == n })
	s.watch(s.settleWindow(), func() error {
		for i := 0; i < n; i++ {
			id := "fetched-" + strconv.Itoa(i)
			ds := rec.of(id)
			if len(ds) > 1 {
				return fmt.Errorf("%s was handled %d times (by %s, then %s): the first consumer handed back what it had fetched", id, len(ds), ds[0].consumer, ds[1].consumer)
			}
			if len(ds) == 1 && (ds[0].attempt != 1 || ds[0].deliveries != 1) {
				return fmt.Errorf("%s was handled by %s on attempt %d, delivery %d: want its first", id, ds[0].consumer, ds[0].attempt, ds[0].deliveries)
			}
		}
		return nil
	})
}

// testDeliveredOnce: with handlers that succeed, every published message is
// handled, once, on its first attempt.
func testDeliveredOnce(s *suite) {
	const n = 100
	src := s.source(SourceConfig{})
	// Half before the consumer starts (a backlog), half while it runs.
	msgs := messages("once", n)
	s.publish(src, msgs[:n/2]...)
	var rec recorder
	s.start("consumer", src, grace, rec.handler("consumer", nil))
	s.publish(src, msgs[n/2:]...)

	s.waitFor(fmt.Sprintf("all %d messages to be handled", n), func() bool { return rec.distinct() == n })
	s.watch(quiet, func() error {
		if dups := rec.duplicates(); len(dups) > 0 {
			return fmt.Errorf("%d message(s) handled more than once although every handler succeeded: %v", len(dups), firstN(dups, 5))
		}
		return nil
	})
	for _, m := range msgs {
		id := m.Header(idHeader)
		switch d := rec.of(id); {
		case len(d) != 1:
			s.t.Errorf("message %s: got %d deliveries, want 1", id, len(d))
		case d[0].attempt != 1:
			s.t.Errorf("message %s: Attempt = %d on its only delivery, want 1", id, d[0].attempt)
		}
	}
}

// testErrorRedelivers: a message whose handler failed comes back, with the
// same id and body and the attempt one higher, until its handler succeeds;
// then it stays acknowledged.
func testErrorRedelivers(s *suite) {
	src := s.source(SourceConfig{})
	var rec recorder
	const okOn = 3
	s.start("consumer", src, grace, rec.handler("consumer", func(ctx context.Context, m *consumer.Message) error {
		if len(rec.of(m.Header(idHeader))) < okOn {
			return errFail
		}
		return nil
	}), consumer.WithRedeliveryBackoff(10*time.Millisecond, 100*time.Millisecond))
	s.publish(src, message("retry"))

	s.waitFor("the message to be delivered three times", func() bool { return len(rec.of("retry")) >= okOn })
	s.watch(s.settleWindow(), func() error {
		if n := len(rec.of("retry")); n > okOn {
			return fmt.Errorf("message delivered %d times; want %d: it came back after its handler succeeded", n, okOn)
		}
		return nil
	})
	ds := rec.of("retry")
	for i, d := range ds {
		if d.attempt != i+1 {
			s.t.Errorf("delivery %d: Attempt = %d, want %d", i+1, d.attempt, i+1)
		}
		if d.msgID != ds[0].msgID {
			s.t.Errorf("delivery %d: ID = %q, want %q: the ID must be stable across redeliveries", i+1, d.msgID, ds[0].msgID)
		}
		if string(d.body) != "retry" {
			s.t.Errorf("delivery %d: Body = %q, want %q", i+1, d.body, "retry")
		}
	}
}

// retryDelay is the delay the RetryAfter test asks for: whole seconds, the
// granularity of SQS visibility.
const retryDelay = 2 * time.Second

// retryTolerance absorbs clock granularity when the suite compares its own
// clock with a remote broker's timers. The delay is measured from the
// handler's return, before the loop settled, so a correct broker never
// needs it.
const retryTolerance = 10 * time.Millisecond

// testRetryAfter: a message returned with RetryAfter(err, d) is not
// delivered again before d has passed since its handler returned, and then
// comes back with the next attempt.
func testRetryAfter(s *suite) {
	src := s.source(SourceConfig{})
	var rec recorder
	var mu sync.Mutex
	returned := make(map[string]time.Time) // when attempt 1's handler returned
	s.start("consumer", src, grace, rec.handler("consumer", func(ctx context.Context, m *consumer.Message) error {
		id := m.Header(idHeader)
		if len(rec.of(id)) > 1 {
			return nil
		}
		mu.Lock()
		defer mu.Unlock()
		returned[id] = time.Now()
		return consumer.RetryAfter(errFail, retryDelay)
	}))
	msgs := messages("later", 3)
	s.publish(src, msgs...)

	for _, m := range msgs {
		id := m.Header(idHeader)
		s.waitUpTo(retryDelay+patience, "message "+id+" to come back after RetryAfter", func() bool { return len(rec.of(id)) >= 2 })
		ds := rec.of(id)
		mu.Lock()
		gap := ds[1].start.Sub(returned[id])
		mu.Unlock()
		if gap < retryDelay-retryTolerance {
			s.t.Errorf("message %s came back %s after its handler returned RetryAfter(err, %s): too early", id, gap, retryDelay)
		}
		if ds[1].attempt != ds[0].attempt+1 {
			s.t.Errorf("message %s: Attempt after RetryAfter = %d, want %d", id, ds[1].attempt, ds[0].attempt+1)
		}
		if ds[1].msgID != ds[0].msgID {
			s.t.Errorf("message %s: ID after RetryAfter = %q, want %q", id, ds[1].msgID, ds[0].msgID)
		}
	}
}

// testAtMostOnce: in at-most-once mode every message is delivered once and
// never again, even when its handler fails or panics.
func testAtMostOnce(s *suite) {
	const n = 12
	src, settle := s.leasedSource(false)
	var rec recorder
	s.start("consumer", src, grace, rec.handler("consumer", func(ctx context.Context, m *consumer.Message) error {
		i, _ := strconv.Atoi(strings.TrimPrefix(m.Header(idHeader), "amo-"))
		switch i % 3 {
		case 0:
			return nil
		case 1:
			return errFail
		default:
			panic("consumertest: panic on purpose in at-most-once mode")
		}
	}), consumer.WithDeliveryMode(consumer.AtMostOnce), consumer.WithRedeliveryBackoff(0, 0))
	s.publish(src, messages("amo", n)...)

	s.waitFor(fmt.Sprintf("all %d messages to be handled", n), func() bool { return rec.distinct() == n })
	s.watch(settle, func() error {
		if dups := rec.duplicates(); len(dups) > 0 {
			return fmt.Errorf("at-most-once redelivered %d message(s): %v", len(dups), firstN(dups, 5))
		}
		return nil
	})
}

// testKeyOrder: on an ordered source, with several handlers at once, each
// key's messages are handled one at a time, in the order they were
// published.
func testKeyOrder(s *suite, o consumer.Ordering) {
	if !s.caps.Ordered {
		s.t.Skip("harness reports no ordered sources (Capabilities.Ordered is false)")
	}
	const keys, perKey = 5, 20
	src := s.source(SourceConfig{Ordered: true})

	var mu sync.Mutex
	done := make(map[string][]int)     // key -> sequence numbers in completion order
	running := make(map[string]bool)   // key -> a handler of it is running
	var overlaps []string              // keys seen running twice at once
	var all gauge                      // handlers running at once, any key
	rng := rand.New(rand.NewPCG(1, 2)) // guarded by mu
	h := func(ctx context.Context, m *consumer.Message) error {
		key := m.Key
		seq, err := strconv.Atoi(string(m.Body))
		if err != nil {
			return consumer.Permanent(fmt.Errorf("body %q: %w", m.Body, err))
		}
		all.inc()
		defer all.dec()
		mu.Lock()
		if running[key] {
			overlaps = append(overlaps, key+"#"+string(m.Body))
		}
		running[key] = true
		pause := time.Duration(rng.IntN(3)) * time.Millisecond
		mu.Unlock()

		_ = sleepCtx(ctx, pause) // shake the timing so that keys interleave

		mu.Lock()
		running[key] = false
		done[key] = append(done[key], seq)
		mu.Unlock()
		return nil
	}
	s.start("consumer", src, grace, h, consumer.WithConcurrency(4), consumer.WithOrdering(o))

	// Keys interleaved, each key's sequence ascending.
	var msgs []consumer.Message
	for i := range perKey {
		for k := range keys {
			m := message(fmt.Sprintf("k%d-%d", k, i))
			m.Key = "key-" + strconv.Itoa(k)
			m.Body = []byte(strconv.Itoa(i))
			msgs = append(msgs, m)
		}
	}
	s.publish(src, msgs...)

	count := func() int {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, seqs := range done {
			n += len(seqs)
		}
		return n
	}
	s.waitFor(fmt.Sprintf("all %d messages to be handled", keys*perKey), func() bool { return count() >= keys*perKey })

	mu.Lock()
	defer mu.Unlock()
	if len(overlaps) > 0 {
		s.t.Errorf("%d message(s) ran while an earlier message of the same key was still running: %v", len(overlaps), firstN(overlaps, 5))
	}
	want := make([]int, perKey)
	for i := range want {
		want[i] = i
	}
	for k := range keys {
		key := "key-" + strconv.Itoa(k)
		if got := done[key]; !slices.Equal(got, want) {
			s.t.Errorf("key %s completed in the order %v, want %v", key, got, want)
		}
	}
	s.t.Logf("ordering %s: at most %d handlers ran at once", o, all.peak.Load())
}

// testMaxInFlight: a consumer never runs more handlers than its concurrency,
// and never holds more unacknowledged messages than its maximum in flight:
// where the broker lets a second consumer take what the first did not, the
// second one gets all but at most that many.
func testMaxInFlight(s *suite) {
	const (
		n           = 20
		concurrency = 2
		maxInFlight = 4
	)
	src := s.source(SourceConfig{})
	release := make(chan struct{})
	var releaseOnce sync.Once
	unblock := func() { releaseOnce.Do(func() { close(release) }) }
	s.t.Cleanup(unblock)

	var rec recorder
	var running gauge
	s.start("first", src, grace, rec.handler("first", func(ctx context.Context, m *consumer.Message) error {
		running.inc()
		defer running.dec()
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}), consumer.WithConcurrency(concurrency), consumer.WithMaxInFlight(maxInFlight), consumer.WithOrdering(consumer.Unordered))
	s.publish(src, messages("inflight", n)...)

	s.waitFor(fmt.Sprintf("%d handlers to be running", concurrency), func() bool { return running.now.Load() >= concurrency })
	counter, _ := s.h.(InFlightCounter)
	s.watch(quiet, func() error {
		if p := running.peak.Load(); p > concurrency {
			return fmt.Errorf("%d handlers ran at once, want at most the concurrency %d", p, concurrency)
		}
		if counter != nil {
			if n := counter.InFlight(s.t, src); n > maxInFlight {
				return fmt.Errorf("the broker counts %d messages delivered and not settled, want at most the MaxInFlight %d", n, maxInFlight)
			}
		}
		return nil
	})

	if s.caps.Redelivers {
		// The first consumer holds at most maxInFlight of the n messages;
		// a second consumer must be able to take all the others.
		s.start("second", src, grace, rec.handler("second", nil))
		s.waitFor(fmt.Sprintf("the second consumer to take the %d messages the first may not hold (MaxInFlight %d)", n-maxInFlight, maxInFlight),
			func() bool { return rec.distinctBy("second") >= n-maxInFlight })
	}
	unblock()
	s.waitFor(fmt.Sprintf("all %d messages to be handled", n), func() bool { return rec.distinct() == n })

	if p := running.peak.Load(); p > concurrency {
		s.t.Errorf("%d handlers ran at once, want at most the concurrency %d", p, concurrency)
	}
	if s.caps.Redelivers {
		if got := rec.distinctBy("first"); got > maxInFlight {
			s.t.Errorf("the first consumer handled %d messages while blocked, want at most its MaxInFlight %d", got, maxInFlight)
		}
	}
}

// testLease: a handler that runs three times the source's lease keeps its
// message: a second consumer polling the same source never gets it, and the
// message is handled exactly once.
func testLease(s *suite) {
	lease := s.caps.Lease
	if lease <= 0 {
		s.t.Skip("harness reports no lease (Capabilities.Lease is 0)")
	}
	src, settle := s.leasedSource(false)
	var rec recorder
	var ctxErr errBox
	long := func(ctx context.Context, m *consumer.Message) error {
		return ctxErr.set(sleepCtx(ctx, 3*lease))
	}
	s.start("first", src, grace, rec.handler("first", long))
	s.publish(src, message("long"))
	s.waitFor("the first consumer to start the long handler", func() bool { return len(rec.of("long")) == 1 })
	s.start("second", src, grace, rec.handler("second", long))

	s.waitUpTo(3*lease+patience, "the long handler to finish", func() bool {
		ds := rec.of("long")
		return len(ds) > 0 && !ds[0].end.IsZero()
	})
	s.watch(settle, func() error {
		if ds := rec.of("long"); len(ds) > 1 {
			return fmt.Errorf("message handled %d times (the second by %q on attempt %d); a handler running 3× the lease %s must keep it", len(ds), ds[1].consumer, ds[1].attempt, lease)
		}
		return nil
	})
	if err := ctxErr.get(); err != nil {
		s.t.Errorf("the long handler's context ended early: %v", err)
	}
}

// testCancelMidHandler: cancelling Run while a handler runs past the
// shutdown grace loses nothing: Run returns, and the message is delivered
// again to the next consumer.
func testCancelMidHandler(s *suite) {
	src, _ := s.leasedSource(false)
	const g = 100 * time.Millisecond
	var rec recorder
	first := s.start("first", src, g, rec.handler("first", func(ctx context.Context, m *consumer.Message) error {
		<-ctx.Done() // outlives the grace; ends when the loop gives up on it
		return ctx.Err()
	}))
	s.publish(src, message("cut"))
	s.waitFor("the handler to start", func() bool { return len(rec.of("cut")) == 1 })
	first.stop()

	s.start("second", src, grace, rec.handler("second", nil))
	s.waitUpTo(s.caps.Lease+patience, "the message to be delivered again to a new Run", func() bool { return len(rec.of("cut")) >= 2 })
	ds := rec.of("cut")
	if ds[1].consumer != "second" {
		s.t.Errorf("redelivery went to %q after its Run returned", ds[1].consumer)
	}
	if ds[1].msgID != ds[0].msgID || string(ds[1].body) != "cut" {
		s.t.Errorf("redelivery has ID %q body %q, want ID %q body %q", ds[1].msgID, ds[1].body, ds[0].msgID, "cut")
	}
	if ds[1].attempt < 1 {
		s.t.Errorf("redelivery has Attempt %d, want >= 1", ds[1].attempt)
	}
}

// testShutdownDrains: a handler still running when Run's context ends may
// finish within the grace, with its own context intact; its message is then
// acknowledged and not delivered again.
func testShutdownDrains(s *suite) {
	src, settle := s.leasedSource(false)
	cancelled := make(chan struct{})
	var ctxErr errBox
	var rec recorder
	first := s.start("first", src, 10*time.Second, rec.handler("first", func(ctx context.Context, m *consumer.Message) error {
		select {
		case <-cancelled:
		case <-ctx.Done():
			return ctxErr.set(ctx.Err())
		}
		// Some work left after shutdown began, well within the grace.
		return ctxErr.set(sleepCtx(ctx, 200*time.Millisecond))
	}))
	s.publish(src, message("drain"))
	s.waitFor("the handler to start", func() bool { return len(rec.of("drain")) == 1 })
	first.cancelOnly()
	close(cancelled)
	first.stop()
	if err := ctxErr.get(); err != nil {
		s.t.Fatalf("the running handler's context ended (%v) although it finished well within the shutdown grace", err)
	}

	s.start("second", src, grace, rec.handler("second", nil))
	s.watch(settle, func() error {
		if ds := rec.of("drain"); len(ds) > 1 {
			return fmt.Errorf("a message whose handler finished during the shutdown grace was delivered again (to %q, attempt %d)", ds[1].consumer, ds[1].attempt)
		}
		return nil
	})
}

// testPanic: a handler's panic does not crash the process or end Run; the
// message is delivered again with the next attempt.
func testPanic(s *suite) {
	src := s.source(SourceConfig{})
	var rec recorder
	s.start("consumer", src, grace, rec.handler("consumer", func(ctx context.Context, m *consumer.Message) error {
		if id := m.Header(idHeader); id == "boom" && len(rec.of(id)) == 1 {
			panic(fmt.Errorf("consumertest: panic on purpose: %w", errFail))
		}
		return nil
	}), consumer.WithRedeliveryBackoff(10*time.Millisecond, 100*time.Millisecond))
	s.publish(src, message("boom"))
	s.waitFor("the message to be delivered again after its handler panicked", func() bool { return len(rec.of("boom")) >= 2 })
	ds := rec.of("boom")
	if ds[1].attempt != ds[0].attempt+1 {
		s.t.Errorf("Attempt after a panic = %d, want %d", ds[1].attempt, ds[0].attempt+1)
	}
	// Run carries on: a new message is handled by the same Run.
	s.publish(src, message("after"))
	s.waitFor("a message published after the panic to be handled", func() bool { return len(rec.of("after")) == 1 })
}

// testRoundTrip: body bytes (all 256 byte values, empty, 1 MiB), key,
// headers with unicode values, and the source name arrive as published.
func testRoundTrip(s *suite) {
	src := s.source(SourceConfig{})
	binary := make([]byte, 512)
	for i := range binary {
		binary[i] = byte(i)
	}
	size := 1 << 20
	if s.caps.MaxBody > 0 && s.caps.MaxBody < size {
		size = s.caps.MaxBody
	}
	large := make([]byte, size)
	_, _ = rand.NewChaCha8([32]byte{3, 4}).Read(large)

	headers := map[string]string{
		"plain":      "value",
		"unicode":    "héllo, 世界 🚀 — ünïcödé",
		"Mixed-Case": "Kept",
	}
	mk := func(id, key string, body []byte) consumer.Message {
		h := map[string]string{idHeader: id}
		for k, v := range headers {
			h[k] = v
		}
		return consumer.Message{Key: key, Body: body, Headers: h}
	}
	want := []consumer.Message{
		mk("binary", "ключ-🔑", binary),
		mk("empty", "", []byte{}),
		mk("large", "large", large),
	}
	var rec recorder
	s.start("consumer", src, grace, rec.handler("consumer", nil))
	for _, m := range want {
		s.publish(src, m)
	}
	s.waitFor("the three messages to be handled", func() bool { return rec.distinct() == len(want) })

	for _, w := range want {
		id := w.Headers[idHeader]
		d := rec.of(id)[0]
		if !bytes.Equal(d.body, w.Body) {
			s.t.Errorf("%s: body of %d bytes arrived as %d bytes that differ (first difference at %d)", id, len(w.Body), len(d.body), firstDiff(d.body, w.Body))
		}
		if d.key != w.Key {
			s.t.Errorf("%s: Key = %q, want %q", id, d.key, w.Key)
		}
		for k, v := range w.Headers {
			if got, ok := d.headers[k]; !ok || got != v {
				s.t.Errorf("%s: header %q = %q (present %v), want %q", id, k, got, ok, v)
			}
		}
		if d.source != src {
			s.t.Errorf("%s: Source = %q, want %q", id, d.source, src)
		}
		if d.msgID == "" {
			s.t.Errorf("%s: ID is empty", id)
		}
		if d.attempt != 1 {
			s.t.Errorf("%s: Attempt = %d on first delivery, want 1", id, d.attempt)
		}
	}
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// testTwoConsumers: two consumers of one source share its messages; a
// message is never handled by both at once, and one that a consumer handled
// successfully is not handled again by either.
func testTwoConsumers(s *suite) {
	// Few messages held long, so that both consumers hold messages at once
	// and a message that leaked from one would reach the other in time.
	const n = 24
	src := s.source(SourceConfig{})
	var mu sync.Mutex
	holder := make(map[string]string) // suite id -> consumer handling it now
	succeeded := make(map[string]string)
	var overlaps, again []string
	var rec recorder
	h := func(name string) consumer.HandlerFunc {
		return rec.handler(name, func(ctx context.Context, m *consumer.Message) error {
			id := m.Header(idHeader)
			mu.Lock()
			if other, ok := holder[id]; ok {
				overlaps = append(overlaps, id+" ("+other+" and "+name+")")
			}
			if first, ok := succeeded[id]; ok {
				again = append(again, id+" ("+first+", then "+name+")")
			}
			holder[id] = name
			mu.Unlock()
			err := sleepCtx(ctx, 100*time.Millisecond)
			mu.Lock()
			delete(holder, id)
			if err == nil {
				succeeded[id] = name
			}
			mu.Unlock()
			return err
		})
	}
	s.start("a", src, grace, h("a"), consumer.WithConcurrency(4))
	s.start("b", src, grace, h("b"), consumer.WithConcurrency(4))
	s.publish(src, messages("shared", n)...)

	s.waitFor(fmt.Sprintf("all %d messages to be handled", n), func() bool { return rec.distinct() == n })
	s.watch(quiet, func() error {
		mu.Lock()
		defer mu.Unlock()
		if len(overlaps) > 0 {
			return fmt.Errorf("%d message(s) were handled by two consumers at once: %v", len(overlaps), firstN(overlaps, 5))
		}
		if len(again) > 0 {
			return fmt.Errorf("%d message(s) were handled again after a successful handler: %v", len(again), firstN(again, 5))
		}
		return nil
	})
	s.t.Logf("consumer a handled %d, b handled %d", rec.distinctBy("a"), rec.distinctBy("b"))
}

// testPromptReturn: Run returns nil soon after its context ends, idle or
// with handlers running, within its shutdown grace and a margin.
func testPromptReturn(s *suite) {
	src := s.source(SourceConfig{})
	const g = time.Second
	var rec recorder
	idle := s.start("idle", src, g, rec.handler("idle", nil))
	s.publish(src, message("warm-up"))
	s.waitFor("a first message to be handled", func() bool { return rec.distinct() == 1 })
	idle.stop() // fails the test unless Run returns nil within g + returnMargin

	src2 := s.source(SourceConfig{})
	busy := s.start("busy", src2, g, rec.handler("busy", func(ctx context.Context, m *consumer.Message) error {
		<-ctx.Done()
		return ctx.Err()
	}))
	s.publish(src2, message("stuck"))
	s.waitFor("the handler to start", func() bool { return len(rec.of("stuck")) == 1 })
	busy.stop()
}

// testNilHandler: Run with a nil handler returns a configuration error at
// once instead of running or hanging.
func testNilHandler(s *suite) {
	src := s.source(SourceConfig{})
	c := s.h.NewConsumer(s.t, src)
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx, nil) }()
	timer := time.NewTimer(returnMargin)
	defer timer.Stop()
	select {
	case err := <-done:
		if err == nil {
			s.t.Fatal("Run(ctx, nil) returned nil, want an error")
		}
		if !errors.Is(err, consumer.ErrInvalidConfig) {
			s.t.Errorf("Run(ctx, nil) = %v, want an error matching consumer.ErrInvalidConfig", err)
		}
	case <-timer.C:
		cancel()
		<-done
		s.t.Fatalf("Run(ctx, nil) did not return within %s", returnMargin)
	}
}

// testHold: a message held by its handler (consumer.Hold, as an open circuit
// breaker does) runs again with the same Attempt: a hold is not an attempt.
func testHold(s *suite) {
	src := s.source(SourceConfig{})
	const holds = 2
	var rec recorder
	s.start("consumer", src, grace, rec.handler("consumer", func(ctx context.Context, m *consumer.Message) error {
		if len(rec.of(m.Header(idHeader))) <= holds {
			return consumer.Hold(errors.New("consumertest: dependency down"), 50*time.Millisecond)
		}
		return nil
	}))
	s.publish(src, message("held"))
	s.waitFor("the message to run again after being held twice", func() bool { return len(rec.of("held")) > holds })
	ds := rec.of("held")
	for i, d := range ds {
		if d.attempt != ds[0].attempt {
			s.t.Errorf("run %d: Attempt = %d after %d hold(s), want %d: a hold is not an attempt", i+1, d.attempt, i, ds[0].attempt)
		}
		if d.msgID != ds[0].msgID {
			s.t.Errorf("run %d: ID = %q, want %q", i+1, d.msgID, ds[0].msgID)
		}
	}
	s.watch(s.settleWindow(), func() error {
		if n := len(rec.of("held")); n > holds+1 {
			return fmt.Errorf("message ran %d times, want %d: it came back after its handler succeeded", n, holds+1)
		}
		return nil
	})
}
