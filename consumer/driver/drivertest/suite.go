package drivertest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
)

// idHeader carries the suite's own id of a message: a broker may give a
// message an ID of its own (SQS does), so the suite finds its messages by
// this header.
const idHeader = "drivertest-id"

// maxInFlight is the driver.Config.MaxInFlight of every driver the suite
// opens: larger than any batch a test publishes, so that a driver sizing
// its prefetch from it takes the whole batch.
const maxInFlight = 32

// wait bounds every wait on the broker: generous, for shared brokers. A
// var, for runs of the suite meant to fail (see export_test.go).
var wait = 90 * time.Second

// Run runs the suite against the driver behind h, one subtest per clause,
// each on a fresh source, one after another. Select clauses with go test
// -run 'TestX/Clause'.
func Run(t *testing.T, h Harness) {
	t.Helper()
	if h == nil {
		t.Fatal("drivertest: nil Harness")
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			caps := h.Capabilities()
			if why, ok := caps.KnownDefects[tc.name]; ok {
				t.Skip("known defect: " + why)
			}
			tc.fn(&suite{t: t, h: h, caps: caps})
		})
	}
}

var tests = []struct {
	name string
	fn   func(*suite)
}{
	{"FetchReturnsPublishedMessagesUpToMax", testFetch},
	{"FetchReturnsPromptlyWhenContextEnds", testFetchContext},
	{"AckedMessageNeverComesAgain", testAck},
	{"ReturnComesBackAfterItsDelay", testReturn},
	{"ExtendedDeliveryIsNotGivenToASecondDriver", testExtend},
	{"StaleHandlesAfterRevocationAckNothing", testRevoke},
	{"DrainHandsOverWhatWasPushedAndLosesNothing", testDrain},
	{"FetchAfterCloseIsFatalAndCloseTwiceIsSafe", testClose},
	{"CloseEndsAWaitingFetch", func(s *suite) { testCloseWhileFetching(s, false) }},
	{"CloseEndsTheFirstFetch", func(s *suite) { testCloseWhileFetching(s, true) }},
}

type suite struct {
	t    *testing.T
	h    Harness
	caps Capabilities
}

func (s *suite) source(cfg SourceConfig) string {
	s.t.Helper()
	return s.h.NewSource(s.t, cfg)
}

// config is what every driver of source is opened with: one group.
func config(source string) driver.Config {
	return driver.Config{Name: source + "-drivertest", MaxInFlight: maxInFlight}
}

// open opens a driver of source, connects it when it is a Connector, and
// closes it when the test ends.
func (s *suite) open(source string) driver.Driver {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	d, err := s.h.Opener(s.t, source).Driver(ctx, source, config(source))
	if err != nil {
		s.t.Fatalf("Driver(%q): %v", source, err)
	}
	s.t.Cleanup(func() { _ = d.Close() })
	if c, ok := d.(driver.Connector); ok {
		for {
			err := c.Connect(ctx)
			if err == nil {
				break
			}
			if driver.IsFatal(err) || ctx.Err() != nil {
				s.t.Fatalf("Connect to %q: %v", source, err)
			}
			s.t.Logf("Connect to %q: %v (trying again)", source, err)
			time.Sleep(200 * time.Millisecond)
		}
	}
	if got := d.Capabilities().Redelivers; got != s.caps.Redelivers {
		s.t.Fatalf("driver's Capabilities().Redelivers = %v, the harness says %v", got, s.caps.Redelivers)
	}
	if src := d.Capabilities().Source; src != "" && src != source {
		s.t.Errorf("driver's Capabilities().Source = %q, want %q (or empty)", src, source)
	}
	return d
}

