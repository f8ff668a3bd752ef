package memory_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/memory"
)

func TestFetchLeasesAndAckDeletes(t *testing.T) {
	b := newBroker(t)
	createQueue(t, b, "q", memory.QueueConfig{})
	d := newDriver(t, b, "q")
	publish(t, b, "q", consumer.Message{ID: "m1", Key: "k", Body: []byte("hello"), Headers: map[string]string{"h": "v"}})

	ms := fetch(t, d, 10)
	if len(ms) != 1 {
		t.Fatalf("fetched %d messages, want 1", len(ms))
	}
	m := ms[0]
	if m.ID != "m1" || m.Key != "k" || string(m.Body) != "hello" || m.Headers["h"] != "v" ||
		m.Source != "q" || m.Lane != "" || m.Offset != -1 || m.Deliveries != 1 || m.PublishedAt.IsZero() {
		t.Fatalf("delivery = %+v", m)
	}
	wantStats(t, b, "q", memory.QueueStats{InFlight: 1})
	fetchNothing(t, d, 50*time.Millisecond) // leased: hidden from the next fetch

	settle(t, d, ack(m))
	wantStats(t, b, "q", memory.QueueStats{Acked: 1})
	if got := b.Messages("q"); len(got) != 0 {
		t.Fatalf("Messages after ack = %v, want none", got)
	}
}

func TestFetchReturnsAtMostMax(t *testing.T) {
	b := newBroker(t)
	d := newDriver(t, b, "q")
	for i := range 5 {
		publish(t, b, "q", msg(string(rune('a'+i)), "x"))
	}
	ms := fetch(t, d, 3)
	if len(ms) != 3 || ms[0].ID != "a" || ms[1].ID != "b" || ms[2].ID != "c" {
		t.Fatalf("fetched %v, want a, b, c", ids(ms))
	}
	wantStats(t, b, "q", memory.QueueStats{Visible: 2, InFlight: 3})
}

func TestPublishAssignsUniqueIDs(t *testing.T) {
	b := newBroker(t)
	d := newDriver(t, b, "q")
	publish(t, b, "q", msg("", "a"), msg("", "b"))
	publish(t, b, "q", msg("", "c"))
	ms := fetch(t, d, 10)
	seen := map[string]bool{}
	for _, m := range ms {
		if m.ID == "" || seen[m.ID] {
			t.Fatalf("IDs %v are not unique and non-empty", ids(ms))
		}
		seen[m.ID] = true
	}
	if len(seen) != 3 {
		t.Fatalf("got %d messages, want 3", len(seen))
	}
}

// TestPublishNotBefore: a standard queue holds a message until its
// NotBefore (counted as delayed until then), however far ahead, while a
// FIFO queue refuses one, as SQS does, with the later messages of its key
// in the call, and publishes the others.
func TestPublishNotBefore(t *testing.T) {
	b := newBroker(t)
	d := newDriver(t, b, "q")
	later := msg("later", "body")
	later.NotBefore = time.Now().Add(time.Second)
	publish(t, b, "q", later, msg("now", "body"))
	wantStats(t, b, "q", memory.QueueStats{Visible: 1, Delayed: 1})
	if ms := fetch(t, d, 10); len(ms) != 1 || ms[0].ID != "now" {
		t.Fatalf("fetched %v before NotBefore, want now alone", ids(ms))
	}
	time.Sleep(time.Until(later.NotBefore))
	if ms := fetch(t, d, 10); len(ms) != 1 || ms[0].ID != "later" {
		t.Fatalf("fetched %v after NotBefore, want later", ids(ms))
	}

	createQueue(t, b, "f.fifo", memory.QueueConfig{FIFO: true})
	later.Key, later.NotBefore = "k", time.Now().Add(time.Minute)
	now := msg("now", "body")
	now.Key = "k"
	other := msg("other", "body")
	other.Key = "k2"
	err := b.Publish(t.Context(), "f.fifo", later, now, other)
	var pe *consumer.PublishError
	if !errors.As(err, &pe) || len(pe.Failed) != 2 || !errors.Is(pe.Failed[0].Err, consumer.ErrDelayNotSupported) || !errors.Is(pe.Failed[1].Err, memory.ErrNotSent) || pe.Failed[1].Index != 1 {
		t.Fatalf("Publish with NotBefore to a FIFO queue = %v, want message 0 refused with ErrDelayNotSupported and 1, of its key, not sent", err)
	}
	wantStats(t, b, "f.fifo", memory.QueueStats{Visible: 1})

	// A NotBefore at the end of time is no delay that wraps around.
	never := msg("never", "body")
	never.NotBefore = time.Date(9999, 1, 1, 0, 0, 0, 0, time.UTC)
	publish(t, b, "q", never)
	fetchNothing(t, d, 200*time.Millisecond)
}

