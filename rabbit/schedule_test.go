package rabbit_test

import (
	"context"
	"errors"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/rabbit"
)

// arrivals records when each message (by ID) reached a handler, and what it
// was.
type arrivals struct {
	mu  sync.Mutex
	at  map[string]time.Time
	msg map[string]consumer.Message
}

// consumeArrivals runs a consumer of queue on b until the test ends, and
// returns what it records.
func consumeArrivals(t *testing.T, b *rabbit.Broker, queue string) *arrivals {
	t.Helper()
	a := &arrivals{at: map[string]time.Time{}, msg: map[string]consumer.Message{}}
	l, err := b.NewConsumer(context.Background(), queue)
	must(t, err)
	h := a.handler()
	testenv.Start(t, func(ctx context.Context) error { return l.Run(ctx, h) })
	return a
}

func (a *arrivals) handler() consumer.Handler {
	return consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		a.mu.Lock()
		defer a.mu.Unlock()
		if _, ok := a.at[m.ID]; !ok {
			a.at[m.ID] = time.Now()
			c := *m
			c.Body = append([]byte(nil), m.Body...)
			a.msg[m.ID] = c
		}
		return nil
	})
}

func (a *arrivals) get(id string) (time.Time, consumer.Message, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	t, ok := a.at[id]
	return t, a.msg[id], ok
}

