package kafka_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
)

// groupOpts are what the fault tests give every member: a short session
// timeout and frequent heartbeats, so that a dead member is noticed within
// seconds and rebalances settle fast.
func groupOpts(p kafka.GroupProtocol) []kafka.Option {
	return []kafka.Option{
		kafka.WithGroupProtocol(p),
		kafka.WithSessionTimeout(6 * time.Second),
		kafka.WithClientOpts(kgo.HeartbeatInterval(300 * time.Millisecond)),
	}
}

// publishKeyed publishes n records with keys key-(i%keys) and bodies i,
// in batches of 500.
func publishKeyed(t testing.TB, b *kafka.Broker, topic string, from, n, keys int) {
	t.Helper()
	ctx := testenv.Context(t, 60*time.Second)
	for lo := from; lo < from+n; lo += 500 {
		var msgs []consumer.Message
		for i := lo; i < min(lo+500, from+n); i++ {
			msgs = append(msgs, consumer.Message{Key: "key-" + strconv.Itoa(i%keys), Body: []byte(strconv.Itoa(i))})
		}
		if err := b.Publish(ctx, topic, msgs...); err != nil {
			t.Fatalf("publish: %v", err)
		}
	}
}

// endOffsets is the high watermark of each partition of topic.
func endOffsets(t testing.TB, adm *kadm.Client, topic string) map[int32]int64 {
	t.Helper()
	ctx := testenv.Context(t, 10*time.Second)
	ls, err := adm.ListEndOffsets(ctx, topic)
	if err != nil {
		t.Fatalf("list end offsets: %v", err)
	}
	out := make(map[int32]int64)
	ls.Each(func(o kadm.ListedOffset) { out[o.Partition] = o.Offset })
	return out
}

// allOffsets lists every (partition, offset) below the high watermarks.
func allOffsets(ends map[int32]int64) [][2]int64 {
	var out [][2]int64
	for p, end := range ends {
		for o := int64(0); o < end; o++ {
			out = append(out, [2]int64{int64(p), o})
		}
	}
	return out
}

// TestKilledMemberLosesNothing: two members in separate processes; one is
// SIGKILLed while a handler runs. The survivor handles every record the
// dead member had not committed; a record is handled twice only if the dead
// member had it in flight (never past what it committed).
func TestKilledMemberLosesNothing(t *testing.T) {
	forProtocols(t, testKilledMember)
}

func testKilledMember(t *testing.T, proto kafka.GroupProtocol) {
	const n = 3000
	b := newBroker(t)
	topic := newTopic(t, b, "killed", 4)
	group := testenv.UniqueName(t, "killed-group")
	publishKeyed(t, b, topic, 0, n, 997)
	if proto == kafka.NextGen {
		shortenGroupSession(t, group, 6*time.Second)
	}

	ch := startChild(t, proto, topic, group, 200, 6*time.Second)
	testenv.WaitFor(t, 60*time.Second, "the child to handle records", func() bool {
		h, _, _ := ch.state()
		return len(h) >= 50
	})

	var a audit
	sb := newBroker(t, append(groupOpts(proto), a.options()...)...)
	survivor, err := sb.NewConsumer(t.Context(), topic, consumer.WithName(group), consumer.WithConcurrency(4))
	if err != nil {
		t.Fatal(err)
	}
	runConsumer(t, survivor, a.handler("survivor", func(ctx context.Context, m *consumer.Message) error {
		time.Sleep(time.Millisecond)
		return nil
	}))
	testenv.WaitFor(t, 60*time.Second, "the survivor to join and the child to block mid-handler", func() bool {
		_, _, blocked := ch.state()
		return blocked && a.count("done") >= 20
	})
	ch.kill(t)
	childHandled, childCommits, _ := ch.state()

	ends := endOffsets(t, b.Admin(), topic)
	var missing [][2]int64 // at the last look: records neither the survivor handled nor the child committed
	t.Cleanup(func() {
		if t.Failed() && len(missing) > 0 {
			// For whoever reads a timeout: which partitions stalled,
			// and where the survivor was.
			t.Logf("%d records missing, the first %v; the child committed %v; the survivor's stats %+v",
				len(missing), missing[:min(len(missing), 10)], childCommits, survivor.Stats())
		}
	})
	testenv.WaitFor(t, 90*time.Second, "every record the child did not commit to be handled by the survivor", func() bool {
		done := a.doneSet()
		missing = missing[:0]
		for _, po := range allOffsets(ends) {
			if done[po] == 0 && !(childHandled[po] > 0 && po[1] < childCommits[int32(po[0])]) {
				missing = append(missing, po)
			}
		}
		return len(missing) == 0
	})
	done := a.doneSet()
	var dups int
	for po, k := range done {
		if k > 1 {
			t.Errorf("the survivor handled partition %d offset %d %d times", po[0], po[1], k)
		}
		if childHandled[po] > 0 {
			dups++
			if c := childCommits[int32(po[0])]; po[1] < c {
				t.Errorf("partition %d offset %d: handled by the survivor although the killed member had committed up to %d", po[0], po[1], c)
			}
		}
	}
	for _, po := range allOffsets(ends) {
		if done[po] == 0 && childHandled[po] == 0 {
			t.Errorf("partition %d offset %d was never handled", po[0], po[1])
		}
	}
	a.check(t)
	t.Logf("child handled %d records and committed %v; the survivor handled %d, of which %d the child had started (in flight, uncommitted)", len(childHandled), childCommits, len(done), dups)
}

