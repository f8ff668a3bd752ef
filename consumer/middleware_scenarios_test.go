package consumer_test

// The seed scenarios of the shared middleware, on the memory broker: each one
// runs a real delivery loop over a real queue and counts what happened. The
// broker issues run the same scenarios on SQS, RabbitMQ and Kafka.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/memory"
)

var quiet = slog.New(slog.DiscardHandler)

// scenario is one broker with a work queue and its dead-letter queue.
type scenario struct {
	t     *testing.T
	b     *memory.Broker
	queue string
	dlq   string
}

func newScenario(t *testing.T, name string, visibility time.Duration) *scenario {
	t.Helper()
	b, err := memory.New(memory.WithAutoCreate(false))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	s := &scenario{t: t, b: b, queue: name, dlq: name + "-dlq"}
	for _, q := range []string{s.queue, s.dlq} {
		if err := b.CreateQueue(q, memory.QueueConfig{VisibilityTimeout: visibility}); err != nil {
			t.Fatal(err)
		}
	}
	return s
}

// publish puts n messages on the queue, with ids and bodies "<prefix><i>".
func (s *scenario) publish(prefix string, n int) {
	s.t.Helper()
	const batch = 500
	for i := 0; i < n; i += batch {
		msgs := make([]consumer.Message, 0, batch)
		for j := i; j < min(i+batch, n); j++ {
			id := prefix + strconv.Itoa(j)
			msgs = append(msgs, consumer.Message{ID: id, Key: "k" + strconv.Itoa(j%7), Body: []byte(id)})
		}
		if err := s.b.Publish(context.Background(), s.queue, msgs...); err != nil {
			s.t.Fatal(err)
		}
	}
}

// run starts a delivery loop over the queue; stop (also run at cleanup)
// ends it and waits for Run to return.
func (s *scenario) run(h consumer.Handler, opts ...consumer.Option) (loop *consumer.Loop, stop func()) {
	s.t.Helper()
	opts = append([]consumer.Option{consumer.WithLogger(quiet)}, opts...)
	l, err := s.b.NewConsumer(context.Background(), s.queue, opts...)
	if err != nil {
		s.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- l.Run(ctx, h) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				s.t.Errorf("Run = %v", err)
			}
		})
	}
	s.t.Cleanup(stop)
	return l, stop
}

// counter counts calls per message id.
type counter struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *counter) add(id string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[string]int{}
	}
	c.n[id]++
	return c.n[id]
}

func (c *counter) get(id string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[id]
}

func (c *counter) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.n)
}

func standard(t *testing.T, pub consumer.Publisher, dlq string, opts ...consumer.StandardOption) *consumer.Stack {
	t.Helper()
	opts = append([]consumer.StandardOption{consumer.StandardDeadLetter(consumer.DeadLetterLogger(quiet))}, opts...)
	st, err := consumer.Standard(pub, dlq, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// Steady: 10k messages, each acked once, nothing dead-lettered.
func TestScenarioSteadyEveryMessageAckedOnce(t *testing.T) {
	s := newScenario(t, "steady", 30*time.Second)
	const n = 10000
	s.publish("m", n)
	st := standard(t, s.b, s.dlq)
	var seen counter
	loop, stop := s.run(st.Wrap(consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
		seen.add(m.ID)
		return nil
	})))
	testenv.WaitFor(t, 30*time.Second, "10k acks", func() bool { return s.b.Stats(s.queue).Acked == n })
	stop()
	if seen.len() != n {
		t.Errorf("handled %d distinct messages, want %d", seen.len(), n)
	}
	for i := range n {
		if c := seen.get("m" + strconv.Itoa(i)); c != 1 {
			t.Fatalf("message m%d handled %d times, want once", i, c)
		}
	}
	if ls := loop.Stats(); ls.Acked != n || ls.Failed != 0 || ls.Returned != 0 {
		t.Errorf("loop stats %+v: want %d acked, nothing failed or returned", ls, n)
	}
	if got := len(s.b.Messages(s.dlq)); got != 0 || st.DeadLetter.Count() != 0 {
		t.Errorf("dead-letter queue holds %d, count %d; want none", got, st.DeadLetter.Count())
	}
	if q := s.b.Stats(s.queue); q.Visible+q.Delayed+q.InFlight != 0 {
		t.Errorf("queue still holds messages: %+v", q)
	}
}

