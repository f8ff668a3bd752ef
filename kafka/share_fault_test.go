package kafka_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
)

// newShareGroup names a share group for a test and gives it the test lock
// (shareLease) and, when limit > 0, that delivery count limit.
func newShareGroup(t *testing.T, prefix string, limit int) string {
	t.Helper()
	group := testenv.UniqueName(t, prefix)
	set := map[string]string{"share.record.lock.duration.ms": strconv.Itoa(int(shareLease.Milliseconds()))}
	if limit > 0 {
		set["share.delivery.count.limit"] = strconv.Itoa(limit)
	}
	setGroupConfig(t, group, set)
	return group
}

// publishN publishes n records with bodies prefix-0 ... prefix-(n-1).
func publishN(t *testing.T, b *kafka.Broker, topic, prefix string, n int) {
	t.Helper()
	ms := make([]consumer.Message, n)
	for i := range ms {
		ms[i] = consumer.Message{Body: fmt.Appendf(nil, "%s-%d", prefix, i)}
	}
	if err := b.Publish(testenv.Context(t, 60*time.Second), topic, ms...); err != nil {
		t.Fatal(err)
	}
}

// tally counts handler runs by body, and which consumers ran them.
type tally struct {
	mu   sync.Mutex
	runs map[string]int
	by   map[string]int // consumer -> successful runs
}

func (c *tally) add(body, by string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.runs == nil {
		c.runs, c.by = make(map[string]int), make(map[string]int)
	}
	c.runs[body]++
	c.by[by]++
	return c.runs[body]
}

func (c *tally) distinct() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.runs)
}

// TestShareMembersShareOnePartition: eight share group members on a topic
// of one partition, each running one handler at a time, all get work (a
// consumer group would give the partition to one of them), and every
// record is handled exactly once.
func TestShareMembersShareOnePartition(t *testing.T) {
	b := newBroker(t, kafka.WithGroupProtocol(kafka.Share))
	topic := newTopic(t, b, "share-many", 1)
	group := newShareGroup(t, "share-many", 0)
	const n, members = 400, 8
	publishN(t, b, topic, "r", n)
	var c tally
	for i := range members {
		name := fmt.Sprint("member-", i)
		l, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group), consumer.WithConcurrency(1), consumer.WithMaxInFlight(2))
		if err != nil {
			t.Fatal(err)
		}
		runConsumer(t, l, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			time.Sleep(5 * time.Millisecond)
			c.add(string(m.Body), name)
			return nil
		}))
	}
	testenv.WaitFor(t, 90*time.Second, fmt.Sprintf("all %d records handled", n), func() bool { return c.distinct() == n })
	time.Sleep(time.Second) // long enough for a duplicate to show
	c.mu.Lock()
	defer c.mu.Unlock()
	for body, runs := range c.runs {
		if runs != 1 {
			t.Errorf("%s handled %d times, want once", body, runs)
		}
	}
	busy := 0
	for _, k := range c.by {
		if k > 0 {
			busy++
		}
	}
	if busy < members/2 {
		t.Errorf("only %d of %d members handled records (%v); members of a share group share a partition", busy, members, c.by)
	}
}