// TestJoiningMemberAndManyRebalances: a third member joins two running
// ones (a cooperative rebalance), then members come and go until the group
// has rebalanced 100 times. No record is lost, none runs again after a
// commit passed it, every commit comes from the partition's owner, and no
// committed offset ever goes down (checked in the members' own log and by
// polling the coordinator).
func TestJoiningMemberAndManyRebalances(t *testing.T) {
	forProtocols(t, func(t *testing.T, proto kafka.GroupProtocol) {
		rebalances := 100
		if proto == kafka.NextGen {
			rebalances = 20 // each KIP-848 reconciliation waits for heartbeats of 5 s at the least
		}
		const n = 6000
		var a audit
		// Frequent commits: every rebalance meets commits in flight.
		opts := append(groupOpts(proto), kafka.WithCommitInterval(100*time.Millisecond))
		b := newBroker(t, append(opts, a.options()...)...)
		topic := newTopic(t, b, "join", 6)
		group := testenv.UniqueName(t, "join-group")
		publishKeyed(t, b, topic, 0, n/2, 500)

		slow := func(ctx context.Context, m *consumer.Message) error {
			return sleepCtx(ctx, 5*time.Millisecond)
		}
		start := func(name string) *running {
			c, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group), consumer.WithConcurrency(8),
				consumer.WithOrdering(consumer.OrderByKey), consumer.WithShutdownGrace(time.Second))
			if err != nil {
				t.Fatal(err)
			}
			return runConsumer(t, c, a.handler(name, slow))
		}
		// The coordinator's view, polled: a committed offset never goes down.
		stopPoll := make(chan struct{})
		var pollErr atomic.Value
		var pollWG sync.WaitGroup
		pollWG.Add(1)
		go func() {
			defer pollWG.Done()
			last := map[int32]int64{}
			for {
				select {
				case <-stopPoll:
					return
				case <-time.After(100 * time.Millisecond):
				}
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				os, err := b.Admin().FetchOffsets(ctx, group)
				cancel()
				if err != nil {
					continue
				}
				os.Each(func(o kadm.OffsetResponse) {
					if o.Topic != topic || o.Err != nil {
						return
					}
					if o.At < last[o.Partition] {
						pollErr.Store(fmt.Sprintf("the coordinator's committed offset of partition %d went down from %d to %d", o.Partition, last[o.Partition], o.At))
					}
					last[o.Partition] = max(last[o.Partition], o.At)
				})
			}
		}()
		defer func() { close(stopPoll); pollWG.Wait() }()

		start("a")
		start("b")
		testenv.WaitFor(t, 60*time.Second, "the first records to be handled", func() bool { return a.count("done") >= 500 })
		start("c") // joins mid-run
		publishKeyed(t, b, topic, n/2, n/2, 500)

		// Records keep coming while the group churns, so that every
		// rebalance finds work in flight.
		stopPub := make(chan struct{})
		pubDone := make(chan struct{})
		go func() {
			defer close(pubDone)
			for i := n; ; i += 100 {
				select {
				case <-stopPub:
					return
				case <-time.After(100 * time.Millisecond):
				}
				var msgs []consumer.Message
				for j := i; j < i+100; j++ {
					msgs = append(msgs, consumer.Message{Key: "key-" + strconv.Itoa(j%500), Body: []byte(strconv.Itoa(j))})
				}
				if err := b.Publish(context.Background(), topic, msgs...); err != nil {
					t.Errorf("publish: %v", err)
					return
				}
			}
		}()

		// Churn: a member joins, takes partitions, and leaves, until the
		// group has been through enough rebalances (each join and each
		// leave is one).
		for i := 0; i < rebalances/2; i++ {
			before := a.count("assigned")
			r := start("churn-" + strconv.Itoa(i))
			testenv.WaitFor(t, 60*time.Second, "the churning member to get partitions", func() bool { return a.count("assigned") > before })
			time.Sleep(200 * time.Millisecond) // a few commits by the new owner
			r.stop(t)
		}
		close(stopPub)
		<-pubDone
		ends := endOffsets(t, b.Admin(), topic)
		testenv.WaitFor(t, 120*time.Second, "every record to be handled", func() bool {
			done := a.doneSet()
			for _, po := range allOffsets(ends) {
				if done[po] == 0 {
					return false
				}
			}
			return true
		})
		if v := pollErr.Load(); v != nil {
			t.Error(v)
		}
		a.check(t)
		dups := 0
		for _, k := range a.doneSet() {
			dups += k - 1
		}
		t.Logf("%d assignments, %d revocations, %d lost, %d commits; %d duplicate runs (each of a record in flight at a rebalance)",
			a.count("assigned"), a.count("revoked"), a.count("lost"), a.count("commit"), dups)
		if a.count("revoked") < rebalances/4 {
			t.Errorf("only %d revocations in %d rebalances: the churn did not move partitions", a.count("revoked"), rebalances)
		}
	})
}