// publish publishes n messages to source and returns their ids, in order.
// With keyed, message i has the key "k<i>", spreading them over lanes.
func (s *suite) publish(source, prefix string, n int, keyed bool) []string {
	s.t.Helper()
	ids := make([]string, n)
	msgs := make([]consumer.Message, n)
	for i := range msgs {
		id := fmt.Sprintf("%s-%s-%d", s.t.Name(), prefix, i)
		ids[i] = id
		msgs[i] = consumer.Message{
			ID:      id,
			Body:    []byte("body of " + id),
			Headers: map[string]string{idHeader: id, "drivertest-header": "value of " + id},
		}
		if keyed {
			msgs[i].Key = "k" + strconv.Itoa(i)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	if err := s.h.Publisher(s.t).Publish(ctx, source, msgs...); err != nil {
		s.t.Fatalf("publish %d messages to %q: %v", n, source, err)
	}
	return ids
}

func settle(ctx context.Context, d driver.Driver, batch ...driver.Settlement) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("%w: %v", errPanic, p)
		}
	}()
	return d.Settle(ctx, batch)
}

func (s *suite) ack(d driver.Driver, ms ...driver.Message) {
	s.t.Helper()
	if len(ms) == 0 {
		return
	}
	batch := make([]driver.Settlement, len(ms))
	for i, m := range ms {
		batch[i] = driver.Settlement{Handle: m.Handle, Action: driver.Ack}
	}
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	if err := settle(ctx, d, batch...); err != nil {
		s.t.Errorf("ack %d deliveries: %v", len(ms), err)
	}
}

func id(m driver.Message) string { return m.Headers[idHeader] }

// delivery is one message a fetcher got, and when Fetch returned it.
type delivery struct {
	m  driver.Message
	at time.Time
}

// fetcher calls Fetch in a loop on a goroutine of its own, as the loop
// does, and keeps what it returns, until stop. A Fetch whose context
// ended may leave a driver unable to fetch again (SQS stops receiving),
// so a test keeps one fetcher for a driver's life.
type fetcher struct {
	t      *testing.T
	d      driver.Driver
	cancel context.CancelFunc
	done   chan struct{}

	mu     sync.Mutex
	got    []delivery
	grew   chan struct{} // closed when got grows, then replaced
	fatal  error
	errors int
}

// fetch starts a fetcher of d, fetching up to max a call; it is stopped
// when the test ends, before d is closed.
func (s *suite) fetch(d driver.Driver, max int) *fetcher {
	ctx, cancel := context.WithCancel(context.Background())
	f := &fetcher{t: s.t, d: d, cancel: cancel, done: make(chan struct{}), grew: make(chan struct{})}
	go f.run(ctx, max)
	s.t.Cleanup(func() { f.stop() })
	return f
}

func (f *fetcher) run(ctx context.Context, max int) {
	defer close(f.done)
	var buf []driver.Message
	for ctx.Err() == nil {
		var err error
		buf, err = f.d.Fetch(ctx, buf[:0], max)
		now := time.Now()
		f.mu.Lock()
		if len(buf) > max {
			f.t.Errorf("Fetch(max %d) returned %d deliveries", max, len(buf))
		}
		for _, m := range buf {
			f.got = append(f.got, delivery{m: m, at: now})
		}
		if len(buf) > 0 {
			close(f.grew)
			f.grew = make(chan struct{})
		}
		switch {
		case err == nil, ctx.Err() != nil:
		case driver.IsFatal(err):
			f.fatal = err
			close(f.grew)
			f.grew = make(chan struct{})
			f.mu.Unlock()
			return
		default:
			f.errors++
			if f.errors <= 5 {
				f.t.Logf("Fetch: %v (the loop would retry)", err)
			}
		}
		f.mu.Unlock()
		if err != nil && ctx.Err() == nil {
			time.Sleep(100 * time.Millisecond)
		}
	}
}

// stop ends fetching and returns all that was fetched.
func (f *fetcher) stop() []delivery {
	f.cancel()
	<-f.done
	return f.all()
}

func (f *fetcher) all() []delivery {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.got)
}

// await waits until cond holds of what was fetched, failing the test
// after d, and returns what was fetched.
func (f *fetcher) await(d time.Duration, what string, cond func([]delivery) bool) []delivery {
	f.t.Helper()
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		f.mu.Lock()
		got, grew, fatal := slices.Clone(f.got), f.grew, f.fatal
		f.mu.Unlock()
		if cond(got) {
			return got
		}
		if fatal != nil {
			f.t.Fatalf("waiting for %s: Fetch failed: %v", what, fatal)
		}
		select {
		case <-grew:
		case <-timer.C:
			f.t.Fatalf("no %s within %s; fetched %d: %v", what, d, len(got), ids(got))
		}
	}
}