// TestSharePoisonIsDeadLetteredWithItsStory: a record that always fails is
// retried in place and, once the Standard stack's budget is spent, goes to
// the dead-letter topic with its story, on its first delivery: the
// broker's delivery count never reaches its limit (here 2), so it never
// archives the record, and the good records are all handled.
func TestSharePoisonIsDeadLetteredWithItsStory(t *testing.T) {
	b := newBroker(t, kafka.WithGroupProtocol(kafka.Share))
	topic := newTopic(t, b, "share-poison", 1)
	dlq := newTopic(t, b, "share-poison-dlq", 1)
	group := newShareGroup(t, "share-poison", 2)
	publishN(t, b, topic, "good", 30)
	if err := b.Publish(testenv.Context(t, 30*time.Second), topic, consumer.Message{Body: []byte("poison"), Headers: map[string]string{"tenant": "acme"}}); err != nil {
		t.Fatal(err)
	}
	publishN(t, b, topic, "late", 30)
	stack, err := consumer.Standard(b, dlq,
		consumer.StandardRetry(consumer.RetryAttempts(2), consumer.RetryInitial(10*time.Millisecond)),
		consumer.StandardDeadLetter(consumer.DeadLetterMaxAttempts(5)))
	if err != nil {
		t.Fatal(err)
	}
	l, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group), consumer.WithRedeliveryBackoff(50*time.Millisecond, 200*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	var c tally
	var poisonDeliveries atomic.Int32
	runConsumer(t, l, stack.Wrap(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if string(m.Body) == "poison" {
			poisonDeliveries.Store(int32(m.Deliveries))
			return errors.New("cannot be handled")
		}
		c.add(string(m.Body), "")
		return nil
	})))
	testenv.WaitFor(t, 60*time.Second, "the 60 good records handled and the poison dead-lettered", func() bool {
		return c.distinct() == 60 && stack.DeadLetter.Count() == 1
	})
	if d := poisonDeliveries.Load(); d != 1 {
		t.Errorf("the poison was handled on delivery %d; failures are retried in place, on the first", d)
	}
	dead := consumeAll(t, b, dlq, 1)
	m := dead[0]
	if string(m.Body) != "poison" || m.Header("tenant") != "acme" || m.Header(consumer.HeaderDLQSource) != topic ||
		m.Header(consumer.HeaderDLQAttempts) != "5" || m.Header(consumer.HeaderDLQDeliveries) != "1" ||
		!strings.Contains(m.Header(consumer.HeaderDLQError), "cannot be handled") {
		t.Errorf("dead letter %q with headers %v does not tell the story", m.Body, m.Headers)
	}
	testenv.WaitFor(t, 30*time.Second, "the share group's lag to reach 0", func() bool {
		lag, err := l.Lag(testenv.Context(t, 10*time.Second))
		return err == nil && lag.Messages+lag.InFlight == 0
	})
}

// consumeAll reads n records of topic with a consumer group of its own.
func consumeAll(t *testing.T, b *kafka.Broker, topic string, n int) []consumer.Message {
	t.Helper()
	l, err := b.NewConsumer(t.Context(), topic, consumer.WithName(testenv.UniqueName(t, "read")))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var got []consumer.Message
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		done <- l.Run(ctx, consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
			mu.Lock()
			got = append(got, consumer.Message{ID: m.ID, Key: m.Key, Body: m.Body, Headers: m.Headers})
			mu.Unlock()
			return nil
		}))
	}()
	testenv.WaitFor(t, 30*time.Second, fmt.Sprintf("%d records of %s", n, topic), func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(got) >= n
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	return got
}