// TestRevokeMidBatchLeavesNoGap: under OrderByKey, records of one partition
// finish out of order; a member joining mid-batch takes partitions away.
// Every offset is handled by some member, and in the end the committed
// offsets reach the high watermarks.
func TestRevokeMidBatchLeavesNoGap(t *testing.T) {
	forProtocols(t, func(t *testing.T, proto kafka.GroupProtocol) {
		const n = 2000
		var a audit
		b := newBroker(t, append(groupOpts(proto), a.options()...)...)
		topic := newTopic(t, b, "gap", 2)
		group := testenv.UniqueName(t, "gap-group")
		publishKeyed(t, b, topic, 0, n, 40)
		// Keys take from 0 to 9 ms: later records of fast keys finish
		// before earlier records of slow ones.
		h := func(ctx context.Context, m *consumer.Message) error {
			k, _ := strconv.Atoi(m.Key[len("key-"):])
			return sleepCtx(ctx, time.Duration(k%10)*time.Millisecond)
		}
		mk := func(name string) *running {
			c, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group), consumer.WithConcurrency(16),
				consumer.WithOrdering(consumer.OrderByKey))
			if err != nil {
				t.Fatal(err)
			}
			return runConsumer(t, c, a.handler(name, h))
		}
		ra := mk("a")
		testenv.WaitFor(t, 60*time.Second, "a to be mid-batch", func() bool { return a.count("done") >= 300 })
		rb := mk("b")
		testenv.WaitFor(t, 60*time.Second, "a revocation", func() bool { return a.count("revoked") >= 1 })
		ends := endOffsets(t, b.Admin(), topic)
		testenv.WaitFor(t, 120*time.Second, "every offset to be handled", func() bool {
			done := a.doneSet()
			for _, po := range allOffsets(ends) {
				if done[po] == 0 {
					return false
				}
			}
			return true
		})
		ra.stop(t)
		rb.stop(t)
		got := committed(t, b.Admin(), group, topic)
		for p, end := range ends {
			if got[p] != end {
				t.Errorf("partition %d: committed %d, want the high watermark %d", p, got[p], end)
			}
		}
		a.check(t)
	})
}

// TestPoisonRecordIsDeadLetteredAndPartitionMovesOn: the record at offset
// N of a partition fails for good; it goes to the dead-letter topic with
// its story, and the records after it are handled.
func TestPoisonRecordIsDeadLetteredAndPartitionMovesOn(t *testing.T) {
	forProtocols(t, testPoison)
}

