package kafka_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
)

// TestShareKeepsConsumingWhileARecordIsHeld: a share group consumer whose
// handler holds one record (its poll brought that one alone) goes on
// consuming the records published after it, on the same partition. With
// one client it could not poll again before that record was settled:
// franz-go accepts a client's unsettled records at its next poll.
func TestShareKeepsConsumingWhileARecordIsHeld(t *testing.T) {
	b := newBroker(t, kafka.WithGroupProtocol(kafka.Share))
	topic := newTopic(t, b, "share-held", 1)
	group := newShareGroup(t, "share-held", 0)
	publishN(t, b, topic, "held", 1)
	l, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group), consumer.WithConcurrency(4))
	if err != nil {
		t.Fatal(err)
	}
	started, release := make(chan struct{}), make(chan struct{})
	var startOnce sync.Once
	var c tally
	runConsumer(t, l, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if string(m.Body) == "held-0" {
			startOnce.Do(func() { close(started) })
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		c.add(string(m.Body), "")
		return nil
	}))
	select {
	case <-started:
	case <-time.After(30 * time.Second):
		t.Fatal("the first record was not handled within 30 s")
	}
	const n = 20
	publishN(t, b, topic, "r", n)
	testenv.WaitFor(t, 30*time.Second, fmt.Sprintf("the %d records published after the held one handled while it is held", n), func() bool { return c.distinct() == n })
	close(release)
	testenv.WaitFor(t, 30*time.Second, "the held record handled", func() bool { return c.distinct() == n+1 })
	c.mu.Lock()
	defer c.mu.Unlock()
	for body, runs := range c.runs {
		if runs != 1 {
			t.Errorf("%s handled %d times, want once", body, runs)
		}
	}
}

// TestShareOutageFindingALoneHeldRecordOpensTheBreaker is the kafka-share
// chaos row's failure: an outage starts while a consumer holds one record
// that its poll brought alone. With one client per consumer it fetched
// nothing else: the breaker opened late, on that record's own re-runs,
// and each half-open trial was a run of that record, until its budget was
// spent and it was dead-lettered. Now the consumer polls the records
// published after it while it holds the first: their first runs fail too,
// the trials go round every held record, and none spends its budget while
// the dependency is down; all are handled once it is back. (The new
// session joins at the group's next heartbeat, up to 5 s; the budget of 12
// outlasts that, and the old driver's trials spent it in a 20 s outage.)
func TestShareOutageFindingALoneHeldRecordOpensTheBreaker(t *testing.T) {
	b := newBroker(t, kafka.WithGroupProtocol(kafka.Share))
	topic := newTopic(t, b, "share-lone", 1)
	dlq := newTopic(t, b, "share-lone-dlq", 1)
	group := newShareGroup(t, "share-lone", 0)
	stack, err := consumer.Standard(b, dlq,
		consumer.StandardRetry(consumer.RetryAttempts(3), consumer.RetryInitial(20*time.Millisecond), consumer.RetryMaxInterval(200*time.Millisecond)),
		consumer.StandardBreaker(consumer.BreakerFailures(3), consumer.BreakerOpenFor(time.Second)),
		consumer.StandardDeadLetter(consumer.DeadLetterMaxAttempts(12)))
	if err != nil {
		t.Fatal(err)
	}
	l, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group), consumer.WithConcurrency(4))
	if err != nil {
		t.Fatal(err)
	}
	var down atomic.Bool
	down.Store(true)
	firstFailed := make(chan struct{}, 1)
	var c tally
	runConsumer(t, l, stack.Wrap(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if down.Load() {
			select {
			case firstFailed <- struct{}{}:
			default:
			}
			return errors.New("payments down")
		}
		c.add(string(m.Body), "")
		return nil
	})))
	publishN(t, b, topic, "lone", 1)
	select {
	case <-firstFailed:
	case <-time.After(30 * time.Second):
		t.Fatal("the lone record was not handled within 30 s")
	}
	const n = 20
	publishN(t, b, topic, "r", n)
	testenv.WaitFor(t, 30*time.Second, "the breaker to open", func() bool { return stack.Breaker.State() == consumer.BreakerOpen })
	time.Sleep(20 * time.Second) // the outage goes on: half-open trials, one every second or two
	down.Store(false)
	testenv.WaitFor(t, 60*time.Second, fmt.Sprintf("all %d records handled or dead-lettered", n+1), func() bool { return c.distinct()+int(stack.DeadLetter.Count()) == n+1 })
	if k := stack.DeadLetter.Count(); k != 0 {
		t.Errorf("%d good records dead-lettered during the outage; the breaker must hold them", k)
	}
}