// Downstream slow: a 200ms dependency; nothing errors, the backlog grows and
// the lag shows it.
func TestScenarioSlowDownstreamShowsLagWithoutErrors(t *testing.T) {
	s := newScenario(t, "slow", 30*time.Second)
	const n = 40
	st := standard(t, s.b, s.dlq)
	loop, _ := s.run(st.Wrap(consumer.HandlerFunc(func(ctx context.Context, _ *consumer.Message) error {
		select { // the slow dependency: 200ms per call
		case <-time.After(200 * time.Millisecond):
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})), consumer.WithConcurrency(2), consumer.WithMaxInFlight(2))
	s.publish("m", n)

	// The backlog is visible at once, and its oldest message ages while it
	// waits: the lag grows although nothing fails.
	first, err := loop.Lag(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if first.Messages < n/2 {
		t.Errorf("lag right after publishing = %d messages, want at least %d waiting", first.Messages, n/2)
	}
	var grown consumer.Lag
	testenv.WaitFor(t, 30*time.Second, "the oldest message to age past 400ms", func() bool {
		grown, err = loop.Lag(context.Background())
		return err == nil && grown.OldestAge > first.OldestAge+400*time.Millisecond && grown.Messages > 0
	})
	t.Logf("lag: %d waiting, oldest %s; later %d waiting, oldest %s", first.Messages, first.OldestAge, grown.Messages, grown.OldestAge)

	testenv.WaitFor(t, 30*time.Second, "the backlog to drain", func() bool { return s.b.Stats(s.queue).Acked == n })
	if ls := loop.Stats(); ls.Failed != 0 || ls.Returned != 0 || ls.Held != 0 {
		t.Errorf("loop stats %+v: a slow dependency must cause no failures", ls)
	}
	if st.DeadLetter.Count() != 0 || st.Breaker.Opened() != 0 {
		t.Errorf("dead-lettered %d, breaker opened %d; want 0, 0", st.DeadLetter.Count(), st.Breaker.Opened())
	}
}

// dependency fails every call until up is closed; it counts the calls made
// while it was down.
type dependency struct {
	mu       sync.Mutex
	down     bool
	whileDn  int
	total    int
	cooldown time.Duration // how long a failing call takes
}

func (d *dependency) call(ctx context.Context) error {
	d.mu.Lock()
	d.total++
	down := d.down
	if down {
		d.whileDn++
	}
	d.mu.Unlock()
	if !down {
		return nil
	}
	// A refused call still takes a moment (a connection attempt).
	t := time.NewTimer(d.cooldown)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
	return errDependencyDown
}

func (d *dependency) setDown(down bool) {
	d.mu.Lock()
	d.down = down
	d.mu.Unlock()
}

func (d *dependency) callsWhileDown() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.whileDn
}

var errDependencyDown = errors.New("dependency down")

// Retry storm and protected: a dependency fails for 5s. Unprotected, a
// consumer that redelivers at once hammers it. With the standard stack it
// receives at most a small bound of calls while down:
//
//	Failures + (Concurrency-1) + Trials*(outage/OpenFor + 1)
//
// (the calls that open the breaker, those already in flight when it opened,
// and one trial per open period): 5 + 7 + 1*(10+1) = 23 calls for a 5s
// outage here, where outage is measured from the breaker's first opening to
// the dependency's recovery (a loaded machine may stretch it a little).
// Nothing is dead-lettered, and after the outage every message is processed,
// none lost and none twice.
func TestScenarioRetryStormIsBoundedByBreakerAndNothingIsLost(t *testing.T) {
	const (
		outage      = 5 * time.Second
		n           = 200
		concurrency = 8
		failures    = 5
		openFor     = 500 * time.Millisecond
		trials      = 1
	)

	unprotected := &dependency{cooldown: time.Millisecond}
	protected := &dependency{cooldown: time.Millisecond}
	unprotected.setDown(true)
	protected.setDown(true)

	// The unprotected consumer: no middleware, and every failure comes back
	// at once.
	su := newScenario(t, "storm-unprotected", 2*time.Second)
	su.publish("m", n)
	var unprotectedOK counter
	su.run(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if err := unprotected.call(ctx); err != nil {
			return err
		}
		unprotectedOK.add(m.ID)
		return nil
	}), consumer.WithConcurrency(concurrency), consumer.WithRedeliveryBackoff(0, 0))

	var firstOpen atomic.Int64
	// The protected consumer: the standard stack. A visibility timeout far
	// shorter than the outage checks that held messages keep their lease.
	sp := newScenario(t, "storm-protected", 2*time.Second)
	sp.publish("m", n)
	st := standard(t, sp.b, sp.dlq,
		consumer.StandardRetry(consumer.RetryAttempts(3), consumer.RetryInitial(20*time.Millisecond),
			consumer.RetryMaxInterval(200*time.Millisecond), consumer.RetryRedeliveryMax(time.Second)),
		consumer.StandardBreaker(consumer.BreakerFailures(failures), consumer.BreakerOpenFor(openFor), consumer.BreakerTrials(trials),
			consumer.BreakerOnStateChange(func(_, to consumer.BreakerState) {
				if to == consumer.BreakerOpen {
					firstOpen.CompareAndSwap(0, time.Now().UnixNano())
				}
			})),
		consumer.StandardDeadLetter(consumer.DeadLetterMaxAttempts(5)))
	var protectedOK counter
	loop, _ := sp.run(st.Wrap(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if err := protected.call(ctx); err != nil {
			return err
		}
		protectedOK.add(m.ID)
		return nil
	})), consumer.WithConcurrency(concurrency))

	testenv.WaitFor(t, 30*time.Second, "the breaker to open", func() bool { return st.Breaker.State() == consumer.BreakerOpen })
	time.Sleep(outage) // the outage itself, not a synchronisation
	unprotected.setDown(false)
	protected.setDown(false)
	hammered, guarded := unprotected.callsWhileDown(), protected.callsWhileDown()
	measured := time.Since(time.Unix(0, firstOpen.Load()))
	bound := failures + (concurrency - 1) + trials*(int(measured/openFor)+1)
	t.Logf("calls while down: unprotected %d, protected %d (bound %d for %s); breaker opened %d times, held %d messages",
		hammered, guarded, bound, measured.Round(time.Millisecond), st.Breaker.Opened(), st.Breaker.Held())

	if guarded > bound {
		t.Errorf("protected dependency got %d calls while down, want at most %d", guarded, bound)
	}
	if hammered <= 10*bound {
		t.Errorf("unprotected dependency got only %d calls while down; the comparison needs more than %d", hammered, 10*bound)
	}
	if st.Breaker.Held() == 0 {
		t.Error("the breaker held no message while the dependency was down")
	}

	testenv.WaitFor(t, 30*time.Second, "every protected message to be processed", func() bool { return sp.b.Stats(sp.queue).Acked == n })
	testenv.WaitFor(t, 30*time.Second, "every unprotected message to be processed", func() bool { return su.b.Stats(su.queue).Acked == n })
	if st.DeadLetter.Count() != 0 || len(sp.b.Messages(sp.dlq)) != 0 {
		t.Errorf("dead-lettered %d during an outage, want 0", st.DeadLetter.Count())
	}
	for i := range n {
		if c := protectedOK.get("m" + strconv.Itoa(i)); c != 1 {
			t.Errorf("protected message m%d processed %d times, want once", i, c)
		}
	}
	if q := sp.b.Stats(sp.queue); q.Visible+q.Delayed+q.InFlight != 0 {
		t.Errorf("protected queue still holds messages: %+v", q)
	}
	if st.Breaker.State() != consumer.BreakerClosed {
		t.Errorf("breaker %s after the outage, want closed", st.Breaker.State())
	}
	if ls := loop.Stats(); ls.Held == 0 {
		t.Errorf("loop stats %+v: want held deliveries", ls)
	}
}