// Messages published with a NotBefore reach their queue's consumer not
// before it and within a second or so after it (the delay rounded up to
// whole seconds, through the delay levels: 1 s takes level 0, 2 s level 1,
// 5 s levels 2 and 0), whole: body, key (none for one sent without: not
// the levels' routing key), id and headers, with no header of
// the levels' dead-lettering (a delayed message is not a dead-lettered
// one); a message of the same call without one comes at once.
func TestDelayedPublishHoldsEachMessageToTheSecond(t *testing.T) {
	b := dial(t)
	name := testenv.UniqueName(t, "delayed")
	deleteLater(t, []string{name}, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	must(t, b.CreateSource(ctx, name, consumer.SourceConfig{}))
	got := consumeArrivals(t, b, name)

	start := time.Now()
	delays := map[string]time.Duration{"d-0": 0, "d-1": time.Second, "d-2": 2 * time.Second, "d-5": 5 * time.Second, "d-3-nokey": 3 * time.Second}
	var msgs []consumer.Message
	for id, d := range delays {
		m := consumer.Message{ID: id, Key: "k-" + id, Body: []byte("body of " + id), Headers: map[string]string{"type": "reminder"}}
		if strings.HasSuffix(id, "nokey") {
			m.Key = ""
		}
		if d > 0 {
			m.NotBefore = start.Add(d)
		}
		msgs = append(msgs, m)
	}
	must(t, b.Publish(ctx, name, msgs...))
	testenv.WaitFor(t, 30*time.Second, "every message handled", func() bool {
		for id := range delays {
			if _, _, ok := got.get(id); !ok {
				return false
			}
		}
		return true
	})
	for id, d := range delays {
		at, m, _ := got.get(id)
		if d > 0 && at.Before(start.Add(d)) {
			t.Errorf("%s, held %s, was handled %s early", id, d, start.Add(d).Sub(at))
		}
		if late := at.Sub(start.Add(d)); late > 3*time.Second {
			t.Errorf("%s, held %s, was handled %s after its time", id, d, late)
		}
		wantKey := "k-" + id
		if strings.HasSuffix(id, "nokey") {
			wantKey = "" // not the routing key of the levels
		}
		if string(m.Body) != "body of "+id || m.Key != wantKey || m.Header("type") != "reminder" || len(m.Headers) != 1 {
			t.Errorf("%s arrived as %+v", id, m)
		}
	}
}

// What the delay levels cannot carry is refused, unsent, naming why, and
// the other messages of the call go: a delay past MaxDelay, centuries
// ahead included (consumer.ErrDelayTooLong), a delayed message to an exchange, whose own
// routing the levels would lose (consumer.ErrDelayNotSupported); a delayed
// message to a queue that does not exist fails instead of vanishing.
func TestDelayedPublishRefusesWhatItCannotHold(t *testing.T) {
	b := dial(t)
	name := testenv.UniqueName(t, "delayed-refused")
	deleteLater(t, []string{name}, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	must(t, b.CreateSource(ctx, name, consumer.SourceConfig{}))

	err := b.Publish(ctx, name,
		consumer.Message{ID: "too-far", NotBefore: time.Now().Add(rabbit.MaxDelay + time.Hour)},
		consumer.Message{ID: "now"})
	var perr *consumer.PublishError
	if !errors.As(err, &perr) || len(perr.Failed) != 1 || perr.Failed[0].Index != 0 || !errors.Is(perr.Failed[0].Err, consumer.ErrDelayTooLong) {
		t.Fatalf("Publish of a delay past MaxDelay = %v; want index 0 alone failing with ErrDelayTooLong", err)
	}

	// Centuries ahead: the time to it saturates a Duration, which must not
	// wrap round to a short delay.
	err = b.Publish(ctx, name, consumer.Message{ID: "centuries", NotBefore: time.Now().AddDate(300, 0, 0)})
	if !errors.As(err, &perr) || len(perr.Failed) != 1 || !errors.Is(perr.Failed[0].Err, consumer.ErrDelayTooLong) {
		t.Fatalf("Publish of a delay of 300 years = %v; want it failing with ErrDelayTooLong", err)
	}

	err = b.Publish(ctx, rabbit.ToExchange("amq.topic"), consumer.Message{ID: "ex", NotBefore: time.Now().Add(time.Minute)})
	if !errors.As(err, &perr) || len(perr.Failed) != 1 || !errors.Is(perr.Failed[0].Err, consumer.ErrDelayNotSupported) {
		t.Fatalf("Publish of a delayed message to an exchange = %v; want it failing with ErrDelayNotSupported", err)
	}

	missing := testenv.UniqueName(t, "delayed-missing")
	err = b.Publish(ctx, missing, consumer.Message{ID: "nowhere", NotBefore: time.Now().Add(time.Minute)})
	if !errors.As(err, &perr) || len(perr.Failed) != 1 || !errors.Is(perr.Failed[0].Err, consumer.ErrSourceNotFound) {
		t.Fatalf("Publish of a delayed message to a missing queue = %v; want it failing with ErrSourceNotFound", err)
	}
	if !strings.Contains(err.Error(), missing) {
		t.Fatalf("the error of a delayed message to a missing queue does not name it: %v", err)
	}
	t.Logf("a delayed message to a missing queue: %v", err)
}

// A message held in the delay levels is durable: the broker stops and
// starts while it waits, and it still reaches its queue, once, after its
// time.
func TestBrokerRestartKeepsDelayedMessages(t *testing.T) {
	if os.Getenv(envRestart) != "1" {
		t.Skipf("restarts the shared RabbitMQ: set %s=1 to run it", envRestart)
	}
	b := dial(t)
	name := testenv.UniqueName(t, "delayed-restart")
	deleteLater(t, []string{name}, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	must(t, b.CreateSource(ctx, name, consumer.SourceConfig{}))
	notBefore := time.Now().Add(12 * time.Second)
	must(t, b.Publish(ctx, name, consumer.Message{ID: "survivor", NotBefore: notBefore}))

	stopped := false
	t.Cleanup(func() {
		if stopped {
			ctl(t, "start_app")
		}
	})
	ctl(t, "stop_app")
	stopped = true
	time.Sleep(2 * time.Second)
	ctl(t, "start_app")
	stopped = false

	got := consumeArrivals(t, b, name)
	testenv.WaitFor(t, 60*time.Second, "the delayed message handled after the restart", func() bool {
		_, _, ok := got.get("survivor")
		return ok
	})
	if at, _, _ := got.get("survivor"); at.Before(notBefore) {
		t.Fatalf("the delayed message was handled %s before its time", notBefore.Sub(at))
	}
}

// Delayed messages whose queue was deleted while they waited go to the
// orphans queue when their time comes, and do not stop the delayed
// messages of other queues: without it, a level's at-least-once
// dead-lettering kept them and retried them for ever, and 32 of them
// stopped every later message of the level. Nothing consumes the orphans
// queue, so the Broker that published them tells the operator: a warning
// with the count, and the count in MetricDelayOrphans.
func TestDelayedMessagesOfADeletedQueueDoNotBlockOthers(t *testing.T) {
	log, logs := capture(t)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	b := dial(t, rabbit.WithLogger(log), rabbit.WithMeterProvider(mp))
	rabbit.SetOrphanCheck(b, 200*time.Millisecond)
	gone := testenv.UniqueName(t, "delayed-gone")
	live := testenv.UniqueName(t, "delayed-live")
	deleteLater(t, []string{gone, live}, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	must(t, b.CreateSource(ctx, gone, consumer.SourceConfig{}))
	must(t, b.CreateSource(ctx, live, consumer.SourceConfig{}))
	orphans := func() int {
		q, err := rawChannel(t).QueueDeclarePassive("ferry.delay.orphans", true, false, false, false, nil)
		must(t, err)
		return q.Messages
	}
	var msgs []consumer.Message
	for i := range 40 {
		msgs = append(msgs, consumer.Message{ID: "orphan-" + strconv.Itoa(i), NotBefore: time.Now().Add(time.Second)})
	}
	must(t, b.Publish(ctx, gone, msgs...))
	before := orphans()
	must(t, b.DeleteSource(ctx, gone))
	time.Sleep(1500 * time.Millisecond) // their time has come
	must(t, b.Publish(ctx, live, consumer.Message{ID: "after", NotBefore: time.Now().Add(time.Second)}))

	got := consumeArrivals(t, b, live)
	testenv.WaitFor(t, 30*time.Second, "the delayed message of the live queue handled", func() bool {
		_, _, ok := got.get("after")
		return ok
	})
	testenv.WaitFor(t, 30*time.Second, "the 40 orphans in ferry.delay.orphans", func() bool { return orphans() >= before+40 })

	// What the operator sees.
	warned := regexp.MustCompile(`level=WARN msg=".*wait in ferry\.delay\.orphans.*" .*messages=(\d+)`)
	testenv.WaitFor(t, 10*time.Second, "a warning that counts the 40 orphans", func() bool {
		for _, m := range warned.FindAllStringSubmatch(logs.String(), -1) {
			if n, _ := strconv.Atoi(m[1]); n >= before+40 {
				return true
			}
		}
		return false
	})
	testenv.WaitFor(t, 10*time.Second, rabbit.MetricDelayOrphans+" to count the 40 orphans", func() bool {
		var rm metricdata.ResourceMetrics
		must(t, reader.Collect(context.Background(), &rm))
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				if g, ok := m.Data.(metricdata.Gauge[int64]); ok && m.Name == rabbit.MetricDelayOrphans && len(g.DataPoints) == 1 {
					if m.Unit != "{message}" {
						t.Fatalf("%s has the unit %q; docs/METRICS.md gives {message}", m.Name, m.Unit)
					}
					var keys []string
					for _, kv := range g.DataPoints[0].Attributes.ToSlice() {
						keys = append(keys, string(kv.Key))
					}
					// As tools/docscheck's needsABroker has them, for the alerts' labels.
					if want := []string{"ferry.rabbit.vhost", "messaging.destination.name", "messaging.system", "server.address", "server.port"}; !slices.Equal(keys, want) {
						t.Fatalf("%s has the attributes %v, want %v", m.Name, keys, want)
					}
					return g.DataPoints[0].Value >= int64(before+40)
				}
			}
		}
		return false
	})
	// A closed Broker reports nothing more (the provider let go of it).
	must(t, b.Close())
	var rm metricdata.ResourceMetrics
	must(t, reader.Collect(context.Background(), &rm))
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if g, ok := m.Data.(metricdata.Gauge[int64]); ok && m.Name == rabbit.MetricDelayOrphans && len(g.DataPoints) > 0 {
				t.Errorf("%s still reports %d after Close", m.Name, g.DataPoints[0].Value)
			}
		}
	}
}

