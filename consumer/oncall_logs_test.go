package consumer_test

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
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/memory"
)

// logBuffer collects what a slog text handler writes.
type logBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (w *logBuffer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *logBuffer) lines(substr string) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return strings.Count(w.b.String(), substr)
}

func (w *logBuffer) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// A downstream that fails every call while thousands of messages a second
// arrive: the on-call sees the breaker open and the holds begin at the
// default level, each said once, with a bounded number of lines about the
// failures; when the downstream is back, the breaker closes and the holds
// end, each said once. Every line comes through the Loop's own logger,
// without a logger given to the middleware.
func TestAnOutageIsLoggedOnceAndDoesNotFlood(t *testing.T) {
	b, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	const n = 10_000
	if err := b.CreateQueue("orders", memory.QueueConfig{VisibilityTimeout: 30 * time.Second}); err != nil {
		t.Fatal(err)
	}
	var logs logBuffer
	stack, err := consumer.Standard(b, "orders-dlq",
		consumer.StandardRetry(consumer.RetryInitial(time.Millisecond), consumer.RetryMaxInterval(time.Millisecond),
			consumer.RetryRedeliveryMax(10*time.Millisecond)),
		consumer.StandardBreaker(consumer.BreakerOpenFor(300*time.Millisecond)))
	if err != nil {
		t.Fatal(err)
	}
	l, err := b.NewConsumer(t.Context(), "orders", consumer.WithName("billing"), consumer.WithConcurrency(16),
		consumer.WithLogger(slog.New(slog.NewTextHandler(&logs, nil)))) // Info and above: the default level
	if err != nil {
		t.Fatal(err)
	}
	var down atomic.Bool
	down.Store(true)
	var done atomic.Int64
	ctx, cancel := context.WithCancel(context.Background())
	runErr := make(chan error, 1)
	go func() {
		runErr <- l.Run(ctx, stack.Wrap(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
			if down.Load() {
				return errors.New("payments API: 503 Service Unavailable")
			}
			done.Add(1)
			return nil
		})))
	}()
	msgs := make([]consumer.Message, n)
	for i := range msgs {
		msgs[i].Body = []byte(fmt.Sprint(i))
	}
	if err := b.Publish(context.Background(), "orders", msgs...); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 30*time.Second, "the breaker to open", func() bool { return stack.Breaker.Opened() >= 2 })
	time.Sleep(500 * time.Millisecond) // the outage goes on: holds, trials, re-openings
	down.Store(false)
	testenv.WaitFor(t, 30*time.Second, "every message to be handled", func() bool { return done.Load() == n })
	cancel()
	if err := <-runErr; err != nil {
		t.Fatal(err)
	}

	out := logs.String()
	for _, want := range []string{
		"circuit breaker opened", "holding messages while a circuit breaker is open",
		"circuit breaker closed", "holds over; consuming again",
	} {
		if logs.lines(want) < 1 {
			t.Errorf("no line %q at the default level; the log was:\n%s", want, out)
		}
	}
	if got := logs.lines("circuit breaker opened"); !strings.Contains(out, "payments API: 503") || got > 10 {
		t.Errorf("%d opening lines; want at most 10 and the failure that opened it named", got)
	}
	if !strings.Contains(out, "consumer=billing") {
		t.Errorf("the lines do not name the consumer:\n%s", out)
	}
	total := strings.Count(out, "\n")
	if total > 60 {
		t.Errorf("%d lines for an outage of %d messages (breaker opened %d times), want a bounded few:\n%s", total, n, stack.Breaker.Opened(), out)
	}
	t.Logf("%d lines; breaker opened %d times", total, stack.Breaker.Opened())
}

// Poison messages in bulk: each dead-lettering is a WARN, rate-limited, and
// a failing downstream's handler failures and spent retries are too.
func TestRepeatingFailuresAreLoggedRateLimited(t *testing.T) {
	b, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	const n = 2_000
	if err := b.CreateQueue("orders", memory.QueueConfig{VisibilityTimeout: 30 * time.Second}); err != nil {
		t.Fatal(err)
	}
	var logs logBuffer
	stack, err := consumer.Standard(b, "orders-dlq",
		consumer.StandardRetry(consumer.RetryInitial(time.Millisecond), consumer.RetryMaxInterval(time.Millisecond),
			consumer.RetryRedeliveryMax(time.Millisecond)),
		consumer.StandardDeadLetter(consumer.DeadLetterMaxAttempts(4)),
		consumer.StandardBreaker(consumer.BreakerFailures(1_000_000)))
	if err != nil {
		t.Fatal(err)
	}
	l, err := b.NewConsumer(t.Context(), "orders", consumer.WithName("billing"), consumer.WithConcurrency(16),
		consumer.WithRedeliveryBackoff(time.Millisecond, time.Millisecond),
		consumer.WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	runErr := make(chan error, 1)
	go func() {
		runErr <- l.Run(ctx, stack.Wrap(consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
			if strings.HasPrefix(string(m.Body), "bad") {
				return consumer.Permanent(errors.New("not an order"))
			}
			return errors.New("constraint violated")
		})))
	}()
	msgs := make([]consumer.Message, n)
	for i := range msgs {
		msgs[i].Body = []byte(fmt.Sprint(i))
		if i%2 == 0 {
			msgs[i].Body = []byte(fmt.Sprint("bad", i))
		}
	}
	if err := b.Publish(context.Background(), "orders", msgs...); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 30*time.Second, "every message to be dead-lettered", func() bool { return stack.DeadLetter.Count() == n })
	cancel()
	if err := <-runErr; err != nil {
		t.Fatal(err)
	}
	for line, most := range map[string]int{
		"message dead-lettered":                      10, // two reasons, five a minute each
		"retries spent; the message goes back":       5,
		"handler failed; the message will run again": 5,
	} {
		if got := logs.lines(line); got < 1 || got > most {
			t.Errorf("%q: %d lines for %d messages, want 1 to %d", line, got, n, most)
		}
	}
	if !strings.Contains(logs.String(), "unlogged=") {
		t.Errorf("no line says how many were left out")
	}
}