// TestShareBreakerHoldsRecordsUnderRenewedLocks: while the dependency is
// down for several lock durations, the open breaker holds the records:
// their locks are renewed, no attempt is spent and none is released, so
// when the dependency is back every record is handled once, on its first
// delivery, and the broker archived none.
func TestShareBreakerHoldsRecordsUnderRenewedLocks(t *testing.T) {
	b := newBroker(t, kafka.WithGroupProtocol(kafka.Share))
	topic := newTopic(t, b, "share-hold", 1)
	dlq := newTopic(t, b, "share-hold-dlq", 1)
	group := newShareGroup(t, "share-hold", 2)
	const n = 40
	publishN(t, b, topic, "r", n)
	stack, err := consumer.Standard(b, dlq,
		consumer.StandardRetry(consumer.RetryAttempts(2), consumer.RetryInitial(10*time.Millisecond)),
		// Each half-open trial while the dependency is down is a run of
		// one record: a budget of 10 outlasts the four or so of the outage.
		consumer.StandardBreaker(consumer.BreakerFailures(3), consumer.BreakerOpenFor(2*time.Second)),
		consumer.StandardDeadLetter(consumer.DeadLetterMaxAttempts(10)))
	if err != nil {
		t.Fatal(err)
	}
	l, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group), consumer.WithMaxInFlight(10))
	if err != nil {
		t.Fatal(err)
	}
	var down atomic.Bool
	down.Store(true)
	var c tally
	var lateDeliveries atomic.Int32 // successful runs on a delivery after the first
	runConsumer(t, l, stack.Wrap(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if down.Load() {
			return errors.New("payments down")
		}
		if m.Deliveries != 1 {
			lateDeliveries.Add(1)
		}
		c.add(string(m.Body), "")
		return nil
	})))
	testenv.WaitFor(t, 30*time.Second, "the breaker to open", func() bool { return stack.Breaker.State() == consumer.BreakerOpen })
	time.Sleep(4 * shareLease) // the records' locks would have run out twice over
	down.Store(false)
	testenv.WaitFor(t, 60*time.Second, fmt.Sprintf("all %d records handled", n), func() bool { return c.distinct() == n })
	time.Sleep(time.Second)
	c.mu.Lock()
	for body, runs := range c.runs {
		if runs != 1 {
			t.Errorf("%s handled %d times, want once", body, runs)
		}
	}
	c.mu.Unlock()
	if k := lateDeliveries.Load(); k != 0 {
		t.Errorf("%d records were handled on a later delivery: a held record's lock must be renewed, not run out", k)
	}
	if k := stack.DeadLetter.Count(); k != 0 {
		t.Errorf("%d records dead-lettered while the breaker held them", k)
	}
}

// TestShareRecordGivenBackOnItsLastDeliveryIsReported: with a delivery
// limit of 2, a record whose consumer stops mid-handler twice is archived
// by the broker at the second stop: the consumer that gives it back says so
// at WARN, naming where the broker puts it, and no consumer gets it again.
func TestShareRecordGivenBackOnItsLastDeliveryIsReported(t *testing.T) {
	var logs syncBuffer
	log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	b := newBroker(t, kafka.WithGroupProtocol(kafka.Share), kafka.WithLogger(log))
	topic := newTopic(t, b, "share-last", 1)
	group := newShareGroup(t, "share-last", 2)
	publishN(t, b, topic, "r", 1)
	var seen atomic.Int32
	for stop := 1; stop <= 2; stop++ {
		l, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group), consumer.WithShutdownGrace(50*time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		r := runConsumer(t, l, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			seen.Store(int32(m.Deliveries))
			<-ctx.Done()
			return ctx.Err()
		}))
		testenv.WaitFor(t, 30*time.Second, fmt.Sprintf("delivery %d", stop), func() bool { return seen.Load() == int32(stop) })
		r.stop(t)
	}
	if !strings.Contains(logs.String(), "given back on its last delivery is archived") || !strings.Contains(logs.String(), "dropped: the group has no errors.deadletterqueue.topic.name") {
		t.Errorf("no WARN line says the record given back on its last delivery is archived; logs:\n%s", logs.String())
	}
	var again atomic.Bool
	l, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group))
	if err != nil {
		t.Fatal(err)
	}
	runConsumer(t, l, consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		again.Store(true)
		return nil
	}))
	time.Sleep(3 * time.Second)
	if again.Load() {
		t.Error("the record was delivered a third time; the group's limit is 2")
	}
}