func TestVisibilityTimeoutRedelivers(t *testing.T) {
	const vis = 100 * time.Millisecond
	b := newBroker(t)
	createQueue(t, b, "q", memory.QueueConfig{VisibilityTimeout: vis})
	crashed := newDriver(t, b, "q")
	survivor := newDriver(t, b, "q")
	publish(t, b, "q", msg("m1", "x"))

	start := time.Now()
	first := fetch(t, crashed, 1)[0] // and never settled: the consumer died
	again := fetch(t, survivor, 1)[0]
	if elapsed := time.Since(start); elapsed < vis {
		t.Fatalf("redelivered after %s, before the visibility timeout %s", elapsed, vis)
	}
	if again.ID != first.ID || again.Deliveries != 2 || string(again.Body) != "x" {
		t.Fatalf("redelivery = %+v, want m1 attempt 2", again)
	}
	settle(t, survivor, ack(again))
	wantStats(t, b, "q", memory.QueueStats{Acked: 1})
}

func TestReturnWithDelayIsNotVisibleBeforeTheDelay(t *testing.T) {
	b := newBroker(t)
	d := newDriver(t, b, "q")
	publish(t, b, "q", msg("m1", "x"))
	m := fetch(t, d, 1)[0]

	settle(t, d, ret(m, time.Hour))
	wantStats(t, b, "q", memory.QueueStats{Delayed: 1})
	fetchNothing(t, d, 100*time.Millisecond)
	if lag := lagOf(t, d); lag.Messages != 1 || lag.InFlight != 0 {
		t.Fatalf("Lag = %+v, want 1 message, 0 in flight", lag)
	}
}

func TestReturnWithDelayRedeliversAfterTheDelay(t *testing.T) {
	const delay = 150 * time.Millisecond
	b := newBroker(t)
	d := newDriver(t, b, "q")
	publish(t, b, "q", msg("m1", "x"))
	m := fetch(t, d, 1)[0]

	start := time.Now()
	settle(t, d, ret(m, delay))
	again := fetch(t, d, 1)[0]
	if elapsed := time.Since(start); elapsed < delay {
		t.Fatalf("redelivered after %s, before the delay %s", elapsed, delay)
	}
	if again.ID != "m1" || again.Deliveries != 2 {
		t.Fatalf("redelivery = %+v, want m1 attempt 2", again)
	}
}

func TestReturnWithoutDelayRedeliversNow(t *testing.T) {
	b := newBroker(t)
	d := newDriver(t, b, "q")
	publish(t, b, "q", msg("m1", "x"))
	m := fetch(t, d, 1)[0]
	settle(t, d, ret(m, 0))
	wantStats(t, b, "q", memory.QueueStats{Visible: 1})
	again := fetch(t, d, 1)[0]
	if again.ID != "m1" || again.Deliveries != 2 {
		t.Fatalf("redelivery = %+v, want m1 attempt 2", again)
	}
}

func TestExtendKeepsTheMessageInvisible(t *testing.T) {
	const vis = 150 * time.Millisecond
	b := newBroker(t)
	createQueue(t, b, "q", memory.QueueConfig{VisibilityTimeout: vis})
	d := newDriver(t, b, "q")
	ext := d.(driver.Extender)
	if ext.Lease() != vis {
		t.Fatalf("Lease() = %s, want the visibility timeout %s", ext.Lease(), vis)
	}
	publish(t, b, "q", msg("m1", "x"))
	m := fetch(t, d, 1)[0]
	if err := ext.Extend(context.Background(), []any{m.Handle}, time.Hour); err != nil {
		t.Fatalf("Extend: %v", err)
	}
	// Without the extension the lease runs out within this wait and the
	// message is fetched again.
	fetchNothing(t, newDriver(t, b, "q"), 4*vis)
	wantStats(t, b, "q", memory.QueueStats{InFlight: 1})
	settle(t, d, ack(m))
	wantStats(t, b, "q", memory.QueueStats{Acked: 1})
}