func ids(ds []delivery) []string {
	out := make([]string, len(ds))
	for i, d := range ds {
		out[i] = id(d.m)
	}
	return out
}

// seenAll reports whether every one of want was fetched at least n times.
func seenAll(want []string, n int) func([]delivery) bool {
	return func(got []delivery) bool {
		count := make(map[string]int)
		for _, d := range got {
			count[id(d.m)]++
		}
		for _, w := range want {
			if count[w] < n {
				return false
			}
		}
		return true
	}
}

// first returns the first delivery of each id.
func first(ds []delivery) map[string]driver.Message {
	out := make(map[string]driver.Message)
	for _, d := range ds {
		if _, ok := out[id(d.m)]; !ok {
			out[id(d.m)] = d.m
		}
	}
	return out
}

// testFetch: Fetch appends to dst, never more than max, and each delivery
// carries what was published, its source and a handle, and an ID of its
// own.
func testFetch(s *suite) {
	src := s.source(SourceConfig{})
	want := s.publish(src, "m", 5, false)
	d := s.open(src)
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	seen := make(map[string]driver.Message)
	sentinel := driver.Message{ID: "drivertest-sentinel"}
	for len(seen) < len(want) {
		out, err := d.Fetch(ctx, []driver.Message{sentinel}, 2)
		if err != nil {
			s.t.Fatalf("Fetch: %v (fetched %d of %d)", err, len(seen), len(want))
		}
		if len(out) == 0 || out[0].ID != sentinel.ID {
			s.t.Fatalf("Fetch did not keep what dst held: returned %d deliveries, the first %q", len(out), firstID(out))
		}
		if n := len(out) - 1; n > 2 {
			s.t.Errorf("Fetch(max 2) appended %d deliveries", n)
		}
		// Acked as they come, as the loop does: a driver may hold a
		// lane's later records back until earlier ones finish (Kafka).
		s.ack(d, out[1:]...)
		for _, m := range out[1:] {
			k := id(m)
			if !slices.Contains(want, k) {
				s.t.Errorf("Fetch returned a message the test did not publish: ID %q, headers %v", m.ID, m.Headers)
				continue
			}
			if _, dup := seen[k]; dup {
				s.t.Errorf("message %s delivered twice within its lease", k)
			}
			seen[k] = m
			switch {
			case m.ID == "":
				s.t.Errorf("message %s has no ID", k)
			case string(m.Body) != "body of "+k:
				s.t.Errorf("message %s has body %q", k, m.Body)
			case m.Headers["drivertest-header"] != "value of "+k:
				s.t.Errorf("message %s has headers %v", k, m.Headers)
			case m.Source != src:
				s.t.Errorf("message %s has Source %q, want %q", k, m.Source, src)
			case m.Handle == nil:
				s.t.Errorf("message %s has no Handle", k)
			case m.Deliveries > 1:
				s.t.Errorf("message %s on its first delivery has Deliveries %d", k, m.Deliveries)
			}
		}
	}
	ids := make(map[string]bool)
	for _, m := range seen {
		if ids[m.ID] {
			s.t.Errorf("two messages have the ID %q", m.ID)
		}
		ids[m.ID] = true
	}
}

func firstID(ms []driver.Message) string {
	if len(ms) == 0 {
		return ""
	}
	return ms[0].ID
}

func mapValues[K comparable, V any](m map[K]V) func(func(V) bool) {
	return func(yield func(V) bool) {
		for _, v := range m {
			if !yield(v) {
				return
			}
		}
	}
}

// promptly is how long a Fetch may take to return once its context ended
// or its driver closed: a long poll or a commit in flight is let finish.
const promptly = 30 * time.Second

// fetchOnce runs one Fetch and returns its result, failing the test when
// it does not return within promptly of end being called.
func (s *suite) fetchOnce(ctx context.Context, d driver.Driver, end func()) ([]driver.Message, error) {
	s.t.Helper()
	type result struct {
		ms  []driver.Message
		err error
	}
	res := make(chan result, 1)
	go func() {
		ms, err := d.Fetch(ctx, nil, 10)
		res <- result{ms, err}
	}()
	end()
	select {
	case r := <-res:
		return r.ms, r.err
	case <-time.After(promptly):
		s.t.Fatalf("Fetch did not return within %s", promptly)
		return nil, nil
	}
}