func testPoison(t *testing.T, proto kafka.GroupProtocol) {
	const n, poison = 20, 7
	b := newBroker(t, kafka.WithGroupProtocol(proto))
	topic := newTopic(t, b, "poison", 1)
	dlq := newTopic(t, b, "poison-dlq", 1)
	publishKeyed(t, b, topic, 0, n, 3)

	stack, err := consumer.Standard(b, dlq,
		consumer.StandardRetry(consumer.RetryAttempts(2), consumer.RetryInitial(time.Millisecond), consumer.RetryMaxInterval(10*time.Millisecond), consumer.RetryRedeliveryMax(20*time.Millisecond)),
		consumer.StandardDeadLetter(consumer.DeadLetterMaxAttempts(3)))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	handled := map[int64]int{}
	h := stack.Wrap(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		handled[m.Offset]++
		mu.Unlock()
		if m.Offset == poison {
			return errors.New("cannot handle this record")
		}
		return nil
	}))
	group := testenv.UniqueName(t, "poison-group")
	c, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group), consumer.WithRedeliveryBackoff(10*time.Millisecond, 50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	r := runConsumer(t, c, h)
	testenv.WaitFor(t, 60*time.Second, "the records after the poison to be handled", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return handled[n-1] >= 1
	})
	r.stop(t)
	mu.Lock()
	for o := int64(0); o < n; o++ {
		if handled[o] == 0 {
			t.Errorf("offset %d was never handled", o)
		}
	}
	if handled[poison] != 3 {
		t.Errorf("the poison record ran %d times, want 3 (DeadLetterMaxAttempts)", handled[poison])
	}
	mu.Unlock()
	if got := committed(t, b.Admin(), group, topic)[0]; got != n {
		t.Errorf("committed offset %d, want %d: the partition did not move on", got, n)
	}

	recs := consumeRaw(t, dlq, 1)
	hd := map[string]string{}
	for _, h := range recs[0].Headers {
		hd[h.Key] = string(h.Value)
	}
	want := map[string]string{
		consumer.HeaderDLQSource:   topic,
		consumer.HeaderDLQOffset:   strconv.Itoa(poison),
		consumer.HeaderDLQLane:     "0",
		consumer.HeaderDLQAttempts: "3",
		consumer.HeaderDLQReason:   consumer.DLQReasonMaxAttempts,
		consumer.HeaderDLQConsumer: group,
	}
	for k, v := range want {
		if hd[k] != v {
			t.Errorf("dead letter header %s = %q, want %q", k, hd[k], v)
		}
	}
	if hd[consumer.HeaderDLQError] == "" || hd[consumer.HeaderDLQFirstFailure] == "" || hd[consumer.HeaderDLQLastFailure] == "" {
		t.Errorf("dead letter lacks its story: %v", hd)
	}
	if string(recs[0].Value) != strconv.Itoa(poison) || string(recs[0].Key) != "key-"+strconv.Itoa(poison%3) {
		t.Errorf("dead letter key %q body %q, want the original", recs[0].Key, recs[0].Value)
	}
}