func TestStaleHandleCannotSettleTheNewDelivery(t *testing.T) {
	b := newBroker(t)
	createQueue(t, b, "q", memory.QueueConfig{VisibilityTimeout: 50 * time.Millisecond})
	slow := newDriver(t, b, "q")
	other := newDriver(t, b, "q")
	publish(t, b, "q", msg("m1", "x"))

	old := fetch(t, slow, 1)[0]
	cur := fetch(t, other, 1)[0] // after the slow consumer's lease ran out
	if cur.ID != old.ID || cur.Deliveries != 2 {
		t.Fatalf("redelivery = %+v, want m1 attempt 2", cur)
	}
	// The new delivery has the full lease from here on.
	if err := other.(driver.Extender).Extend(context.Background(), []any{cur.Handle}, time.Hour); err != nil {
		t.Fatalf("Extend(current): %v", err)
	}

	if err := slow.Settle(context.Background(), []driver.Settlement{ack(old)}); !errors.Is(err, memory.ErrStaleHandle) {
		t.Fatalf("Settle(stale ack) = %v, want ErrStaleHandle", err)
	}
	if err := slow.Settle(context.Background(), []driver.Settlement{ret(old, 0)}); !errors.Is(err, memory.ErrStaleHandle) {
		t.Fatalf("Settle(stale return) = %v, want ErrStaleHandle", err)
	}
	if err := slow.(driver.Extender).Extend(context.Background(), []any{old.Handle}, time.Hour); !errors.Is(err, memory.ErrStaleHandle) {
		t.Fatalf("Extend(stale) = %v, want ErrStaleHandle", err)
	}
	wantStats(t, b, "q", memory.QueueStats{InFlight: 1})

	settle(t, other, ack(cur))
	wantStats(t, b, "q", memory.QueueStats{Acked: 1})
}

func TestSettleAppliesTheRestOfABatchWithAStaleHandle(t *testing.T) {
	b := newBroker(t)
	d := newDriver(t, b, "q")
	publish(t, b, "q", msg("m1", "x"), msg("m2", "y"))
	ms := fetch(t, d, 2)
	settle(t, d, ack(ms[0]))

	err := d.Settle(context.Background(), []driver.Settlement{ack(ms[0]), ack(ms[1])})
	if !errors.Is(err, memory.ErrStaleHandle) {
		t.Fatalf("Settle(already acked, fresh) = %v, want ErrStaleHandle", err)
	}
	wantStats(t, b, "q", memory.QueueStats{Acked: 2})
}

func TestSettleRejectsForeignHandles(t *testing.T) {
	b := newBroker(t)
	d1 := newDriver(t, b, "q1")
	d2 := newDriver(t, b, "q2")
	publish(t, b, "q1", msg("m1", "x"))
	m := fetch(t, d1, 1)[0]
	for _, h := range []any{m.Handle, "receipt", nil} {
		err := d2.Settle(context.Background(), []driver.Settlement{{Handle: h, Action: driver.Ack}})
		if !errors.Is(err, memory.ErrInvalidHandle) {
			t.Fatalf("Settle(%v) on another queue = %v, want ErrInvalidHandle", h, err)
		}
	}
	wantStats(t, b, "q1", memory.QueueStats{InFlight: 1})
}