// testFetchContext: a Fetch whose context ended before it was called, or
// ends while it waits on an empty source, returns with an error wrapping
// the context's. Deliveries it returns with it are the caller's.
func testFetchContext(s *suite) {
	src := s.source(SourceConfig{})
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	d := s.open(src)
	ms, err := s.fetchOnce(ended, d, func() {})
	if !errors.Is(err, context.Canceled) {
		s.t.Errorf("Fetch with a cancelled context = %d deliveries, %v; want an error wrapping context.Canceled", len(ms), err)
	}
	s.ack(d, ms...)

	d2 := s.open(src)
	ctx, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	ms, err = s.fetchOnce(ctx, d2, func() {
		time.Sleep(500 * time.Millisecond) // let the Fetch start waiting
		cancel2()
	})
	if !errors.Is(err, context.Canceled) {
		s.t.Errorf("Fetch whose context ended while it waited = %d deliveries, %v; want an error wrapping context.Canceled", len(ms), err)
	}
	s.ack(d2, ms...)

	d3 := s.open(src)
	dl, cancel3 := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel3()
	ms, err = s.fetchOnce(dl, d3, func() {})
	if !errors.Is(err, context.DeadlineExceeded) {
		s.t.Errorf("Fetch whose deadline passed while it waited = %d deliveries, %v; want an error wrapping context.DeadlineExceeded", len(ms), err)
	}
	s.ack(d3, ms...)
}

// quiet is how long a test watches for a message that must not come; a
// lease's run out within it.
func (s *suite) quiet() time.Duration { return max(3*time.Second, 3*s.caps.Lease) }

// testAck: acked messages never come again, neither to the driver that
// acked them nor to a new one, while a message published later does.
func testAck(s *suite) {
	src := s.source(SourceConfig{Lease: s.caps.Lease})
	want := s.publish(src, "acked", 3, false)
	d := s.open(src)
	f := s.fetch(d, 10)
	got := first(f.await(wait, "first delivery of every message", seenAll(want, 1)))
	s.ack(d, slices.Collect(mapValues(got))...)
	time.Sleep(s.quiet())
	count := make(map[string]int)
	for _, dv := range f.stop() {
		if count[id(dv.m)]++; count[id(dv.m)] == 2 {
			s.t.Errorf("acked message %s delivered again to the driver that acked it", id(dv.m))
		}
	}
	if err := d.Close(); err != nil {
		s.t.Errorf("Close: %v", err)
	}

	// A new driver of the source (on Kafka: the group's next member)
	// gets a message published after the acks, and none of the acked.
	d2 := s.open(src)
	later := s.publish(src, "later", 1, false)
	f2 := s.fetch(d2, 10)
	s.ack(d2, fetchedOf(f2.await(wait, "the message published after the acks", seenAll(later, 1)), later)...)
	time.Sleep(s.quiet())
	for _, dv := range f2.stop() {
		if slices.Contains(want, id(dv.m)) {
			s.t.Errorf("acked message %s delivered again to a new driver", id(dv.m))
		}
	}
}

// fetchedOf returns the first delivery of each of want.
func fetchedOf(ds []delivery, want []string) []driver.Message {
	var out []driver.Message
	f := first(ds)
	for _, w := range want {
		if m, ok := f[w]; ok {
			out = append(out, m)
		}
	}
	return out
}

// delivered returns the nth delivery (from 1) of the message id.
func delivered(ds []delivery, msgID string, n int) delivery {
	for _, d := range ds {
		if id(d.m) == msgID {
			if n--; n == 0 {
				return d
			}
		}
	}
	return delivery{}
}

func deliveries(m driver.Message) int { return max(m.Deliveries, 1) }

// returnDelay is the delay of the returns testReturn makes.
const returnDelay = 2 * time.Second

