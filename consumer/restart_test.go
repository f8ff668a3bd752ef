package consumer_test

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
)

// Three graceful restarts with every message fetched and none finished
// (a long handler, a short grace), then one transient failure per message:
// no message is dead-lettered, and each runs with an Attempt that counts
// its real runs. A restart never costs a message its retries.
func TestGracefulRestartsCostNoRetries(t *testing.T) {
	s := newScenario(t, "restarts", 30*time.Second)
	s.publish("m", 24)
	opts := []consumer.Option{consumer.WithConcurrency(1), consumer.WithMaxInFlight(24), consumer.WithShutdownGrace(50 * time.Millisecond)}

	var mu sync.Mutex
	runs := map[string]int{}
	for restart := 1; restart <= 3; restart++ {
		started := make(chan struct{}, 24)
		l, stop := s.run(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			mu.Lock()
			runs[m.ID]++
			mu.Unlock()
			started <- struct{}{}
			<-ctx.Done() // longer than the grace: cut short by the shutdown
			return ctx.Err()
		}), opts...)
		<-started
		testenv.WaitFor(t, 30*time.Second, "all 24 to be fetched", func() bool { return l.Stats().Fetched == 24 })
		stop()
	}

	// Every message fails once: a dependency that fails that often would
	// open a breaker, which is not what this test is about.
	stack := standard(t, s.b, s.dlq, consumer.StandardBreaker(consumer.BreakerFailures(1000)))
	var handled counter
	firstAttempt := map[string]int{}
	s.run(stack.Wrap(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		defer mu.Unlock()
		if _, seen := firstAttempt[m.ID]; !seen {
			firstAttempt[m.ID] = m.Attempt
			if want := runs[m.ID] + 1; m.Attempt != want {
				t.Errorf("%s: Attempt %d on its first run after the restarts, want %d (it ran %d times before)", m.ID, m.Attempt, want, runs[m.ID])
			}
			return errors.New("transient") // once per message
		}
		handled.add(m.ID)
		return nil
	})), consumer.WithConcurrency(4))
	testenv.WaitFor(t, 30*time.Second, "all 24 handled", func() bool { return handled.len() == 24 })
	if n := len(s.b.Messages(s.dlq)); n != 0 {
		t.Fatalf("%d of 24 good messages dead-lettered after three graceful restarts and one transient failure", n)
	}
	if stack.DeadLetter.Count() != 0 {
		t.Fatalf("DeadLetter.Count = %d, want 0", stack.DeadLetter.Count())
	}
}

// A message that always fails is dead-lettered with the truth in its
// headers: the attempts are its handler runs, counted across restarts that
// handed it back, and the deliveries are the broker's.
func TestDeadLetteredAttemptsAreHandlerRunsAcrossRestarts(t *testing.T) {
	s := newScenario(t, "runs", 30*time.Second)
	s.publish("p", 1)
	var mu sync.Mutex
	calls := 0
	stack := standard(t, s.b, s.dlq,
		consumer.StandardRetry(consumer.RetryAttempts(2), consumer.RetryInitial(time.Millisecond), consumer.RetryRedeliveryMax(time.Millisecond)),
		consumer.StandardDeadLetter(consumer.DeadLetterMaxAttempts(5)),
		consumer.StandardBreaker(consumer.BreakerFailures(1000)))
	h := stack.Wrap(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		calls++
		mu.Unlock()
		return errors.New("always")
	}))
	// Two restarts that fetch the message and hand it back: a long handler
	// on the only worker, cut short by a short grace. The message may run
	// there (and be cut short: a run), or wait behind the blocker and go
	// back unstarted.
	s.publish("blocker", 1)
	for i := 0; i < 2; i++ {
		l, stop := s.run(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			if m.ID == "p0" {
				mu.Lock()
				calls++
				mu.Unlock()
			}
			<-ctx.Done()
			return ctx.Err()
		}), consumer.WithConcurrency(1), consumer.WithShutdownGrace(time.Millisecond))
		testenv.WaitFor(t, 30*time.Second, "both fetched", func() bool { return l.Stats().Fetched == 2 })
		stop()
	}
	s.run(h, consumer.WithConcurrency(1))
	testenv.WaitFor(t, 30*time.Second, "the message to be dead-lettered", func() bool { return len(s.b.Messages(s.dlq)) == 1 })
	dead := s.b.Messages(s.dlq)[0]
	mu.Lock()
	defer mu.Unlock()
	if got := dead.Header(consumer.HeaderDLQAttempts); got != strconv.Itoa(calls) || calls != 5 {
		t.Errorf("%s = %s, handler ran %d times, want both 5", consumer.HeaderDLQAttempts, got, calls)
	}
	deliveries, _ := strconv.Atoi(dead.Header(consumer.HeaderDLQDeliveries))
	if deliveries < 4 {
		t.Errorf("%s = %d, want the broker's count: 2 restarts and at least 2 deliveries of 2 runs", consumer.HeaderDLQDeliveries, deliveries)
	}
	if u := dead.Header(consumer.HeaderDLQUnseenDeliveries); u != "" {
		t.Errorf("%s = %s, want none: every run was counted", consumer.HeaderDLQUnseenDeliveries, u)
	}
}