func TestFIFODeliversOneMessagePerGroupInOrder(t *testing.T) {
	b := newBroker(t)
	createQueue(t, b, "q.fifo", memory.QueueConfig{FIFO: true})
	d := newDriver(t, b, "q.fifo")
	publish(t, b, "q.fifo",
		consumer.Message{ID: "a1", Key: "a"}, consumer.Message{ID: "a2", Key: "a"},
		consumer.Message{ID: "b1", Key: "b"}, consumer.Message{ID: "a3", Key: "a"})

	ms := fetch(t, d, 10)
	if got := ids(ms); len(got) != 2 || got[0] != "a1" || got[1] != "b1" {
		t.Fatalf("first fetch = %v, want [a1 b1]: one per group", got)
	}
	if ms[0].Lane != "a" || ms[1].Lane != "b" {
		t.Fatalf("lanes = %q, %q, want the message groups", ms[0].Lane, ms[1].Lane)
	}
	// Both groups have a message in flight: nothing else may be delivered.
	fetchNothing(t, d, 50*time.Millisecond)
	wantStats(t, b, "q.fifo", memory.QueueStats{Visible: 2, InFlight: 2})

	settle(t, d, ack(ms[0]))
	a2 := fetch(t, d, 10)
	if got := ids(a2); len(got) != 1 || got[0] != "a2" {
		t.Fatalf("after acking a1: %v, want [a2]", got)
	}
	// A returned message goes back to the head of its group.
	settle(t, d, ret(a2[0], 0))
	again := fetch(t, d, 10)
	if got := ids(again); len(got) != 1 || got[0] != "a2" || again[0].Deliveries != 2 {
		t.Fatalf("after returning a2: %v, want [a2] attempt 2", got)
	}
	settle(t, d, ack(again[0]), ack(ms[1]))
	if got := ids(fetch(t, d, 10)); len(got) != 1 || got[0] != "a3" {
		t.Fatalf("after acking a2 and b1: %v, want [a3]", got)
	}
}

func TestFIFODelayedHeadHoldsItsGroup(t *testing.T) {
	b := newBroker(t)
	createQueue(t, b, "q.fifo", memory.QueueConfig{FIFO: true})
	d := newDriver(t, b, "q.fifo")
	publish(t, b, "q.fifo", consumer.Message{ID: "a1", Key: "a"}, consumer.Message{ID: "a2", Key: "a"})
	m := fetch(t, d, 10)[0]
	settle(t, d, ret(m, time.Hour))
	fetchNothing(t, d, 50*time.Millisecond) // a2 must not overtake a1
	wantStats(t, b, "q.fifo", memory.QueueStats{Visible: 1, Delayed: 1})
}

func TestFIFORequiresAKey(t *testing.T) {
	b := newBroker(t)
	createQueue(t, b, "q.fifo", memory.QueueConfig{FIFO: true})
	err := b.Publish(context.Background(), "q.fifo",
		consumer.Message{ID: "ok", Key: "g"}, consumer.Message{ID: "nokey"})
	var perr *consumer.PublishError
	if !errors.As(err, &perr) || len(perr.Failed) != 1 || perr.Failed[0].Index != 1 ||
		!errors.Is(err, memory.ErrInvalidMessage) {
		t.Fatalf("Publish without Key = %v, want a PublishError for #1 wrapping ErrInvalidMessage", err)
	}
	got := b.Messages("q.fifo")
	if len(got) != 1 || got[0].ID != "ok" {
		t.Fatalf("Messages = %v, want only the valid message", got)
	}
}

func TestFIFODropsDuplicateIDs(t *testing.T) {
	b := newBroker(t)
	createQueue(t, b, "q.fifo", memory.QueueConfig{FIFO: true})
	publish(t, b, "q.fifo", consumer.Message{ID: "m1", Key: "g", Body: []byte("first")})
	publish(t, b, "q.fifo", consumer.Message{ID: "m1", Key: "g", Body: []byte("again")})
	got := b.Messages("q.fifo")
	if len(got) != 1 || string(got[0].Body) != "first" {
		t.Fatalf("Messages = %v, want only the first m1", got)
	}

	nodedup := newBroker(t, memory.WithDedupWindow(0))
	createQueue(t, nodedup, "q.fifo", memory.QueueConfig{FIFO: true})
	publish(t, nodedup, "q.fifo", consumer.Message{ID: "m1", Key: "g"}, consumer.Message{ID: "m1", Key: "g"})
	if n := len(nodedup.Messages("q.fifo")); n != 2 {
		t.Fatalf("with dedup off: %d messages, want 2", n)
	}
}