// The orphans queue is declared with no delivery limit (RabbitMQ 4 gives a
// quorum queue 20 by default): a message in it, looked at (a get returned
// unacked, as ferry dlq peek does) more often than that, stays. And when
// the queue is deleted, the Broker's watch says so and declares it again:
// without it, the delivery exchange's alternate routes nowhere and an
// orphan would stay in its level for ever, stopping the level.
func TestOrphansSurviveBeingLookedAtAndComeBackWhenDeleted(t *testing.T) {
	ch := rawChannel(t)
	if _, err := ch.QueueDelete("ferry.delay.orphans", false, false, false); err != nil {
		t.Fatal(err)
	}
	log, logs := capture(t)
	b := dial(t, rabbit.WithLogger(log))
	rabbit.SetOrphanCheck(b, 200*time.Millisecond)
	gone := testenv.UniqueName(t, "orphan-looked-at")
	deleteLater(t, []string{gone}, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	must(t, b.CreateSource(ctx, gone, consumer.SourceConfig{}))
	must(t, b.Publish(ctx, gone, consumer.Message{ID: "looked-at", NotBefore: time.Now().Add(time.Second)}))
	must(t, b.DeleteSource(ctx, gone))

	for i := range 25 {
		d := getOne(t, ch, "ferry.delay.orphans")
		if d.MessageId != "looked-at" {
			t.Fatalf("look %d found %q in ferry.delay.orphans, want looked-at alone", i, d.MessageId)
		}
		must(t, d.Nack(false, true))
	}
	if d := getOne(t, ch, "ferry.delay.orphans"); d.MessageId != "looked-at" {
		t.Fatalf("after 25 looks ferry.delay.orphans holds %q, want looked-at", d.MessageId)
	}
	if _, err := ch.QueueDelete("ferry.delay.orphans", false, false, false); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 10*time.Second, "the watch to say the orphans queue was deleted", func() bool {
		return strings.Contains(logs.String(), "ferry.delay.orphans was deleted; declared it again")
	})
	if _, err := rawChannel(t).QueueDeclarePassive("ferry.delay.orphans", true, false, false, false, nil); err != nil {
		t.Fatalf("the watch did not declare the orphans queue again: %v", err)
	}
	// And bound it: a message of a deleted queue reaches it.
	again := testenv.UniqueName(t, "orphan-again")
	deleteLater(t, []string{again}, nil)
	must(t, b.CreateSource(ctx, again, consumer.SourceConfig{}))
	must(t, b.Publish(ctx, again, consumer.Message{ID: "again", NotBefore: time.Now().Add(time.Second)}))
	must(t, b.DeleteSource(ctx, again))
	if d := getOne(t, ch, "ferry.delay.orphans"); d.MessageId != "again" {
		t.Fatalf("the orphans queue declared again holds %q, want again", d.MessageId)
	}
}