// TestShareLagCountsHeldRecordsOnce: of 30 records, the first five done,
// the next five held by a consumer's running handlers and the rest behind
// them (more may be held once the consumer's other sessions poll), the
// share group's lag (records not acknowledged yet: 25) splits into what
// the consumer holds (InFlight, 5 or more) and the rest (Messages), the
// two adding up to 25; the lane is the share-partition, its position the
// end offset less the lag (5).
func TestShareLagCountsHeldRecordsOnce(t *testing.T) {
	b := newBroker(t, kafka.WithGroupProtocol(kafka.Share))
	topic := newTopic(t, b, "share-lag", 1)
	group := newShareGroup(t, "share-lag", 0)
	publishN(t, b, topic, "r", 30)
	l, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group), consumer.WithMaxInFlight(10), consumer.WithConcurrency(10),
		consumer.WithShutdownGrace(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	var running atomic.Int32
	runConsumer(t, l, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if m.Offset < 5 {
			return nil
		}
		running.Add(1)
		<-ctx.Done()
		return ctx.Err()
	}))
	testenv.WaitFor(t, 30*time.Second, "5 handlers running", func() bool { return running.Load() == 5 })
	var last string
	testenv.WaitFor(t, 30*time.Second, "the lag to count 5 or more held and the rest of 25 waiting", func() bool {
		lag, err := l.Lag(testenv.Context(t, 10*time.Second))
		last = fmt.Sprintf("%+v, %v", lag, err)
		return err == nil && lag.InFlight >= 5 && lag.InFlight+lag.Messages == 25 && lag.Lanes["0"] == 25 && lag.OldestAge > 0
	}, func() string { return "last lag: " + last })
	lag, _ := l.Lag(testenv.Context(t, 10*time.Second))
	if p, ok := lag.Positions["0"]; !ok || p != 5 {
		t.Errorf("position of partition 0 is %d (%t), want 5: its end offset less its lag", p, ok)
	}
}

// TestShareRecordOfAKilledMemberGoesToTheSurvivor: two members of a share
// group in separate processes; one is SIGKILLed while a handler runs. The
// records it held come back when their locks run out and the survivor
// handles them: every record is handled, none lost.
func TestShareRecordOfAKilledMemberGoesToTheSurvivor(t *testing.T) {
	b := newBroker(t)
	topic := newTopic(t, b, "share-kill", 1)
	group := newShareGroup(t, "share-kill", 0)
	const n = 300
	var recs []*kgo.Record
	for i := range n {
		recs = append(recs, &kgo.Record{Topic: topic, Partition: 0, Value: fmt.Appendf(nil, "%d", i)})
	}
	produceRaw(t, recs...)
	victim := startChild(t, kafka.Share, topic, group, 40, 10*time.Second)
	testenv.WaitFor(t, 60*time.Second, "the victim to block in a handler", func() bool { _, _, blocked := victim.state(); return blocked })
	survivor := startChild(t, kafka.Share, topic, group, 0, 10*time.Second)
	testenv.WaitFor(t, 30*time.Second, "the survivor to handle records", func() bool { h, _, _ := survivor.state(); return len(h) > 0 })
	victim.kill(t)
	victimHandled, _, _ := victim.state()
	testenv.WaitFor(t, 90*time.Second, fmt.Sprintf("every one of the %d records handled", n), func() bool {
		h, _, _ := survivor.state()
		for o := range int64(n) {
			if h[[2]int64{0, o}] == 0 && victimHandled[[2]int64{0, o}] == 0 {
				return false
			}
		}
		return true
	})
	// The record the victim was killed on was never acknowledged: the
	// survivor must have had it once its lock ran out.
	h, _, _ := survivor.state()
	victim.mu.Lock()
	at := victim.blockAt
	victim.mu.Unlock()
	if h[at] == 0 {
		t.Errorf("the record the victim was killed on (partition %d offset %d) was never handled by the survivor", at[0], at[1])
	}
	t.Logf("the victim handled %d records, the survivor %d", len(victimHandled), len(h))
}