func TestMaxReceiveCountMovesToDeadLetterQueue(t *testing.T) {
	b := newBroker(t)
	createQueue(t, b, "dlq", memory.QueueConfig{})
	createQueue(t, b, "q", memory.QueueConfig{MaxReceiveCount: 2, DeadLetterQueue: "dlq"})
	d := newDriver(t, b, "q")
	publish(t, b, "q", consumer.Message{ID: "poison", Key: "k", Body: []byte("bad"), Headers: map[string]string{"trace": "t1"}})

	for attempt := 1; attempt <= 2; attempt++ {
		m := fetch(t, d, 1)[0]
		if m.Deliveries != attempt {
			t.Fatalf("delivery %d has Attempt %d", attempt, m.Deliveries)
		}
		settle(t, d, ret(m, 0))
	}
	// The third receive moves it to the dead-letter queue instead.
	fetchNothing(t, d, 50*time.Millisecond)
	wantStats(t, b, "q", memory.QueueStats{DeadLettered: 1})
	wantStats(t, b, "dlq", memory.QueueStats{Visible: 1})

	dead := b.Messages("dlq")
	if len(dead) != 1 {
		t.Fatalf("dead-letter queue holds %d messages, want 1", len(dead))
	}
	m := dead[0]
	if m.ID != "poison" || m.Key != "k" || string(m.Body) != "bad" || m.Headers["trace"] != "t1" ||
		m.Headers[memory.HeaderSourceQueue] != "q" || m.Headers[memory.HeaderReceiveCount] != "2" {
		t.Fatalf("dead-lettered message = %+v", m)
	}
	got := fetch(t, newDriver(t, b, "dlq"), 1)[0]
	if got.ID != "poison" || got.Deliveries != 1 || got.Source != "dlq" {
		t.Fatalf("delivery from the dead-letter queue = %+v", got)
	}
}

func TestFIFODeadLetteringUnblocksTheGroup(t *testing.T) {
	b := newBroker(t)
	createQueue(t, b, "dlq.fifo", memory.QueueConfig{FIFO: true})
	createQueue(t, b, "q.fifo", memory.QueueConfig{FIFO: true, MaxReceiveCount: 1, DeadLetterQueue: "dlq.fifo"})
	d := newDriver(t, b, "q.fifo")
	publish(t, b, "q.fifo", consumer.Message{ID: "a1", Key: "a"}, consumer.Message{ID: "a2", Key: "a"})
	settle(t, d, ret(fetch(t, d, 10)[0], 0))
	next := fetch(t, d, 10)
	if got := ids(next); len(got) != 1 || got[0] != "a2" {
		t.Fatalf("after a1 used its receives: %v, want [a2]", got)
	}
	dead := b.Messages("dlq.fifo")
	if len(dead) != 1 || dead[0].ID != "a1" || dead[0].Lane != "a" {
		t.Fatalf("dead-letter queue = %v, want a1 in group a", dead)
	}
}

func TestPublishCopiesBodyAndHeaders(t *testing.T) {
	b := newBroker(t)
	d := newDriver(t, b, "q")
	body := []byte("original")
	headers := map[string]string{"h": "original"}
	publish(t, b, "q", consumer.Message{ID: "m1", Body: body, Headers: headers})
	copy(body, "mutated!")
	headers["h"] = "mutated"

	m := fetch(t, d, 1)[0]
	if string(m.Body) != "original" || m.Headers["h"] != "original" {
		t.Fatalf("delivered body %q, header %q; want the published values", m.Body, m.Headers["h"])
	}
	// A handler that scribbles on its delivery does not change the stored message.
	copy(m.Body, "scribble")
	m.Headers["h"] = "scribble"
	_ = append(m.Body, "more"...)
	settle(t, d, ret(m, 0))
	again := fetch(t, d, 1)[0]
	if string(again.Body) != "original" || again.Headers["h"] != "original" {
		t.Fatalf("redelivered body %q, header %q; want the published values", again.Body, again.Headers["h"])
	}
}