// testReturn: a message returned with a delay comes back, not before the
// delay, counted and with its history where the broker does so; a return
// marked NotAttempted does not raise the count where the broker keeps one.
func testReturn(s *suite) {
	if !s.caps.Redelivers {
		s.t.Skip("the broker does not redeliver returned messages (Capabilities.Redelivers is false): the loop retries in place")
	}
	src := s.source(SourceConfig{})
	want := s.publish(src, "ret", 1, false)
	d := s.open(src)
	f := s.fetch(d, 10)
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()

	giveBack := func(n int, notAttempted bool, h driver.History) (driver.Message, driver.Message) {
		s.t.Helper()
		prev := delivered(f.await(wait, fmt.Sprintf("delivery %d", n), seenAll(want, n)), want[0], n).m
		t0 := time.Now()
		err := settle(ctx, d, driver.Settlement{Handle: prev.Handle, Action: driver.Return, Delay: returnDelay, NotAttempted: notAttempted, History: h})
		if err != nil {
			s.t.Fatalf("return delivery %d with a delay of %s: %v", n, returnDelay, err)
		}
		next := delivered(f.await(wait, fmt.Sprintf("delivery %d after a return", n+1), seenAll(want, n+1)), want[0], n+1)
		if early := returnDelay - next.at.Sub(t0); early > s.caps.DelayGranularity {
			s.t.Errorf("returned with a delay of %s, delivery %d came back after %s", returnDelay, n+1, next.at.Sub(t0))
		}
		if s.caps.CarriesHistory && next.m.Known != h {
			s.t.Errorf("returned with History %+v, delivery %d came back with Known %+v", h, n+1, next.m.Known)
		}
		return prev, next.m
	}

	h1 := driver.History{Runs: 1, Deliveries: 1}
	m1, m2 := giveBack(1, false, h1)
	if s.caps.CountsDeliveries && deliveries(m2) <= deliveries(m1) {
		s.t.Errorf("a returned message came back with Deliveries %d, after %d", m2.Deliveries, m1.Deliveries)
	}
	// Not attempted: the handler did not run on delivery 2, so the runs
	// stay at one.
	h2 := driver.History{Runs: 1, Deliveries: 2}
	_, m3 := giveBack(2, true, h2)
	if s.caps.NotAttemptedUncounted && deliveries(m3) != deliveries(m2) {
		s.t.Errorf("a return marked NotAttempted came back with Deliveries %d, after %d", m3.Deliveries, m2.Deliveries)
	}
	s.ack(d, m3)
}

// testExtend: a delivery whose lease the driver extends, for three leases,
// is not given to a second driver of the source, while one it did not
// extend is.
func testExtend(s *suite) {
	if s.caps.Lease == 0 {
		s.t.Skip("the harness gives no short lease (Capabilities.Lease is 0)")
	}
	src := s.source(SourceConfig{Lease: s.caps.Lease})
	want := s.publish(src, "lease", 2, false)
	d := s.open(src)
	ext, ok := d.(driver.Extender)
	if !ok {
		s.t.Skip("the driver does not implement driver.Extender")
	}
	lease := ext.Lease()
	if lease <= 0 {
		s.t.Fatalf("Extender.Lease() = %s", lease)
	}
	f := s.fetch(d, 10)
	got := first(f.await(wait, "both messages", seenAll(want, 1)))
	kept := got[want[0]]

	stop := make(chan struct{})
	extended := make(chan struct{})
	go func() {
		defer close(extended)
		t := time.NewTicker(lease / 4)
		defer t.Stop()
		for {
			ctx, cancel := context.WithTimeout(context.Background(), lease)
			err := ext.Extend(ctx, []any{kept.Handle}, lease)
			cancel()
			if err != nil {
				s.t.Errorf("Extend: %v", err)
			}
			select {
			case <-stop:
				return
			case <-t.C:
			}
		}
	}()
	d2 := s.open(src)
	f2 := s.fetch(d2, 10)
	// The message not extended comes to the second driver after its lease;
	// the extended one is kept as long again, and then as long once more.
	s.ack(d2, fetchedOf(f2.await(wait, "the message whose lease ran out, at the second driver", seenAll(want[1:], 1)), want[1:])...)
	time.Sleep(2 * lease)
	for _, dv := range f2.all() {
		if id(dv.m) == want[0] {
			s.t.Errorf("a delivery extended every %s by %s was given to a second driver", lease/4, lease)
		}
	}
	close(stop)
	<-extended
	s.ack(d, kept)
}