// shareDriverOf opens a share group member's driver of topic, outside any
// loop, closed when the test ends.
func shareDriverOf(t *testing.T, b *kafka.Broker, topic, group string, maxInFlight int) driver.Driver {
	t.Helper()
	d, err := b.Driver(t.Context(), topic, driver.Config{Name: group, MaxInFlight: maxInFlight})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	if err := d.(driver.Connector).Connect(testenv.Context(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	return d
}

// fetchN fetches until n deliveries came.
func fetchN(t *testing.T, d driver.Driver, n int) []driver.Message {
	t.Helper()
	var got []driver.Message
	ctx := testenv.Context(t, 30*time.Second)
	for len(got) < n {
		var err error
		got, err = d.Fetch(ctx, got, n-len(got))
		if err != nil {
			t.Fatalf("fetch: %v (after %d of %d)", err, len(got), n)
		}
	}
	return got
}

// TestShareLapsedLockSpoilsNoOtherAcknowledgement: the broker refuses a
// partition's acknowledgements of one request as a whole when one record
// among them lost its lock. Of three records, the first is left to lapse
// while the other two are renewed; settling the three together, the two
// are accepted (never delivered again) and only the first fails; and a
// renewal the broker refused is not sent again, so it spoils no later
// renewal of the others.
func TestShareLapsedLockSpoilsNoOtherAcknowledgement(t *testing.T) {
	b := newBroker(t, kafka.WithGroupProtocol(kafka.Share))
	topic := newTopic(t, b, "share-lapse", 1)
	group := newShareGroup(t, "share-lapse", 0)
	publishN(t, b, topic, "r", 3)
	d := shareDriverOf(t, b, topic, group, 3)
	ms := fetchN(t, d, 3)
	ext := d.(driver.Extender)
	if l := ext.Lease(); l < time.Second || l > shareLease {
		t.Fatalf("Lease = %s, want about the group's %s", l, shareLease)
	}
	handles := func(ms []driver.Message) []any {
		var hs []any
		for _, m := range ms {
			hs = append(hs, m.Handle)
		}
		return hs
	}
	ctx := testenv.Context(t, 30*time.Second)
	for end := time.Now().Add(2*shareLease + 500*time.Millisecond); time.Now().Before(end); time.Sleep(shareLease / 3) {
		if err := ext.Extend(ctx, handles(ms[1:]), shareLease); err != nil {
			t.Fatalf("renewing the two live records: %v", err)
		}
	}
	// The first record's lock ran out long ago: its renewal is refused,
	// and then left out.
	if err := ext.Extend(ctx, handles(ms), shareLease); err == nil {
		t.Error("renewing a record whose lock ran out succeeded")
	}
	if err := ext.Extend(ctx, handles(ms), shareLease); err != nil {
		t.Errorf("renewing after the lapsed record was found out: %v; it must be left out", err)
	}
	err := d.Settle(ctx, []driver.Settlement{{Handle: ms[0].Handle}, {Handle: ms[1].Handle}, {Handle: ms[2].Handle}})
	var se *driver.SettleError
	if !errors.As(err, &se) || !slices.Equal(se.Failed, []int{0}) {
		t.Fatalf("Settle = %v, want the lapsed record's acknowledgement alone to fail", err)
	}
	// Only the lapsed record comes again, on its second delivery.
	other := shareDriverOf(t, b, topic, group, 10)
	again := fetchN(t, other, 1)
	if string(again[0].Body) != string(ms[0].Body) || again[0].Deliveries != 2 {
		t.Errorf("delivered again: %q on delivery %d, want %q on delivery 2", again[0].Body, again[0].Deliveries, ms[0].Body)
	}
	if err := other.Settle(ctx, []driver.Settlement{{Handle: again[0].Handle}}); err != nil {
		t.Fatal(err)
	}
	fctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	if more, _ := other.Fetch(fctx, nil, 10); len(more) > 0 {
		t.Errorf("accepted records delivered again: %q", more[0].Body)
	}
}

// TestShareSettleAfterCloseFails: a delivery Close gave back (the Broker
// closed under a running loop) cannot be accepted afterwards, and Settle
// says so rather than report an acknowledgement it did not make.
func TestShareSettleAfterCloseFails(t *testing.T) {
	b := newBroker(t, kafka.WithGroupProtocol(kafka.Share))
	topic := newTopic(t, b, "share-closed", 1)
	group := newShareGroup(t, "share-closed", 0)
	publishN(t, b, topic, "r", 1)
	d := shareDriverOf(t, b, topic, group, 1)
	ms := fetchN(t, d, 1)
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	err := d.Settle(testenv.Context(t, 10*time.Second), []driver.Settlement{{Handle: ms[0].Handle}})
	var se *driver.SettleError
	if !errors.As(err, &se) || !slices.Equal(se.Failed, []int{0}) {
		t.Errorf("Settle after Close = %v, want the settlement to fail", err)
	}
}

// TestShareLockShortenedAtRunTimeIsKept: the group's lock is 30 s when
// the consumer connects and 2 s when its record comes; the consumer renews
// by the lock its poll shows, so a handler of several seconds keeps its
// record from a second member.
func TestShareLockShortenedAtRunTimeIsKept(t *testing.T) {
	b := newBroker(t, kafka.WithGroupProtocol(kafka.Share))
	topic := newTopic(t, b, "share-relock", 1)
	group := testenv.UniqueName(t, "share-relock")
	setGroupConfig(t, group, map[string]string{"share.record.lock.duration.ms": "30000"})
	var c tally
	for _, name := range []string{"first", "second"} {
		l, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group), consumer.WithConcurrency(1), consumer.WithMaxInFlight(1))
		if err != nil {
			t.Fatal(err)
		}
		runConsumer(t, l, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			c.add(string(m.Body), name)
			return sleepCtx(ctx, 4*shareLease)
		}))
		if name == "first" {
			testenv.WaitFor(t, 20*time.Second, "the first consumer to connect", func() bool { return l.Health().State != consumer.HealthStarting })
		}
	}
	setGroupConfig(t, group, map[string]string{"share.record.lock.duration.ms": strconv.Itoa(int(shareLease.Milliseconds()))})
	publishN(t, b, topic, "r", 1)
	testenv.WaitFor(t, 30*time.Second, "the record handled", func() bool { return c.distinct() == 1 })
	time.Sleep(5 * shareLease)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.runs["r-0"] != 1 {
		t.Errorf("the record ran %d times (%v); its lock must be renewed by the lock its poll shows", c.runs["r-0"], c.by)
	}
}

