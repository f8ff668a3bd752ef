package kafka_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
)

// runLog records the runs of a handler: for each body, when it ran, on
// which topic, with which headers, and in what order runs finished well.
type runLog struct {
	mu   sync.Mutex
	runs map[string][]retryRun
	done []string // bodies, in the order their runs succeeded
}

type retryRun struct {
	at      time.Time
	source  string
	attempt int
	headers map[string]string
}

func (l *runLog) add(m *consumer.Message) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.runs == nil {
		l.runs = make(map[string][]retryRun)
	}
	b := string(m.Body)
	l.runs[b] = append(l.runs[b], retryRun{at: time.Now(), source: m.Source, attempt: m.Attempt, headers: m.Headers})
	return len(l.runs[b])
}

func (l *runLog) succeeded(body string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.done = append(l.done, body)
}

func (l *runLog) get(body string) []retryRun {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]retryRun(nil), l.runs[body]...)
}

func (l *runLog) finished() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.done...)
}

// TestRetryTopicsLetThePartitionGoOn: of 30 records on one partition, one
// fails on the topic and on the first retry tier and succeeds on the
// second. The other 29 finish while it waits in the tiers (before, it was
// retried in place and held the partition); it runs once a tier, each run
// no sooner than its tier's delay after the one before, and the headers on
// its last run tell where it came from and how many runs it had.
func TestRetryTopicsLetThePartitionGoOn(t *testing.T) {
	b := newBroker(t)
	topic := newTopic(t, b, "retry-goon", 1)
	delays := []time.Duration{time.Second, 2 * time.Second}
	rc, err := b.NewRetryingConsumer(t.Context(), topic,
		kafka.RetryTopics{Delays: delays, DeadLetterTopic: topic + ".dlq", GiveUpOrder: true},
		consumer.WithName(testenv.UniqueName(t, "retry-goon")))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, rt := range append(rc.Topics(), topic+".dlq") {
			_ = b.DeleteTopic(context.Background(), rt)
		}
	})
	const n, bad = 30, "r-5"
	var log runLog
	runConsumer(t, rc, consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
		if runs := log.add(m); string(m.Body) == bad && runs < 3 {
			return errors.New("not yet")
		}
		log.succeeded(string(m.Body))
		return nil
	}))
	publishN(t, b, topic, "r", n)
	testenv.WaitFor(t, 60*time.Second, "every record handled", func() bool { return len(log.finished()) == n })

	done := log.finished()
	if done[n-1] != bad {
		t.Errorf("records finished in the order %v; want %s, which waited in the retry tiers, last", done, bad)
	}
	runs := log.get(bad)
	if len(runs) != 3 {
		t.Fatalf("%s ran %d times, want 3 (the topic, tier 1, tier 2)", bad, len(runs))
	}
	wantSources := []string{topic, rc.Topics()[0], rc.Topics()[1]}
	for i, r := range runs {
		if r.source != wantSources[i] {
			t.Errorf("run %d of %s was on %s, want %s", i+1, bad, r.source, wantSources[i])
		}
		if i > 0 {
			if gap := r.at.Sub(runs[i-1].at); gap < delays[i-1] {
				t.Errorf("run %d of %s came %s after the one before; tier %d's delay is %s", i+1, bad, gap, i, delays[i-1])
			}
		}
	}
	last := runs[2].headers
	for k, want := range map[string]string{
		kafka.HeaderRetryTier:            "2",
		kafka.HeaderRetryAttempts:        "2",
		kafka.HeaderRetryOriginTopic:     topic,
		kafka.HeaderRetryOriginPartition: "0",
		kafka.HeaderRetryOriginOffset:    "5",
		kafka.HeaderRetryError:           "not yet",
	} {
		if last[k] != want {
			t.Errorf("header %s on the last run is %q, want %q (headers: %v)", k, last[k], want, last)
		}
	}
	if _, err := time.Parse(time.RFC3339Nano, last[kafka.HeaderRetryFirstFailure]); err != nil {
		t.Errorf("header %s: %v", kafka.HeaderRetryFirstFailure, err)
	}
	if c := rc.DeadLetter().Count(); c != 0 {
		t.Errorf("%d records dead-lettered, want none", c)
	}
}