// poisonHandler fails three kinds of message and passes the rest.
func poisonHandler(calls *counter) consumer.Handler {
	return consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
		calls.add(m.ID)
		switch m.ID {
		case "bad-input":
			return consumer.Permanent(fmt.Errorf("decode %s: %w", m.ID, strconv.ErrSyntax))
		case "always-fails":
			return errDependencyDown
		case "panics":
			panic("nil map in handler")
		}
		return nil
	})
}

// Poison: a permanently bad message is dead-lettered after one attempt, one
// that always fails transiently and one that panics after exactly
// MaxAttempts, each with its story in the headers; the good messages around
// them are unaffected. The same counts hold whichever side of Retry the
// DeadLetter middleware is on.
func TestScenarioPoisonMessagesAreDeadLetteredWithTheirStory(t *testing.T) {
	const maxAttempts, perDelivery, good = 5, 2, 30
	for _, order := range []string{"standard", "deadletter-inside-retry"} {
		t.Run(order, func(t *testing.T) {
			s := newScenario(t, "poison-"+order, 30*time.Second)
			s.publish("good", good/2)
			for _, id := range []string{"bad-input", "always-fails", "panics"} {
				if err := s.b.Publish(context.Background(), s.queue, consumer.Message{ID: id, Key: "key-" + id, Body: []byte(id),
					Headers: map[string]string{"trace-id": "t-" + id}}); err != nil {
					t.Fatal(err)
				}
			}
			s.publish("more", good/2)

			// The breaker is set not to open here: a message that always fails
			// transiently is what an outage looks like, and the breaker would
			// rightly hold it (see the storm scenario).
			st := standard(t, s.b, s.dlq,
				consumer.StandardRetry(consumer.RetryAttempts(perDelivery), consumer.RetryInitial(time.Millisecond),
					consumer.RetryMaxInterval(5*time.Millisecond), consumer.RetryRedeliveryMax(20*time.Millisecond)),
				consumer.StandardBreaker(consumer.BreakerFailures(1000)),
				consumer.StandardDeadLetter(consumer.DeadLetterMaxAttempts(maxAttempts), consumer.DeadLetterConsumerName("poison-test")))
			mws := []consumer.Middleware{st.DeadLetter.Wrap, st.Retry.Wrap, st.Breaker.Wrap, consumer.Timeout(st.Timeout), consumer.Recover()}
			if order == "deadletter-inside-retry" {
				mws[0], mws[1] = mws[1], mws[0]
			}
			var calls counter
			s.run(consumer.Chain(poisonHandler(&calls), mws...), consumer.WithConcurrency(4))

			testenv.WaitFor(t, 30*time.Second, "three dead letters and every good message acked", func() bool {
				return len(s.b.Messages(s.dlq)) == 3 && s.b.Stats(s.queue).Acked == good+3
			})
			want := map[string]struct {
				calls  int
				reason string
				kind   string
			}{
				"bad-input":    {1, consumer.DLQReasonPermanent, "permanent"},
				"always-fails": {maxAttempts, consumer.DLQReasonMaxAttempts, "error"},
				"panics":       {maxAttempts, consumer.DLQReasonMaxAttempts, "panic"},
			}
			for id, w := range want {
				if c := calls.get(id); c != w.calls {
					t.Errorf("%s: handler ran %d times, want %d", id, c, w.calls)
				}
			}
			for _, dl := range s.b.Messages(s.dlq) {
				id := dl.Headers[consumer.HeaderDLQMessageID]
				w, ok := want[id]
				if !ok {
					t.Errorf("unexpected dead letter %q", id)
					continue
				}
				h := dl.Headers
				checks := map[string]string{
					consumer.HeaderDLQSource:    s.queue,
					consumer.HeaderDLQKey:       "key-" + id,
					consumer.HeaderDLQAttempts:  strconv.Itoa(w.calls),
					consumer.HeaderDLQReason:    w.reason,
					consumer.HeaderDLQErrorKind: w.kind,
					consumer.HeaderDLQConsumer:  "poison-test",
					"trace-id":                  "t-" + id,
				}
				for k, v := range checks {
					if h[k] != v {
						t.Errorf("%s: header %s = %q, want %q", id, k, h[k], v)
					}
				}
				if string(dl.Body) != id || dl.Key != "key-"+id {
					t.Errorf("%s: body %q key %q changed", id, dl.Body, dl.Key)
				}
				for _, k := range []string{consumer.HeaderDLQError, consumer.HeaderDLQErrorType, consumer.HeaderDLQHost,
					consumer.HeaderDLQFirstFailure, consumer.HeaderDLQLastFailure, consumer.HeaderDLQDeliveries} {
					if h[k] == "" {
						t.Errorf("%s: header %s missing", id, k)
					}
				}
				first, err1 := time.Parse(time.RFC3339Nano, h[consumer.HeaderDLQFirstFailure])
				last, err2 := time.Parse(time.RFC3339Nano, h[consumer.HeaderDLQLastFailure])
				if err1 != nil || err2 != nil || last.Before(first) {
					t.Errorf("%s: failure times %q .. %q", id, h[consumer.HeaderDLQFirstFailure], h[consumer.HeaderDLQLastFailure])
				}
				if _, has := h[consumer.HeaderDLQOffset]; has {
					t.Errorf("%s: offset header on a broker without offsets", id)
				}
			}
			for _, p := range []string{"good", "more"} {
				for i := range good / 2 {
					if c := calls.get(p + strconv.Itoa(i)); c != 1 {
						t.Errorf("good message %s%d ran %d times, want once", p, i, c)
					}
				}
			}
			if st.DeadLetter.Count() != 3 {
				t.Errorf("dead-letter count = %d, want 3", st.DeadLetter.Count())
			}
		})
	}
}