// An orphans queue declared before it had no delivery limit (RabbitMQ 4's
// default of 20) is kept, and the Broker says that it drops a message
// looked at too often: declaring it again without the limit would be
// refused (406), and delayed publish with it.
func TestOrphansWithTheDefaultDeliveryLimitAreKeptWithAWarning(t *testing.T) {
	if v := serverVersion(t); !strings.HasPrefix(v, "4.") {
		t.Skipf("RabbitMQ %s sets no delivery limit of its own", v)
	}
	ch := rawChannel(t)
	if _, err := ch.QueueDelete("ferry.delay.orphans", false, false, false); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare("ferry.delay.orphans", true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = rawChannel(t).QueueDelete("ferry.delay.orphans", false, false, false) }) // the next declares it without
	log, logs := capture(t)
	b := dial(t, rabbit.WithLogger(log))
	q := testenv.UniqueName(t, "orphan-limit")
	deleteLater(t, []string{q}, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	must(t, b.CreateSource(ctx, q, consumer.SourceConfig{}))
	must(t, b.Publish(ctx, q, consumer.Message{ID: "delayed", NotBefore: time.Now().Add(time.Second)}))
	if !strings.Contains(logs.String(), "ferry.delay.orphans has RabbitMQ's default delivery limit") {
		t.Errorf("no warning that the orphans queue drops a message looked at too often; the log:\n%s", logs)
	}
}

// A delayed message that is later really dead-lettered (rejected by its
// consumer into its queue's dead-letter queue) says where it died, not in
// which delay level it waited: on RabbitMQ 3.10, which sets only the first
// death, the first death was always a level. (Its exchange is
// ferry.delay.deliver, which did route it to the queue.)
func TestDelayedMessageDeadLetteredLaterNamesItsQueue(t *testing.T) {
	b := dial(t)
	name := testenv.UniqueName(t, "delayed-dl")
	dlq := name + "-dlq"
	deleteLater(t, []string{name, dlq}, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	must(t, b.CreateSource(ctx, name, consumer.SourceConfig{DeadLetter: dlq}))
	must(t, b.Publish(ctx, name, consumer.Message{ID: "late-poison", NotBefore: time.Now().Add(time.Second)}))
	ch := rawChannel(t)
	d := getOne(t, ch, name)
	must(t, d.Reject(false))

	got := consumeArrivals(t, b, dlq)
	testenv.WaitFor(t, 30*time.Second, "the dead-lettered message handled", func() bool {
		_, _, ok := got.get("late-poison")
		return ok
	})
	_, m, _ := got.get("late-poison")
	if m.Header("x-first-death-queue") != name || m.Header("x-first-death-reason") != "rejected" {
		t.Fatalf("the dead-lettered delayed message has headers %v; want its first death in %s, rejected", m.Headers, name)
	}
	for k, v := range m.Headers {
		if strings.Contains(v, "ferry.delay.level.") {
			t.Errorf("header %s=%q names a delay level", k, v)
		}
	}
}