func TestCloseUnblocksFetch(t *testing.T) {
	b, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	d, err := b.Driver(t.Context(), "q", driver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() {
		_, err := d.Fetch(context.Background(), nil, 10)
		errc <- err
	}()
	waitUntilFetching(t, b, "q")
	if err := b.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := b.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	select {
	case err := <-errc:
		if !errors.Is(err, memory.ErrClosed) || !driver.IsFatal(err) {
			t.Fatalf("Fetch after Close = %v, want a fatal ErrClosed", err)
		}
	case <-time.After(patience):
		t.Fatal("Fetch still blocked after Close")
	}
	if err := b.Publish(context.Background(), "q", msg("m", "x")); !errors.Is(err, memory.ErrClosed) {
		t.Fatalf("Publish after Close = %v, want ErrClosed", err)
	}
}

func TestDriverCloseUnblocksFetch(t *testing.T) {
	b := newBroker(t)
	d, err := b.Driver(t.Context(), "q", driver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() {
		_, err := d.Fetch(context.Background(), nil, 10)
		errc <- err
	}()
	waitUntilFetching(t, b, "q")
	_ = d.Close()
	select {
	case err := <-errc:
		if !errors.Is(err, memory.ErrClosed) || !driver.IsFatal(err) {
			t.Fatalf("Fetch after driver Close = %v, want a fatal ErrClosed", err)
		}
	case <-time.After(patience):
		t.Fatal("Fetch still blocked after the driver's Close")
	}
	// The broker goes on.
	publish(t, b, "q", msg("m", "x"))
	fetch(t, newDriver(t, b, "q"), 1)
}

func TestFetchReturnsWhenContextEnds(t *testing.T) {
	b := newBroker(t)
	d := newDriver(t, b, "q")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := d.Fetch(ctx, nil, 1); !errors.Is(err, context.Canceled) {
		t.Fatalf("Fetch with a cancelled context = %v, want context.Canceled", err)
	}
}

func TestFetchWakesOnPublish(t *testing.T) {
	b := newBroker(t)
	d := newDriver(t, b, "q")
	got := make(chan []driver.Message, 1)
	go func() {
		ms, _ := d.Fetch(context.Background(), nil, 10)
		got <- ms
	}()
	waitUntilFetching(t, b, "q")
	publish(t, b, "q", msg("m1", "x"))
	select {
	case ms := <-got:
		if len(ms) != 1 || ms[0].ID != "m1" {
			t.Fatalf("Fetch = %v, want [m1]", ids(ms))
		}
	case <-time.After(patience):
		t.Fatal("a waiting Fetch did not see a publish")
	}
}

func TestLagReportsDepthInFlightAndOldestAge(t *testing.T) {
	b := newBroker(t)
	d := newDriver(t, b, "q")
	if lag := lagOf(t, d); lag.Messages != 0 || lag.InFlight != 0 || lag.OldestAge != 0 {
		t.Fatalf("Lag of an empty queue = %+v", lag)
	}
	start := time.Now()
	publish(t, b, "q", msg("m1", "x"), msg("m2", "y"), msg("m3", "z"))
	m := fetch(t, d, 1)[0]
	for time.Since(start) < 20*time.Millisecond {
		time.Sleep(5 * time.Millisecond)
	}
	lag := lagOf(t, d)
	if lag.Messages != 2 || lag.InFlight != 1 || lag.OldestAge < 20*time.Millisecond {
		t.Fatalf("Lag = %+v, want 2 waiting, 1 in flight, oldest >= 20ms", lag)
	}
	settle(t, d, ack(m))
	if lag := lagOf(t, d); lag.Messages != 2 || lag.InFlight != 0 {
		t.Fatalf("Lag after ack = %+v", lag)
	}
}

func TestBadConfigNamesTheField(t *testing.T) {
	b := newBroker(t)
	createQueue(t, b, "dlq", memory.QueueConfig{})
	createQueue(t, b, "dlq.fifo", memory.QueueConfig{FIFO: true})
	cases := []struct {
		name  string
		queue string
		cfg   memory.QueueConfig
		field string
	}{
		{"empty name", "", memory.QueueConfig{}, "queue"},
		{"negative visibility", "q", memory.QueueConfig{VisibilityTimeout: -time.Second}, "QueueConfig.VisibilityTimeout"},
		{"negative max receive", "q", memory.QueueConfig{MaxReceiveCount: -1}, "QueueConfig.MaxReceiveCount"},
		{"max receive without DLQ", "q", memory.QueueConfig{MaxReceiveCount: 3}, "QueueConfig.DeadLetterQueue"},
		{"DLQ without max receive", "q", memory.QueueConfig{DeadLetterQueue: "dlq"}, "QueueConfig.MaxReceiveCount"},
		{"DLQ missing", "q", memory.QueueConfig{MaxReceiveCount: 3, DeadLetterQueue: "nope"}, "QueueConfig.DeadLetterQueue"},
		{"DLQ is itself", "q", memory.QueueConfig{MaxReceiveCount: 3, DeadLetterQueue: "q"}, "QueueConfig.DeadLetterQueue"},
		{"FIFO with standard DLQ", "q.fifo", memory.QueueConfig{FIFO: true, MaxReceiveCount: 3, DeadLetterQueue: "dlq"}, "QueueConfig.DeadLetterQueue"},
		{"standard with FIFO DLQ", "q", memory.QueueConfig{MaxReceiveCount: 3, DeadLetterQueue: "dlq.fifo"}, "QueueConfig.DeadLetterQueue"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := b.CreateQueue(c.queue, c.cfg)
			var ce *consumer.ConfigError
			if !errors.As(err, &ce) || ce.Field != c.field || !errors.Is(err, consumer.ErrInvalidConfig) {
				t.Fatalf("CreateQueue = %v, want a ConfigError naming %s", err, c.field)
			}
		})
	}
	var ce *consumer.ConfigError
	if err := b.Publish(context.Background(), "", msg("m", "x")); !errors.As(err, &ce) || ce.Field != "queue" {
		t.Fatalf("Publish to \"\" = %v, want a ConfigError naming queue", err)
	}
	if _, err := b.Driver(t.Context(), "", driver.Config{}); !errors.As(err, &ce) || ce.Field != "queue" {
		t.Fatalf("Driver(\"\") = %v, want a ConfigError naming queue", err)
	}
	if nb, err := memory.New(memory.WithDedupWindow(-time.Second)); !errors.As(err, &ce) || ce.Field != "DedupWindow" || nb != nil {
		t.Fatalf("New(WithDedupWindow(-1s)) = %v, %v; want no broker and a ConfigError naming DedupWindow", nb, err)
	}
}

func TestCreateQueueIsIdempotent(t *testing.T) {
	b := newBroker(t)
	createQueue(t, b, "q", memory.QueueConfig{VisibilityTimeout: time.Minute})
	createQueue(t, b, "q", memory.QueueConfig{VisibilityTimeout: time.Minute})
	if err := b.CreateQueue("q", memory.QueueConfig{FIFO: true}); !errors.Is(err, memory.ErrQueueExists) {
		t.Fatalf("CreateQueue with another config = %v, want ErrQueueExists", err)
	}
	// The default visibility timeout is 30s, whether said or left zero.
	createQueue(t, b, "d", memory.QueueConfig{})
	createQueue(t, b, "d", memory.QueueConfig{VisibilityTimeout: memory.DefaultVisibilityTimeout})
	if lease := newDriver(t, b, "d").(driver.Extender).Lease(); lease != 30*time.Second {
		t.Fatalf("default lease = %s, want 30s", lease)
	}
}

func TestAutoCreate(t *testing.T) {
	b := newBroker(t)
	publish(t, b, "new", msg("m1", "x"))
	if got := b.Stats("new"); got.Visible != 1 {
		t.Fatalf("Stats of an auto-created queue = %+v", got)
	}

	strict := newBroker(t, memory.WithAutoCreate(false))
	if err := strict.Publish(context.Background(), "new", msg("m1", "x")); !errors.Is(err, memory.ErrQueueNotFound) {
		t.Fatalf("Publish to a missing queue = %v, want ErrQueueNotFound", err)
	}
	if _, err := strict.Driver(t.Context(), "new", driver.Config{}); !errors.Is(err, memory.ErrQueueNotFound) {
		t.Fatalf("Driver of a missing queue = %v, want ErrQueueNotFound", err)
	}
	if _, err := strict.NewConsumer(t.Context(), "new"); !errors.Is(err, memory.ErrQueueNotFound) {
		t.Fatalf("NewConsumer of a missing queue = %v, want ErrQueueNotFound", err)
	}
	if got := strict.Stats("new"); got != (memory.QueueStats{}) {
		t.Fatalf("Stats created a queue: %+v", got)
	}
}

func TestMessagesIsASnapshotInOrder(t *testing.T) {
	b := newBroker(t)
	d := newDriver(t, b, "q")
	publish(t, b, "q", msg("m1", "a"), msg("m2", "b"), msg("m3", "c"))
	ms := fetch(t, d, 1)
	settle(t, d, ack(ms[0]))
	fetch(t, d, 1) // m2, in flight
	got := b.Messages("q")
	if len(got) != 2 || got[0].ID != "m2" || got[0].Deliveries != 1 || got[1].ID != "m3" || got[1].Deliveries != 0 {
		t.Fatalf("Messages = %+v, want m2 (received once) and m3", got)
	}
	got[0].Body[0] = 'X'
	if again := b.Messages("q"); string(again[0].Body) != "b" {
		t.Fatalf("changing the snapshot changed the queue: %q", again[0].Body)
	}
	if b.Messages("missing") != nil {
		t.Fatal("Messages of a missing queue is not nil")
	}
}

func lagOf(t testing.TB, d driver.Driver) driver.Lag {
	t.Helper()
	lag, err := d.(driver.LagReporter).Lag(context.Background())
	if err != nil {
		t.Fatalf("Lag: %v", err)
	}
	return lag
}

func ids(ms []driver.Message) []string {
	out := make([]string, len(ms))
	for i, m := range ms {
		out[i] = m.ID
	}
	return out
}

// A fetch that waits while the only message is in flight must still see the
// message when it comes back sooner (a return with a short delay), however
// often the queue was waited on before.
func TestWaitingFetchSeesAnEarlierDeadline(t *testing.T) {
	b := newBroker(t)
	d := newDriver(t, b, "q")
	publish(t, b, "q", msg("m1", "x"))
	m := fetch(t, d, 1)[0]
	for attempt := 2; attempt <= 4; attempt++ {
		got := make(chan []driver.Message, 1)
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), patience)
			defer cancel()
			ms, _ := d.Fetch(ctx, nil, 1)
			got <- ms
		}()
		waitUntilFetching(t, b, "q")
		settle(t, d, ret(m, 10*time.Millisecond))
		ms := <-got
		if len(ms) != 1 || ms[0].Deliveries != attempt {
			t.Fatalf("attempt %d: fetched %v", attempt, ids(ms))
		}
		m = ms[0]
	}
}