// TestShareLagOfAGroupThatStartsAtTheEnd: a share group set to start at
// the latest records has nothing behind it before its first
// acknowledgement, however many records the topic holds.
func TestShareLagOfAGroupThatStartsAtTheEnd(t *testing.T) {
	b := newBroker(t, kafka.WithGroupProtocol(kafka.Share))
	topic := newTopic(t, b, "share-latest", 1)
	group := testenv.UniqueName(t, "share-latest")
	setGroupConfig(t, group, map[string]string{"share.auto.offset.reset": "latest"})
	publishN(t, b, topic, "old", 10)
	d := shareDriverOf(t, b, topic, group, 10)
	lag, err := d.(driver.LagReporter).Lag(testenv.Context(t, 10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if lag.Messages != 0 || lag.InFlight != 0 {
		t.Errorf("Lag = %d waiting, %d held; a group that starts at the end has none", lag.Messages, lag.InFlight)
	}
}

// TestCloseEndsARunThatCannotConnect: a consumer whose topic does not
// exist retries its Connect; closing the Broker ends its Run with
// ErrClosed (its client is closed, and no retry gets through), under
// every kind of group.
func TestCloseEndsARunThatCannotConnect(t *testing.T) {
	for _, p := range []kafka.GroupProtocol{kafka.Classic, kafka.NextGen, kafka.Share} {
		t.Run(p.String(), func(t *testing.T) {
			b, err := kafka.New(testenv.RequireKafka(t), kafka.WithGroupProtocol(p), kafka.WithLogger(testLogger(t)))
			if err != nil {
				t.Fatal(err)
			}
			l, err := b.NewConsumer(t.Context(), testenv.UniqueName(t, "missing"), consumer.WithName(testenv.UniqueName(t, "g")))
			if err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() {
				done <- l.Run(context.Background(), consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }))
			}()
			testenv.WaitFor(t, 20*time.Second, "the consumer to say the topic is missing", func() bool { return l.Stats().FetchErrors > 0 || l.Health().State == consumer.HealthDisconnected })
			b.Close()
			select {
			case err := <-done:
				if !errors.Is(err, kafka.ErrClosed) {
					t.Errorf("Run = %v, want an error wrapping kafka.ErrClosed", err)
				}
			case <-time.After(20 * time.Second):
				t.Fatal("Run went on for 20 s after the Broker closed")
			}
		})
	}
}