// TestShareSessionsSettleAndGiveBackTogether: a consumer's driver holds a
// record of its first session while a second session polls more; one
// Settle call accepts records of both sessions, and Close gives back what
// each session still holds, so another member gets those records on their
// second delivery and none of the accepted ones.
func TestShareSessionsSettleAndGiveBackTogether(t *testing.T) {
	b := newBroker(t, kafka.WithGroupProtocol(kafka.Share))
	topic := newTopic(t, b, "share-sessions", 1)
	group := testenv.UniqueName(t, "share-sessions")
	// Locks long enough that nothing needs renewing: no loop renews here.
	setGroupConfig(t, group, map[string]string{"share.record.lock.duration.ms": "60000", "share.auto.offset.reset": "earliest"})
	publishN(t, b, topic, "first", 2)
	d := shareDriverOf(t, b, topic, group, 8) // the first session polls up to 8, the others 2 each
	first := fetchN(t, d, 2)
	publishN(t, b, topic, "more", 4)
	began := time.Now()
	more := fetchN(t, d, 4) // the first session holds its two: others poll these
	t.Logf("the other sessions brought 4 records in %s", time.Since(began))
	ctx := testenv.Context(t, 30*time.Second)
	// Accept one record of each poll in one call; keep the others.
	if err := d.Settle(ctx, []driver.Settlement{{Handle: first[0].Handle}, {Handle: more[0].Handle}}); err != nil {
		t.Fatalf("Settle across sessions: %v", err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	want := map[string]bool{string(first[1].Body): true}
	for _, m := range more[1:] {
		want[string(m.Body)] = true
	}
	other := shareDriverOf(t, b, topic, group, 10)
	again := fetchN(t, other, len(want))
	for _, m := range again {
		if !want[string(m.Body)] || m.Deliveries != 2 {
			t.Errorf("delivered again: %s on delivery %d; want the records left unsettled (%v), each on its second delivery", m.Body, m.Deliveries, want)
		}
	}
	fctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	if extra, _ := other.Fetch(fctx, nil, 10); len(extra) > 0 {
		t.Errorf("an accepted record was delivered again: %s", extra[0].Body)
	}
}

// TestShareStopTakesWhatTheLastFetchBrings: while a share group
// consumer's sessions poll, a ShareFetch of theirs waits at the broker
// for records (up to 500 ms). When Drain ends the polls, that fetch is
// still there, and the broker answers it with a record published then,
// acquired for this member. Drain hands the record to the loop, on its
// first delivery. Before, no poll took it: Close gave it back on one more
// delivery without running it (at the group's delivery limit the broker
// archived it), and nothing said so. A Close without a Drain gives such a
// record back, and says so at WARN. When the record came after the fetch
// ended (no member acquired it: another gets it on its first delivery),
// the case did not happen, and the test tries again.
func TestShareStopTakesWhatTheLastFetchBrings(t *testing.T) {
	for _, stop := range []string{"drain", "close"} {
		t.Run(stop, func(t *testing.T) {
			for try := 1; try <= 3; try++ {
				if lateFetchCase(t, stop) {
					return
				}
				t.Logf("try %d: the record came after the last fetch ended; again", try)
			}
			t.Fatal("in 3 tries, no record came while the last fetch was at the broker")
		})
	}
}

// lateFetchCase publishes a record as stop ("drain" or "close") ends a
// share group consumer's polls and checks what becomes of it; it says
// whether the record came while a fetch was at the broker.
func lateFetchCase(t *testing.T, stop string) bool {
	var logs syncBuffer
	log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	b := newBroker(t, kafka.WithGroupProtocol(kafka.Share), kafka.WithLogger(log))
	topic := newTopic(t, b, "share-late", 1)
	group := testenv.UniqueName(t, "share-late")
	setGroupConfig(t, group, map[string]string{"share.record.lock.duration.ms": "60000", "share.auto.offset.reset": "earliest"})
	d := shareDriverOf(t, b, topic, group, 8)
	ctx := testenv.Context(t, 60*time.Second)
	// A first record, fetched and accepted: the group gave the session
	// the partition.
	publishN(t, b, topic, "first", 1)
	if err := d.Settle(ctx, []driver.Settlement{{Handle: fetchN(t, d, 1)[0].Handle}}); err != nil {
		t.Fatal(err)
	}
	// Fetch from the topic, empty now, a while: the session polls, in
	// the background, past the Fetch.
	for fctx := testenv.Context(t, time.Second); fctx.Err() == nil; {
		if got, _ := d.Fetch(fctx, nil, 8); len(got) > 0 {
			t.Fatalf("fetched %s from an empty topic", got[0].Body)
		}
	}
	published := make(chan error, 1)
	go func() { published <- b.Publish(ctx, topic, consumer.Message{Body: []byte("late")}) }()
	var drained []driver.Message
	if stop == "drain" {
		var err error
		if drained, err = d.(driver.Drainer).Drain(ctx, nil); err != nil {
			t.Fatalf("Drain: %v", err)
		}
	}
	if err := <-published; err != nil {
		t.Fatal(err)
	}
	if len(drained) > 0 {
		if len(drained) != 1 || string(drained[0].Body) != "late" || drained[0].Deliveries != 1 {
			t.Fatalf("Drain returned %d records, the first %s on delivery %d; want the one published, on its first", len(drained), drained[0].Body, drained[0].Deliveries)
		}
		if err := d.Settle(ctx, []driver.Settlement{{Handle: drained[0].Handle}}); err != nil {
			t.Fatalf("Settle the drained record: %v", err)
		}
		return true
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	warned := strings.Contains(logs.String(), "polled_not_taken=1")
	got := fetchN(t, shareDriverOf(t, b, topic, group, 8), 1)[0]
	t.Logf("another member got the record on delivery %d; Close warned: %v", got.Deliveries, warned)
	switch {
	case got.Deliveries == 1:
		if warned {
			t.Errorf("Close warned of a record given back, and none was: %s", logs.String())
		}
		return false
	case stop == "drain":
		t.Errorf("the record published as Drain stopped the polls came to another member on delivery %d, never run: the stopped consumer's last fetch acquired it and Drain did not take it", got.Deliveries)
	case !warned:
		t.Errorf("Close gave back a record its last fetch brought (another member got it on delivery %d) and did not say so at WARN; logs: %s", got.Deliveries, logs.String())
	}
	return true
}