// In at-most-once mode an open breaker holds messages before they are
// acked: none is acked and then dropped unrun. Every message is acked exactly
// when its handler runs, and once the dependency is back all of them have
// run.
func TestAtMostOnceBreakerHoldsBeforeTheAck(t *testing.T) {
	s := newScenario(t, "amo-breaker", 30*time.Second)
	s.publish("a", 200)
	breaker, err := consumer.NewBreaker(consumer.BreakerFailures(3), consumer.BreakerOpenFor(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	down := time.Now().Add(300 * time.Millisecond)
	var ran counter
	h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		ran.add(m.ID)
		if time.Now().Before(down) {
			return errors.New("dependency down")
		}
		return nil
	}), breaker.Wrap, consumer.Recover())
	l, _ := s.run(h, consumer.WithDeliveryMode(consumer.AtMostOnce), consumer.WithConcurrency(4))
	testenv.WaitFor(t, 30*time.Second, "every message acked", func() bool { return s.b.Stats(s.queue).Acked == 200 })
	if ran.len() != 200 {
		t.Fatalf("%d of 200 messages ran, yet all were acked: %d acked and dropped while the breaker was open", ran.len(), 200-ran.len())
	}
	if breaker.Opened() == 0 || l.Stats().Held == 0 {
		t.Fatalf("the breaker never opened (opened %d, held %d): the test did not test anything", breaker.Opened(), l.Stats().Held)
	}
	for i := 0; i < 200; i++ {
		if n := ran.get("a" + strconv.Itoa(i)); n != 1 {
			t.Errorf("a%d ran %d times in at-most-once mode", i, n)
		}
	}
}

// The loop's ledger remembers the runs of every message it returned, by
// (source, id), and countPriorRuns takes an entry whenever it covers more
// deliveries than the broker's own Known, which for a fresh message is
// none. A different message that reuses the id (an outbox row published
// again after a crash, a redrive, any producer-set id on a standard queue)
// then starts with the returned message's runs: its first run says Attempt
// 2, and DeadLetter spends its budget early. The ledger entry should only be
// used for a delivery that came after the one it recorded
// (Message.Deliveries > entry.Deliveries).
func TestLedgerLendsNoRunsToAFreshMessageWithTheSameID(t *testing.T) {
	s := newScenario(t, "review-ledger", 30*time.Second)
	pub := func(body string) {
		t.Helper()
		if err := s.b.Publish(context.Background(), s.queue, consumer.Message{ID: "dup", Body: []byte(body)}); err != nil {
			t.Fatal(err)
		}
	}
	pub("a")
	returned := make(chan struct{})
	got := make(chan int, 1)
	l, stop := s.run(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if string(m.Body) == "a" {
			close(returned)
			return consumer.RetryAfter(errors.New("transient"), time.Hour)
		}
		got <- m.Attempt
		return nil
	}))
	<-returned
	testenv.WaitFor(t, 30*time.Second, "a to be returned", func() bool { return l.Stats().Returned == 1 })
	pub("b")
	attempt := <-got
	stop()
	if attempt != 1 {
		t.Fatalf("a fresh message, first delivery, ran with Attempt %d: it inherited the runs of another message with its id", attempt)
	}
}