// TestRetryTopicsDeadLetterWithTheWholeStory: a record that always fails
// runs, with a Retry of two runs in its handler, twice on the topic and
// twice on each tier, then goes to the dead-letter topic: its dead letter
// names the topic it came from, counts all six runs, and keeps the retry
// headers. A permanent failure goes to the dead-letter topic at once,
// after one run.
func TestRetryTopicsDeadLetterWithTheWholeStory(t *testing.T) {
	b := newBroker(t)
	topic := newTopic(t, b, "retry-story", 2)
	dlq := topic + ".dlq"
	rc, err := b.NewRetryingConsumer(t.Context(), topic,
		kafka.RetryTopics{Delays: []time.Duration{200 * time.Millisecond, 200 * time.Millisecond}, DeadLetterTopic: dlq},
		consumer.WithName(testenv.UniqueName(t, "retry-story")), consumer.WithOrdering(consumer.Unordered))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, rt := range append(rc.Topics(), dlq) {
			_ = b.DeleteTopic(context.Background(), rt)
		}
	})
	retry, err := consumer.NewRetry(consumer.RetryAttempts(2), consumer.RetryInitial(time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	var log runLog
	runConsumer(t, rc, retry.Wrap(consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
		log.add(m)
		if string(m.Body) == "poison" {
			return consumer.Permanent(errors.New("cannot parse"))
		}
		return errors.New("payments says no")
	})))
	if err := b.Publish(t.Context(), topic, consumer.Message{Key: "a", Body: []byte("doomed")}, consumer.Message{Key: "b", Body: []byte("poison")}); err != nil {
		t.Fatal(err)
	}
	letters := consumeAll(t, b, dlq, 2)
	byBody := map[string]map[string]string{}
	for _, m := range letters {
		byBody[string(m.Body)] = m.Headers
	}
	if runs := len(log.get("doomed")); runs != 6 {
		t.Errorf("the failing record ran %d times, want 6 (two runs on the topic and on each tier)", runs)
	}
	if runs := len(log.get("poison")); runs != 1 {
		t.Errorf("the permanent failure ran %d times, want 1", runs)
	}
	for body, want := range map[string]map[string]string{
		"doomed": {
			consumer.HeaderDLQSource:     topic,
			consumer.HeaderDLQAttempts:   "6",
			consumer.HeaderDLQReason:     consumer.DLQReasonMaxAttempts,
			consumer.HeaderDLQError:      "payments says no",
			kafka.HeaderRetryTier:        "2",
			kafka.HeaderRetryAttempts:    "4",
			kafka.HeaderRetryOriginTopic: topic,
		},
		"poison": {
			consumer.HeaderDLQSource:   topic,
			consumer.HeaderDLQAttempts: "1",
			consumer.HeaderDLQReason:   consumer.DLQReasonPermanent,
		},
	} {
		h := byBody[body]
		for k, v := range want {
			if h[k] != v {
				t.Errorf("dead letter of %s: header %s is %q, want %q (headers: %v)", body, k, h[k], v, h)
			}
		}
	}
	if h := byBody["doomed"]; h[consumer.HeaderDLQFirstFailure] != h[kafka.HeaderRetryFirstFailure] || h[consumer.HeaderDLQFirstFailure] == "" ||
		h[consumer.HeaderDLQPublishedAt] != h[kafka.HeaderRetryOriginPublishedAt] || h[consumer.HeaderDLQPublishedAt] == "" {
		t.Errorf("dead letter of doomed: first failure %q and publish time %q, want those of its first topic (%q, %q)",
			h[consumer.HeaderDLQFirstFailure], h[consumer.HeaderDLQPublishedAt], h[kafka.HeaderRetryFirstFailure], h[kafka.HeaderRetryOriginPublishedAt])
	}
	if _, ok := byBody["poison"][kafka.HeaderRetryTier]; ok {
		t.Errorf("the permanent failure went through a retry tier: %v", byBody["poison"])
	}
	testenv.WaitFor(t, 10*time.Second, "the dead letters counted", func() bool { return rc.DeadLetter().Count() == 2 })
}