// downPublisher is the memory broker as a dead-letter destination that can
// be made unreachable.
type downPublisher struct {
	consumer.Publisher
	down atomic.Bool
}

var errDestinationDown = errors.New("dead-letter destination unreachable")

func (p *downPublisher) Publish(ctx context.Context, dest string, msgs ...consumer.Message) error {
	if p.down.Load() {
		return errDestinationDown
	}
	return p.Publisher.Publish(ctx, dest, msgs...)
}

// Dead-letter publisher down: nothing is acked and nothing is lost; when the
// destination is back, the message is dead-lettered and only then acked.
func TestScenarioDeadLetterPublisherDownAcksNothingAndLosesNothing(t *testing.T) {
	s := newScenario(t, "dlq-down", 30*time.Second)
	pub := &downPublisher{Publisher: s.b}
	pub.down.Store(true)
	st := standard(t, pub, s.dlq, consumer.StandardDeadLetter(consumer.DeadLetterMaxAttempts(2)),
		consumer.StandardRetry(consumer.RetryInitial(time.Millisecond), consumer.RetryMaxInterval(5*time.Millisecond)))
	var calls counter
	s.run(st.Wrap(poisonHandler(&calls)), consumer.WithRedeliveryBackoff(5*time.Millisecond, 50*time.Millisecond))
	s.publish("good", 10)
	if err := s.b.Publish(context.Background(), s.queue, consumer.Message{ID: "bad-input", Body: []byte("x")},
		consumer.Message{ID: "always-fails", Body: []byte("y")}); err != nil {
		t.Fatal(err)
	}

	testenv.WaitFor(t, 30*time.Second, "several failed dead-letter publishes for each poison message", func() bool {
		return st.DeadLetter.PublishFailures() >= 6 && calls.get("bad-input") >= 3
	})
	if q := s.b.Stats(s.queue); q.Acked != 10 {
		t.Errorf("acked %d while the dead-letter destination was down, want only the 10 good ones", q.Acked)
	}
	held := map[string]bool{}
	for _, m := range s.b.Messages(s.queue) {
		held[m.ID] = true
	}
	if !held["bad-input"] || !held["always-fails"] || len(held) != 2 {
		t.Errorf("queue holds %v, want exactly the two poison messages", held)
	}
	if st.DeadLetter.Count() != 0 || len(s.b.Messages(s.dlq)) != 0 {
		t.Errorf("dead-letter count %d with the destination down", st.DeadLetter.Count())
	}

	pub.down.Store(false)
	testenv.WaitFor(t, 30*time.Second, "both poison messages dead-lettered and acked", func() bool {
		return len(s.b.Messages(s.dlq)) == 2 && s.b.Stats(s.queue).Acked == 12
	})
	if left := s.b.Messages(s.queue); len(left) != 0 {
		t.Errorf("queue still holds %d messages", len(left))
	}
	if st.DeadLetter.Count() != 2 {
		t.Errorf("dead-letter count = %d, want 2", st.DeadLetter.Count())
	}
}