// testRevoke: after a revocation, once the revoked lanes' messages were
// delivered again (to another member, or on a new channel), settling the
// handles the driver held of those lanes neither panics nor acks the
// messages now delivered to someone else: a new driver still gets every
// message, none having been acked validly.
func testRevoke(s *suite) {
	src := s.source(SourceConfig{})
	d := s.open(src)
	r, ok := d.(driver.Revoker)
	if !ok {
		s.t.Skip("the driver does not implement driver.Revoker")
	}
	rv, ok := s.h.(Revoking)
	if !ok {
		s.t.Skip("the harness cannot cause a revocation (it does not implement drivertest.Revoking)")
	}
	want := s.publish(src, "rev", 16, true)
	f := s.fetch(d, maxInFlight)
	held := first(f.await(wait, "every message", seenAll(want, 1)))
	heldN := len(f.all())

	other := rv.Revoke(s.t, src, config(src), d)
	var fo *fetcher
	if other != nil {
		s.t.Cleanup(func() { _ = other.Close() })
		fo = s.fetch(other, maxInFlight)
	}
	var rev driver.Revocation
	select {
	case rev = <-r.Revoked():
	case <-time.After(wait):
		s.t.Fatalf("no revocation within %s", wait)
	}
	if rev.Done != nil {
		close(rev.Done)
	}
	var stale []driver.Message
	var staleIDs []string
	for _, k := range want {
		if m := held[k]; slices.Contains(rev.Lanes, m.Lane) {
			stale = append(stale, m)
			staleIDs = append(staleIDs, k)
		}
	}
	if len(stale) == 0 {
		s.t.Fatalf("the revocation of lanes %q took none of the lanes of the %d deliveries held", rev.Lanes, len(held))
	}
	// Wait until the revoked messages were delivered again: to the other
	// driver, or to this one after the revocation (under a later
	// generation of the lane where the driver numbers them).
	redelivered := func() bool {
		var again []delivery
		for _, dv := range f.all()[heldN:] {
			if rev.Before == 0 || dv.m.Generation >= rev.Before {
				again = append(again, dv)
			}
		}
		if fo != nil {
			again = append(again, fo.all()...)
		}
		return seenAll(staleIDs, 1)(again)
	}
	deadline := time.Now().Add(wait)
	for !redelivered() {
		if time.Now().After(deadline) {
			s.t.Fatalf("the %d messages of the revoked lanes %q were not delivered again within %s", len(stale), rev.Lanes, wait)
		}
		time.Sleep(100 * time.Millisecond)
	}

	batch := make([]driver.Settlement, len(stale))
	for i, m := range stale {
		batch[i] = driver.Settlement{Handle: m.Handle, Action: driver.Ack}
	}
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	if err := settle(ctx, d, batch...); err != nil {
		if errors.Is(err, errPanic) {
			s.t.Errorf("settling handles of revoked lanes: %v", err)
		}
		s.t.Logf("settling %d handles of revoked lanes: %v", len(stale), err)
	}

	// Let go of everything unsettled; a new driver gets every message.
	f.stop()
	if fo != nil {
		fo.stop()
		_ = other.Close()
	}
	_ = d.Close()
	d3 := s.open(src)
	f3 := s.fetch(d3, maxInFlight)
	deadline = time.Now().Add(wait)
	for !seenAll(want, 1)(f3.all()) {
		if time.Now().After(deadline) {
			seen := first(f3.all())
			var lost []string
			for _, k := range staleIDs {
				if _, ok := seen[k]; !ok {
					lost = append(lost, k)
				}
			}
			s.t.Fatalf("after settling handles of revoked lanes, a new driver did not get %d message(s) within %s (of the revoked ones: %v)", len(want)-len(seen), wait, lost)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// testDrain: after one Fetch of a single message, Drain hands over what the
// broker pushed ahead (each once, none fetched already), and the broker
// pushes no more: while the drained driver is still open, a second one gets
// every message neither fetched nor drained, and those published after.
func testDrain(s *suite) {
	src := s.source(SourceConfig{})
	want := s.publish(src, "drain", 8, false)
	d := s.open(src)
	dr, ok := d.(driver.Drainer)
	if !ok {
		s.t.Skip("the driver does not implement driver.Drainer")
	}
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	var taken []driver.Message
	for len(taken) == 0 {
		var err error
		taken, err = d.Fetch(ctx, taken, 1)
		if err != nil {
			s.t.Fatalf("Fetch: %v", err)
		}
	}
	time.Sleep(time.Second) // let the broker push ahead what it will
	drained, err := dr.Drain(ctx, nil)
	if err != nil {
		s.t.Fatalf("Drain: %v", err)
	}
	s.t.Logf("fetched %d, drained %d of %d", len(taken), len(drained), len(want))
	done := make(map[string]bool)
	for _, m := range slices.Concat(taken, drained) {
		k := id(m)
		switch {
		case !slices.Contains(want, k):
			s.t.Errorf("Fetch or Drain returned a message the test did not publish: %q", k)
		case done[k]:
			s.t.Errorf("message %s handed over twice by Fetch and Drain", k)
		case m.Handle == nil:
			s.t.Errorf("message %s has no Handle", k)
		}
		done[k] = true
	}
	s.ack(d, slices.Concat(taken, drained)...)

	later := s.publish(src, "after-drain", 4, false)
	var rest []string
	for _, k := range slices.Concat(want, later) {
		if !done[k] {
			rest = append(rest, k)
		}
	}
	d2 := s.open(src)
	f2 := s.fetch(d2, maxInFlight)
	f2.await(wait, "every message neither fetched nor drained, at a second driver while the drained one is open", seenAll(rest, 1))
	for _, dv := range f2.all() {
		if done[id(dv.m)] {
			s.t.Errorf("message %s, fetched or drained and acked, delivered again", id(dv.m))
		}
	}
	s.ack(d2, fetchedOf(f2.all(), rest)...)
}

// testClose: Fetch after Close fails with an error marked driver.Fatal,
// and Close twice is safe.
func testClose(s *suite) {
	src := s.source(SourceConfig{})
	d := s.open(src)
	if err := d.Close(); err != nil {
		s.t.Errorf("Close: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	ms, err := s.fetchOnce(ctx, d, func() {})
	if !driver.IsFatal(err) {
		s.t.Errorf("Fetch after Close = %d deliveries, %v; want an error marked driver.Fatal", len(ms), err)
	}
	func() {
		defer func() {
			if p := recover(); p != nil {
				s.t.Errorf("second Close panicked: %v", p)
			}
		}()
		if err := d.Close(); err != nil {
			s.t.Errorf("second Close: %v", err)
		}
	}()
}

// testCloseWhileFetching: a Fetch waiting on an empty source returns once
// the driver is closed, with an error (the loop closes the driver only
// after its last Fetch, but a driver's own goroutines must not outlive
// it): the driver's first Fetch when first, else one after a Fetch that
// ran out of time.
func testCloseWhileFetching(s *suite, first bool) {
	src := s.source(SourceConfig{})
	d := s.open(src)
	if !first {
		warm, cancel := context.WithTimeout(context.Background(), time.Second)
		ms, err := s.fetchOnce(warm, d, func() {})
		cancel()
		if err == nil && len(ms) == 0 {
			s.t.Logf("Fetch on an empty source returned early with nothing")
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), wait+promptly)
	defer cancel()
	ms, err := s.fetchOnce(ctx, d, func() {
		time.Sleep(500 * time.Millisecond) // let the Fetch start waiting
		if err := d.Close(); err != nil {
			s.t.Errorf("Close: %v", err)
		}
	})
	if err == nil || ctx.Err() != nil {
		s.t.Errorf("Fetch waiting when the driver closed = %d deliveries, %v; want an error", len(ms), err)
	}
}

// errPanic marks a Settle that panicked.
var errPanic = errors.New("drivertest: Settle panicked")