// TestRetryTopicsRefuseBadConfiguration: what NewRetryingConsumer and Run
// refuse, each with a *consumer.ConfigError naming the field; an ordered
// consumer must say it gives up its order. A refused consumer leaves
// nothing open: with static membership, the corrected one starts.
func TestRetryTopicsRefuseBadConfiguration(t *testing.T) {
	b := newBroker(t, kafka.WithInstanceID("pod-1"))
	topic := newTopic(t, b, "retry-config", 1)
	name := consumer.WithName(testenv.UniqueName(t, "retry-config"))
	one := []time.Duration{time.Second}
	for _, tc := range []struct {
		field string
		cfg   kafka.RetryTopics
		opts  []consumer.Option
	}{
		{"RetryTopics.Delays", kafka.RetryTopics{DeadLetterTopic: "d", GiveUpOrder: true}, nil},
		{"RetryTopics.Delays", kafka.RetryTopics{Delays: []time.Duration{time.Second, 0}, DeadLetterTopic: "d", GiveUpOrder: true}, nil},
		{"RetryTopics.DeadLetterTopic", kafka.RetryTopics{Delays: one, GiveUpOrder: true}, nil},
		{"RetryTopics.DeadLetterTopic", kafka.RetryTopics{Delays: one, DeadLetterTopic: topic, GiveUpOrder: true}, nil},
		{"RetryTopics.GiveUpOrder", kafka.RetryTopics{Delays: one, DeadLetterTopic: "d"}, nil},
		{"RetryTopics.GiveUpOrder", kafka.RetryTopics{Delays: one, DeadLetterTopic: "d"}, []consumer.Option{consumer.WithOrdering(consumer.OrderByKey)}},
		{"RetryTopics", kafka.RetryTopics{Delays: one, DeadLetterTopic: "d", GiveUpOrder: true}, []consumer.Option{consumer.WithDeliveryMode(consumer.AtMostOnce)}},
		{"RetryTopics.TopicName", kafka.RetryTopics{Delays: []time.Duration{time.Second, time.Minute}, DeadLetterTopic: "d", GiveUpOrder: true,
			TopicName: func(topic string, _ int) string { return topic + ".retry" }}, nil},
	} {
		_, err := b.NewRetryingConsumer(t.Context(), topic, tc.cfg, append([]consumer.Option{name}, tc.opts...)...)
		var ce *consumer.ConfigError
		if !errors.As(err, &ce) || ce.Field != tc.field {
			t.Errorf("%+v: got %v, want a *consumer.ConfigError of %s", tc.cfg, err, tc.field)
		}
	}
	share := newBroker(t, kafka.WithGroupProtocol(kafka.Share))
	_, err := share.NewRetryingConsumer(t.Context(), topic, kafka.RetryTopics{Delays: one, DeadLetterTopic: topic + ".dlq", GiveUpOrder: true}, name)
	if ce := (*consumer.ConfigError)(nil); !errors.As(err, &ce) || ce.Field != "RetryTopics" {
		t.Errorf("on a share group Broker: got %v, want a *consumer.ConfigError of RetryTopics", err)
	}
	rc, err := b.NewRetryingConsumer(t.Context(), topic, kafka.RetryTopics{Delays: one, DeadLetterTopic: topic + ".dlq", GiveUpOrder: true}, name)
	if err != nil {
		t.Fatalf("the corrected consumer, after refused ones of the same name: %v", err)
	}
	t.Cleanup(func() {
		for _, rt := range append(rc.Topics(), topic+".dlq") {
			_ = b.DeleteTopic(context.Background(), rt)
		}
	})
	dl, err := consumer.NewDeadLetter(b, topic+".dlq")
	if err != nil {
		t.Fatal(err)
	}
	err = rc.Run(t.Context(), dl.Wrap(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })))
	if ce := (*consumer.ConfigError)(nil); !errors.As(err, &ce) || ce.Field != "Handler" {
		t.Errorf("Run with a DeadLetter in the handler: got %v, want a *consumer.ConfigError of Handler", err)
	}
}