// consumeRaw reads the first n records of topic with a plain franz-go
// client.
func consumeRaw(t testing.TB, topic string, n int) []*kgo.Record {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(testenv.KafkaBrokers()...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx := testenv.Context(t, 30*time.Second)
	var out []*kgo.Record
	for len(out) < n {
		fs := cl.PollRecords(ctx, n-len(out))
		if ctx.Err() != nil {
			t.Fatalf("read %d of %d records from %s", len(out), n, topic)
		}
		out = append(out, fs.Records()...)
	}
	return out
}

// TestBreakerOpenStopsFetchingAndKeepsMembership: while the dependency is
// down for 30 s the breaker holds records: fetching stops (the consumer
// takes nothing more from the broker while the lag grows), the member stays
// in its group (no revocation, the group stays stable with it), and the
// backlog drains by itself afterwards.
func TestBreakerOpenStopsFetchingAndKeepsMembership(t *testing.T) {
	forProtocols(t, testBreakerOpen)
}

func testBreakerOpen(t *testing.T, proto kafka.GroupProtocol) {
	down := 30 * time.Second
	if proto == kafka.NextGen {
		down = 10 * time.Second // the 30 s outage runs under the classic protocol; this one keeps the package's run short
	}
	var a audit
	b := newBroker(t, append(groupOpts(proto), a.options()...)...)
	topic := newTopic(t, b, "breaker", 3)
	group := testenv.UniqueName(t, "breaker-group")
	if proto == kafka.NextGen {
		shortenGroupSession(t, group, 6*time.Second)
	}
	publishKeyed(t, b, topic, 0, 300, 30)

	var isDown atomic.Bool
	isDown.Store(true)
	// The 30 keys fill two of the three partitions: two failing heads, whose
	// re-runs in place count once nothing else succeeds, open it.
	br, err := consumer.NewBreaker(consumer.BreakerFailures(3), consumer.BreakerOpenFor(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var ok atomic.Int64
	h := br.Wrap(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if isDown.Load() {
			return errors.New("dependency down")
		}
		ok.Add(1)
		return nil
	}))
	c, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group), consumer.WithMaxInFlight(100),
		consumer.WithRedeliveryBackoff(10*time.Millisecond, 50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	runConsumer(t, c, h)
	testenv.WaitFor(t, 30*time.Second, "the breaker to open", func() bool { return br.Opened() > 0 })
	time.Sleep(2 * time.Second)
	fetched := c.Stats().Fetched
	lag0, err := c.Lag(testenv.Context(t, 10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	publishKeyed(t, b, topic, 300, 3000, 30)

	deadline := time.Now().Add(down)
	for time.Now().Before(deadline) {
		time.Sleep(time.Second)
		if s := c.Stats(); s.InFlight > 100 {
			t.Fatalf("the consumer holds %d records while the breaker is open, above its MaxInFlight 100", s.InFlight)
		}
	}
	lag1, err := c.Lag(testenv.Context(t, 10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if lag1.InFlight <= 0 || lag1.OldestAge < down {
		t.Errorf("lag reports %d records held, the oldest %s old; want the held records, older than the %s outage", lag1.InFlight, lag1.OldestAge, down)
	}
	if got := c.Stats().Fetched - fetched; got > 100 {
		t.Errorf("the consumer fetched %d records while its breaker was open", got)
	}
	// Not yet done: waiting, or taken by this member and unsettled.
	if before, after := lag0.Messages+lag0.InFlight, lag1.Messages+lag1.InFlight; after < before+3000 {
		t.Errorf("lag went from %d to %d while 3000 records were published: want it to grow by all of them", before, after)
	}
	if proto == kafka.Classic {
		desc, err := b.Admin().DescribeGroups(testenv.Context(t, 10*time.Second), group)
		if err != nil {
			t.Fatal(err)
		}
		if g := desc[group]; g.State != "Stable" || len(g.Members) != 1 {
			t.Errorf("after %s with the breaker open the group is %s with %d members, want Stable with 1", down, g.State, len(g.Members))
		}
	} else {
		desc, err := b.Admin().DescribeConsumerGroups(testenv.Context(t, 10*time.Second), group)
		if err != nil {
			t.Fatal(err)
		}
		if g := desc[group]; g.State != "Stable" || len(g.Members) != 1 {
			t.Errorf("after %s with the breaker open the group is %s with %d members, want Stable with 1", down, g.State, len(g.Members))
		}
	}
	if n := a.count("revoked") + a.count("lost"); n > 0 {
		t.Errorf("%d revocations while the breaker was open: the member left its group", n)
	}

	isDown.Store(false)
	testenv.WaitFor(t, 90*time.Second, "the backlog to drain", func() bool {
		l, err := c.Lag(context.Background())
		return err == nil && l.Messages == 0 && ok.Load() >= 3300
	})
}

// TestPausedPartitionResumesAfterRevokeAndReassign: a partition paused
// because its records wait (its buffer is full) is revoked and later
// assigned back: it is fetched again and its lag drains (franz-go keeps a
// pause across rebalances; the consumer must lift it). The revocation does
// not wait out the revoke wait although every worker is busy with the other
// partition: what of the revoked one waits for a worker is let go at once.
func TestPausedPartitionResumesAfterRevokeAndReassign(t *testing.T) {
	forProtocols(t, func(t *testing.T, proto kafka.GroupProtocol) {
		var a audit
		var logs syncBuffer
		// Small fetches, so that a pause shows within a few of them.
		opts := append(groupOpts(proto), kafka.WithPartitionBuffer(5),
			kafka.WithClientOpts(kgo.FetchMaxPartitionBytes(1<<10), kgo.FetchMaxBytes(2<<10)),
			kafka.WithLogger(slog.New(slog.NewTextHandler(io.MultiWriter(&logs, t.Output()), nil))))
		b := newBroker(t, append(opts, a.options()...)...)
		topic := newTopic(t, b, "pause", 2)
		group := testenv.UniqueName(t, "pause-group")
		for i := 0; i < 2000; i += 10 { // small record batches: a pause shows within a few
			publishKeyed(t, b, topic, i, 10, 40)
		}

		release := make(chan struct{})
		var ok atomic.Int64
		blockA := func(ctx context.Context, m *consumer.Message) error {
			select {
			case <-release:
				ok.Add(1)
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		ca, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group), consumer.WithConcurrency(4),
			consumer.WithOrdering(consumer.OrderByKey), consumer.WithMaxInFlight(1000))
		if err != nil {
			t.Fatal(err)
		}
		runConsumer(t, ca, a.handler("a", blockA))
		testenv.WaitFor(t, 60*time.Second, "a to hold both partitions, blocked", func() bool { return a.count("start") >= 4 })
		time.Sleep(time.Second)
		if s := ca.Stats(); s.Fetched > 200 {
			t.Errorf("a fetched %d records with a partition buffer of 5 on 2 partitions (fetches of 1 KiB, room for 1000): fetching was not paused", s.Fetched)
		}
		// b joins (takes a partition), then leaves (gives it back).
		cb, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group))
		if err != nil {
			t.Fatal(err)
		}
		rb := runConsumer(t, cb, a.handler("b", func(ctx context.Context, m *consumer.Message) error {
			<-ctx.Done()
			return ctx.Err()
		}))
		testenv.WaitFor(t, 60*time.Second, "a revocation", func() bool { return a.count("revoked") >= 1 })
		testenv.WaitFor(t, 60*time.Second, "b to get a partition", func() bool { return a.count("assigned") >= 2 })
		rb.stop(t)
		testenv.WaitFor(t, 60*time.Second, "a to get the partition back", func() bool { return a.count("assigned") >= 3 })
		close(release)
		// Messages counts what waits, InFlight what a took and did not
		// settle yet: the last records may still be running.
		testenv.WaitFor(t, 90*time.Second, "the lag to drain", func() bool {
			l, err := ca.Lag(context.Background())
			return err == nil && l.Messages == 0 && l.InFlight == 0
		})
		if got := ok.Load(); got < 2000 {
			t.Errorf("a handled %d records, want all 2000", got)
		}
		if strings.Contains(logs.String(), "handlers of revoked partitions still run") {
			t.Errorf("a revocation waited out the revoke wait: records of the revoked partition that no worker had started held the rebalance up")
		}
		a.check(t)
	})
}

// TestSlowHandlerKeepsMembership: a handler that runs longer than the
// session timeout does not get its member fenced (heartbeats run beside
// it); a handler that would outlast the rebalance timeout has its context
// cancelled when its partition is revoked, and the rebalance completes.
func TestSlowHandlerKeepsMembership(t *testing.T) {
	t.Run("LongerThanSessionTimeout", func(t *testing.T) { forProtocols(t, testSlowerThanSession) })
	t.Run("LongerThanRebalanceTimeout", func(t *testing.T) { forProtocols(t, testSlowerThanRebalance) })
}

func testSlowerThanSession(t *testing.T, proto kafka.GroupProtocol) {
	var a audit
	b := newBroker(t, append(groupOpts(proto), a.options()...)...)
	topic := newTopic(t, b, "slow", 1)
	group := testenv.UniqueName(t, "slow-group")
	if proto == kafka.NextGen {
		shortenGroupSession(t, group, 6*time.Second)
	}
	publishKeyed(t, b, topic, 0, 3, 1)
	c, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group))
	if err != nil {
		t.Fatal(err)
	}
	var ctxErr atomic.Value
	runConsumer(t, c, a.handler("slow", func(ctx context.Context, m *consumer.Message) error {
		if m.Offset == 0 {
			if err := sleepCtx(ctx, 9*time.Second); err != nil { // session timeout is 6 s
				ctxErr.Store(err)
				return err
			}
		}
		return nil
	}))
	testenv.WaitFor(t, 60*time.Second, "the three records to be handled", func() bool { return len(a.doneSet()) == 3 })
	if v := ctxErr.Load(); v != nil {
		t.Errorf("the slow handler's context ended: %v", v)
	}
	if n := a.count("revoked") + a.count("lost"); n > 0 {
		t.Errorf("%d revocations: the member was fenced while its handler ran", n)
	}
	for po, k := range a.doneSet() {
		if k != 1 {
			t.Errorf("offset %d handled %d times", po[1], k)
		}
	}
}

func testSlowerThanRebalance(t *testing.T, proto kafka.GroupProtocol) {
	var a audit
	opts := append(groupOpts(proto), kafka.WithRebalanceTimeout(10*time.Second))
	b := newBroker(t, append(opts, a.options()...)...)
	topic := newTopic(t, b, "slow-rb", 2)
	group := testenv.UniqueName(t, "slow-rb-group")
	if proto == kafka.NextGen {
		shortenGroupSession(t, group, 6*time.Second)
	}
	produceRaw(t, &kgo.Record{Topic: topic, Partition: 0, Value: []byte("p0")}, &kgo.Record{Topic: topic, Partition: 1, Value: []byte("p1")})
	var cancelled sync.Map // lane -> time the handler saw its context end
	ca, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group), consumer.WithShutdownGrace(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	runConsumer(t, ca, a.handler("a", func(ctx context.Context, m *consumer.Message) error {
		<-ctx.Done() // would run for ever
		cancelled.Store(m.Lane, time.Now())
		return ctx.Err()
	}))
	testenv.WaitFor(t, 60*time.Second, "a to run both records", func() bool { return a.count("start") >= 2 })
	joined := time.Now()
	cb, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group))
	if err != nil {
		t.Fatal(err)
	}
	runConsumer(t, cb, a.handler("b", nil))
	testenv.WaitFor(t, 30*time.Second, "b to handle the record of the partition it took", func() bool { return len(a.doneSet()) == 1 })
	var lane string
	for po := range a.doneSet() {
		lane = strconv.Itoa(int(po[0]))
	}
	v, ok := cancelled.Load(lane)
	if !ok {
		t.Fatalf("the handler of partition %s, revoked from a, was not cancelled", lane)
	}
	if d := v.(time.Time).Sub(joined); d > 10*time.Second {
		t.Errorf("the revoked handler was cancelled %s after b joined, past the rebalance timeout", d)
	}
	other := "0"
	if lane == "0" {
		other = "1"
	}
	if _, ok := cancelled.Load(other); ok {
		t.Errorf("the handler of partition %s, which a kept, was cancelled too", other)
	}
	if n := a.count("lost"); n > 0 {
		t.Errorf("%d partitions lost: the rebalance did not complete in time", n)
	}
	a.check(t)
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// forProtocols runs fn under the classic protocol and under KIP-848.
func forProtocols(t *testing.T, fn func(t *testing.T, p kafka.GroupProtocol)) {
	for _, p := range []kafka.GroupProtocol{kafka.Classic, kafka.NextGen} {
		t.Run(p.String(), func(t *testing.T) { fn(t, p) })
	}
}