// A message held in flight for long while thousands behind it are acked
// neither keeps them alive nor loses its own place.
func TestLongHeldMessageAmongManyAcked(t *testing.T) {
	b := newBroker(t)
	d := newDriver(t, b, "q")
	const n = 3000
	batch := make([]consumer.Message, n)
	for i := range batch {
		batch[i] = msg("", "x")
	}
	publish(t, b, "q", batch...)
	held := fetch(t, d, 1)[0]
	for acked := 1; acked < n; {
		ms := fetch(t, d, 100)
		ss := make([]driver.Settlement, len(ms))
		for i, m := range ms {
			ss[i] = ack(m)
		}
		settle(t, d, ss...)
		acked += len(ms)
	}
	got := b.Messages("q")
	if len(got) != 1 || got[0].ID != held.ID {
		t.Fatalf("Messages = %d messages, want only the held one", len(got))
	}
	publish(t, b, "q", msg("late", "y"))
	if got := b.Messages("q"); len(got) != 2 || got[0].ID != held.ID || got[1].ID != "late" {
		t.Fatalf("Messages = %v, want the held message, then late", got)
	}
	wantStats(t, b, "q", memory.QueueStats{Visible: 1, InFlight: 1, Acked: n - 1})
}

// A FIFO group that emptied out and is used again delivers again.
func TestFIFOGroupIsReusedAfterItEmptied(t *testing.T) {
	b := newBroker(t)
	createQueue(t, b, "q.fifo", memory.QueueConfig{FIFO: true})
	d := newDriver(t, b, "q.fifo")
	for i := range 3 {
		id := fmt.Sprintf("a%d", i)
		publish(t, b, "q.fifo", consumer.Message{ID: id, Key: "a"})
		m := fetch(t, d, 10)
		if len(m) != 1 || m[0].ID != id {
			t.Fatalf("round %d: fetched %v, want [%s]", i, ids(m), id)
		}
		settle(t, d, ack(m[0]))
	}
}