// TestRetryTopicsOutageKeepsRecordsInPlace: while a dependency is down,
// the records that fail once the breaker has opened (its half-open trials)
// stay where they are, held, instead of running through the tiers into
// the dead-letter topic; once it is back, every record is handled and
// none is dead-lettered.
func TestRetryTopicsOutageKeepsRecordsInPlace(t *testing.T) {
	b := newBroker(t)
	topic := newTopic(t, b, "retry-outage", 1)
	dlq := topic + ".dlq"
	rc, err := b.NewRetryingConsumer(t.Context(), topic,
		kafka.RetryTopics{Delays: []time.Duration{200 * time.Millisecond, 200 * time.Millisecond}, DeadLetterTopic: dlq, GiveUpOrder: true},
		consumer.WithName(testenv.UniqueName(t, "retry-outage")))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, rt := range append(rc.Topics(), dlq) {
			_ = b.DeleteTopic(context.Background(), rt)
		}
	})
	breaker, err := consumer.NewBreaker(consumer.BreakerFailures(3), consumer.BreakerOpenFor(200*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	var down atomic.Bool
	down.Store(true)
	var log runLog
	runConsumer(t, rc, breaker.Wrap(consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
		log.add(m)
		if down.Load() {
			return errors.New("payments down")
		}
		log.succeeded(string(m.Body))
		return nil
	})))
	const n = 30
	publishN(t, b, topic, "r", n)
	testenv.WaitFor(t, 30*time.Second, "the breaker to open", func() bool { return breaker.Opened() > 0 })
	time.Sleep(5 * time.Second) // the outage goes on: half-open trials every 200 ms
	t.Logf("during the outage: %d openings, %d records dead-lettered", breaker.Opened(), rc.DeadLetter().Count())
	down.Store(false)
	testenv.WaitFor(t, 60*time.Second, "every record handled", func() bool { return len(log.finished()) >= n })
	if c := rc.DeadLetter().Count(); c != 0 {
		t.Errorf("%d records dead-lettered during the outage; the breaker's failures must keep them in place", c)
	}
}

// TestRetryTopicsLoseNothingWhenATierConsumerIsKilled: a child process
// runs a retrying consumer whose handler fails every record on the topic
// and on the first tier, so that all go on to the second, and blocks in
// the handler of its tenth run there while others run and hop; it is
// killed (SIGKILL) then. A consumer of the same names then handles every
// record: none is lost, in a topic or between two.
func TestRetryTopicsLoseNothingWhenATierConsumerIsKilled(t *testing.T) {
	b := newBroker(t)
	topic := newTopic(t, b, "retry-kill", 2)
	group := testenv.UniqueName(t, "retry-kill")
	t.Cleanup(func() {
		for _, rt := range []string{topic + ".retry.1", topic + ".retry.2", topic + ".dlq"} {
			_ = b.DeleteTopic(context.Background(), rt)
		}
	})
	const n = 200
	publishN(t, b, topic, "r", n)
	c := startRetryChild(t, topic, group, 10)
	testenv.WaitFor(t, 60*time.Second, "the child to block in a tier's handler", func() bool {
		_, _, blocked := c.state()
		return blocked
	})
	time.Sleep(200 * time.Millisecond) // more tier runs under way
	c.kill(t)
	childDone := map[string]bool{}
	for _, line := range c.lines() {
		var body string
		if _, err := fmt.Sscanf(line, "S %s", &body); err == nil {
			childDone[body] = true
		}
	}
	var log runLog
	rc, err := b.NewRetryingConsumer(t.Context(), topic, retryChildConfig(topic), consumer.WithName(group), consumer.WithConcurrency(4))
	if err != nil {
		t.Fatal(err)
	}
	runConsumer(t, rc, consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
		log.add(m)
		log.succeeded(string(m.Body))
		return nil
	}))
	missing := func() []string {
		done := map[string]bool{}
		for _, body := range log.finished() {
			done[body] = true
		}
		var out []string
		for i := range n {
			if body := "r-" + strconv.Itoa(i); !done[body] && !childDone[body] {
				out = append(out, body)
			}
		}
		return out
	}
	testenv.WaitFor(t, 90*time.Second, "every record handled by the child or after it", func() bool { return len(missing()) == 0 })
	t.Logf("the child finished %d records before it was killed; the consumer after it ran %d", len(childDone), len(log.finished()))
	if c := rc.DeadLetter().Count(); c != 0 {
		t.Errorf("%d records dead-lettered, want none", c)
	}
}

// retryChildConfig is the retry topics of the killed child's test.
func retryChildConfig(topic string) kafka.RetryTopics {
	return kafka.RetryTopics{Delays: []time.Duration{300 * time.Millisecond, 300 * time.Millisecond}, DeadLetterTopic: topic + ".dlq", GiveUpOrder: true}
}