// TestStuckPartitionIsPausedAndOthersFlow: a partition whose first record
// fails again and again (retried in place) holds the records behind it;
// once it has made no progress for StuckAfter it is paused, so that the
// records that keep arriving on it stop taking the loop's room, while the
// other partition's records are all handled.
func TestStuckPartitionIsPausedAndOthersFlow(t *testing.T) {
	b := newBroker(t)
	topic := newTopic(t, b, "stuck", 2)
	group := testenv.UniqueName(t, "stuck-group")
	var recs []*kgo.Record
	for i := 0; i < 500; i++ {
		recs = append(recs, &kgo.Record{Topic: topic, Partition: 1, Value: []byte(strconv.Itoa(i))})
	}
	produceRaw(t, recs...)
	c, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group), consumer.WithMaxInFlight(1000), consumer.WithFetchBatch(20),
		consumer.WithRedeliveryBackoff(10*time.Millisecond, 20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	var p1 atomic.Int64
	runConsumer(t, c, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if m.Lane == "0" {
			return errors.New("partition 0 is stuck on its first record")
		}
		p1.Add(1)
		return nil
	}))
	// Partition 0 gets 10 records every 50 ms for 5 s: 1000 records, as
	// many as the loop has room for.
	cl, err := kgo.NewClient(kgo.SeedBrokers(testenv.KafkaBrokers()...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	for i := 0; i < 100; i++ {
		var batch []*kgo.Record
		for j := 0; j < 10; j++ {
			batch = append(batch, &kgo.Record{Topic: topic, Partition: 0, Value: []byte("stuck")})
		}
		if err := cl.ProduceSync(testenv.Context(t, 30*time.Second), batch...).FirstErr(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	testenv.WaitFor(t, 60*time.Second, "partition 1's 500 records to be handled", func() bool { return p1.Load() == 500 })
	lag, err := c.Lag(testenv.Context(t, 10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	// Paused after StuckAfter with half a fetch batch held: it holds what
	// arrived until then, far fewer than the 1000 records published.
	if lag.InFlight > 300 {
		t.Errorf("the stuck partition holds %d records: it was not paused", lag.InFlight)
	}
	if lag.Lanes["0"] != 1000 || lag.Lanes["1"] != 0 {
		t.Errorf("lag per partition %v, want 1000 on the stuck one and none on the other", lag.Lanes)
	}
	t.Logf("the stuck partition holds %d records", lag.InFlight)
}

// TestLostPartitionsCommitNothing: a member frozen (SIGSTOP) past its
// session timeout loses its partitions to the other member; when it wakes
// up (SIGCONT), franz-go reports them lost, and the woken member commits
// nothing for them, although its handlers finish the records they had.
// Every record is handled, and no committed offset goes down.
func TestLostPartitionsCommitNothing(t *testing.T) {
	const n = 3000
	b := newBroker(t)
	topic := newTopic(t, b, "lost", 4)
	group := testenv.UniqueName(t, "lost-group")
	publishKeyed(t, b, topic, 0, n, 997)

	ch := startChild(t, kafka.Classic, topic, group, -1, 6*time.Second)
	testenv.WaitFor(t, 60*time.Second, "the child to handle records", func() bool {
		h, _, _ := ch.state()
		return len(h) >= 50
	})
	var a audit
	sb := newBroker(t, append(groupOpts(kafka.Classic), a.options()...)...)
	survivor, err := sb.NewConsumer(t.Context(), topic, consumer.WithName(group), consumer.WithConcurrency(4))
	if err != nil {
		t.Fatal(err)
	}
	runConsumer(t, survivor, a.handler("survivor", func(ctx context.Context, m *consumer.Message) error {
		return sleepCtx(ctx, 5*time.Millisecond)
	}))
	testenv.WaitFor(t, 60*time.Second, "the survivor to share the partitions", func() bool { return a.count("done") >= 50 })

	ch.signal(t, syscall.SIGSTOP)
	time.Sleep(500 * time.Millisecond) // the pipe drains
	frozenAt := len(ch.lines())
	// The survivor takes everything once the child's session expires.
	testenv.WaitFor(t, 60*time.Second, "the survivor to take the frozen member's partitions", func() bool { return a.count("assigned") >= 2 })
	time.Sleep(2 * time.Second) // and commits on them
	ch.signal(t, syscall.SIGCONT)
	testenv.WaitFor(t, 30*time.Second, "the woken member to see its partitions lost", func() bool {
		for _, l := range ch.lines()[frozenAt:] {
			if strings.HasPrefix(l, "L ") {
				return true
			}
		}
		return false
	})
	ends := endOffsets(t, b.Admin(), topic)
	testenv.WaitFor(t, 90*time.Second, "every record to be handled", func() bool {
		childHandled, _, _ := ch.state()
		done := a.doneSet()
		for _, po := range allOffsets(ends) {
			if done[po] == 0 && childHandled[po] == 0 {
				return false
			}
		}
		return true
	})
	time.Sleep(2 * time.Second) // the woken member's commit interval, twice
	// After waking, the member rejoins and may be given partitions again:
	// once it reported the loss, a commit for a partition is legitimate
	// only after it was assigned anew. (A commit accepted between the
	// freeze and the report was sent before the freeze, while the member
	// still owned the partition, and answered after it woke up.)
	reassigned := map[string]bool{}
	lost := 0
	for _, l := range ch.lines()[frozenAt:] {
		f := strings.Fields(l)
		switch {
		case len(f) == 2 && f[0] == "A":
			reassigned[f[1]] = true
		case len(f) == 2 && f[0] == "L":
			lost++
		case len(f) == 3 && f[0] == "C" && lost > 0 && !reassigned[f[1]]:
			t.Errorf("the member committed partition %s at %s after losing it, before it was assigned again", f[1], f[2])
		}
	}
	if lost == 0 {
		t.Error("the frozen member never reported its partitions lost")
	}
	a.check(t)
	// The harm a late commit does is to move the group back: once every
	// record is handled and the owners committed, each partition's
	// committed offset is its end.
	// (Records the woken member handled on partitions it had lost are
	// handled again by their owner, so this may take a moment.)
	atEnd := func(got map[int32]int64) bool {
		for p, end := range ends {
			if got[p] != end {
				return false
			}
		}
		return true
	}
	deadline := time.Now().Add(30 * time.Second)
	for got := committed(t, b.Admin(), group, topic); !atEnd(got); got = committed(t, b.Admin(), group, topic) {
		if time.Now().After(deadline) {
			t.Fatalf("committed offsets %v, want the partitions' ends %v", got, ends)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