// TestShareRecordsWaitingForRoomKeepTheirLocks: a poll brings more records
// than the loop has room for; those that wait in the driver keep their
// locks, renewed by the driver itself while they wait and when the loop
// takes them late (it reckons their lease from then), so each can still be
// accepted several locks' length after the poll; a record the loop took
// and nobody renewed loses its lock.
func TestShareRecordsWaitingForRoomKeepTheirLocks(t *testing.T) {
	b := newBroker(t, kafka.WithGroupProtocol(kafka.Share))
	topic := newTopic(t, b, "share-wait", 1)
	group := newShareGroup(t, "share-wait", 0)
	publishN(t, b, topic, "r", 3)
	d := shareDriverOf(t, b, topic, group, 3)
	ctx := testenv.Context(t, 30*time.Second)
	first := fetchN(t, d, 1)       // the poll brings three
	time.Sleep(shareLease * 3 / 4) // the waiting records' locks are past two thirds gone
	second, err := d.Fetch(ctx, nil, 1)
	if err != nil || len(second) != 1 {
		t.Fatalf("Fetch(1) = %d messages, %v", len(second), err)
	}
	time.Sleep(shareLease * 3 / 4) // a lock's length and more since the poll
	if err := d.Settle(ctx, []driver.Settlement{{Handle: second[0].Handle}}); err != nil {
		t.Errorf("accepting a record taken late: %v; its lock must have been renewed when the loop took it", err)
	}
	time.Sleep(2 * shareLease) // the third record waits two more locks' length, renewed meanwhile
	third, err := d.Fetch(ctx, nil, 1)
	if err != nil || len(third) != 1 {
		t.Fatalf("Fetch(1) of the record that waited = %d messages, %v", len(third), err)
	}
	if err := d.Settle(ctx, []driver.Settlement{{Handle: third[0].Handle}}); err != nil {
		t.Errorf("accepting a record that waited for %s: %v; the driver must renew what waits in it", 3*shareLease, err)
	}
	if err := d.Settle(ctx, []driver.Settlement{{Handle: first[0].Handle, Action: driver.Return}}); err == nil {
		t.Error("giving back a record whose lock ran out succeeded")
	}
}

// TestShareCloseIsBoundedWhenTheClusterIsSilent: a share group consumer
// whose cluster stops answering (its connections stay open, nothing comes
// back) closes within seconds and says at WARN that its member could not
// leave the group; franz-go's leave waited for an answer for over a
// minute. The record it held comes back to another member when its lock
// runs out.
func TestShareCloseIsBoundedWhenTheClusterIsSilent(t *testing.T) {
	var logs syncBuffer
	log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	admin := newBroker(t, kafka.WithGroupProtocol(kafka.Share))
	topic := newTopic(t, admin, "share-silent", 1)
	group := newShareGroup(t, "share-silent", 0)
	publishN(t, admin, topic, "r", 1)
	p := newProxy(t, "", testenv.KafkaBrokers()[0])
	b := newBroker(t, kafka.WithGroupProtocol(kafka.Share), kafka.WithLogger(log), kafka.WithClientOpts(p.dialer()))
	d := shareDriverOf(t, b, topic, group, 8)
	held := fetchN(t, d, 1)[0]
	p.silence()
	began := time.Now()
	closed := make(chan struct{})
	go func() {
		_ = d.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(40 * time.Second):
		t.Fatal("Close of a share group consumer whose cluster is silent did not return within 40 s")
	}
	t.Logf("Close took %s", time.Since(began))
	if !strings.Contains(logs.String(), "could not leave the group") {
		t.Errorf("no WARN line says the member could not leave the group; logs:\n%s", logs.String())
	}
	got := fetchN(t, shareDriverOf(t, admin, topic, group, 8), 1)[0]
	if string(got.Body) != string(held.Body) || got.Deliveries != 2 {
		t.Errorf("another member got %s on delivery %d; want %s, which the closed consumer held, on its second", got.Body, got.Deliveries, held.Body)
	}
}
