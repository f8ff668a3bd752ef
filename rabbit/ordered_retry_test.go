package rabbit_test

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
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/rabbit"
)

// orderedTopology is a single-active-consumer quorum queue behind a fanout
// exchange, both named name: the adapter's ordered mode.
func orderedTopology(name string) rabbit.Topology {
	return rabbit.Topology{
		Exchanges: []rabbit.Exchange{{Name: name, Kind: "fanout"}},
		Queues:    []rabbit.Queue{{Name: name, SingleActiveConsumer: true, DeadLetterExchange: name + ".dlx"}},
		Bindings:  []rabbit.Binding{{Exchange: name, Queue: name}},
	}
}

// publishSeq publishes n messages of key, bodies 0…n-1 in order.
func publishSeq(t *testing.T, b *rabbit.Broker, dest, key string, n int) {
	t.Helper()
	msgs := make([]consumer.Message, n)
	for i := range msgs {
		msgs[i] = consumer.Message{ID: fmt.Sprintf("%s-%d", key, i), Key: key, Body: []byte(strconv.Itoa(i))}
	}
	must(t, b.Publish(testenv.Context(t, 60*time.Second), dest, msgs...))
}

// completions records the order in which a key's messages completed.
type completions struct {
	mu    sync.Mutex
	order []int
	runs  map[int][]run
}

type run struct {
	at         time.Time
	attempt    int
	deliveries int
}

func (c *completions) note(seq int, m *consumer.Message) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.runs == nil {
		c.runs = map[int][]run{}
	}
	c.runs[seq] = append(c.runs[seq], run{time.Now(), m.Attempt, m.Deliveries})
}

func (c *completions) done(seq int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.order = append(c.order, seq)
}

func (c *completions) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.order)
}

func seqs(n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = i
	}
	return s
}

// On an ordered (single-active-consumer) queue a failed message is retried
// in place, holding its key, so the key's later messages never overtake
// it: 100 messages of one key, the first failing once (a plain error, and
// RetryAfter), complete in the order 0…99. Its delay is honoured, and the
// second run is Attempt 2. (Through the delay queue, the failed message
// went to the back of the queue and completed last: 1…99, then 0.)
func TestOrderedQueueRetriesAFailedMessageInPlace(t *testing.T) {
	for _, tc := range []struct {
		name  string
		err   error
		delay time.Duration // the least time between the failure and the rerun
	}{
		{"plain error", errors.New("transient"), 50 * time.Millisecond},
		{"RetryAfter", consumer.RetryAfter(errors.New("come back later"), 700*time.Millisecond), 700 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			name := testenv.UniqueName(t, "inplace")
			deleteLater(t, []string{name}, []string{name})
			b := dial(t, rabbit.WithTopology(orderedTopology(name)), rabbit.WithRetryDelays(time.Second))
			const n = 100
			publishSeq(t, b, rabbit.ToExchange(name), "order-1", n)

			var rec completions
			c, err := b.NewConsumer(t.Context(), name, consumer.WithConcurrency(4), consumer.WithRedeliveryBackoff(tc.delay, tc.delay))
			must(t, err)
			runLoop(t, c, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
				seq, err := strconv.Atoi(string(m.Body))
				if err != nil {
					return consumer.Permanent(err)
				}
				rec.note(seq, m)
				if seq == 0 && m.Attempt == 1 {
					return tc.err
				}
				rec.done(seq)
				return nil
			}))
			testenv.WaitFor(t, 60*time.Second, "all 100 messages completed", func() bool { return rec.len() >= n })

			rec.mu.Lock()
			defer rec.mu.Unlock()
			if !slices.Equal(rec.order, seqs(n)) {
				t.Fatalf("completion order %v, want 0…%d", rec.order, n-1)
			}
			runs := rec.runs[0]
			if len(runs) != 2 {
				t.Fatalf("message 0 ran %d times, want 2", len(runs))
			}
			if runs[1].attempt != 2 {
				t.Errorf("message 0's second run was Attempt %d, want 2", runs[1].attempt)
			}
			if gap := runs[1].at.Sub(runs[0].at); gap < tc.delay {
				t.Errorf("message 0 ran again %v after its failure, want at least %v", gap, tc.delay)
			}
			if runs[1].deliveries != 1 {
				t.Errorf("message 0's second run had Deliveries %d, want 1 (retried in place, not redelivered)", runs[1].deliveries)
			}
		})
	}
}

// A message waiting in place to be retried when its consumer stops, by a
// shutdown or a crash, goes back to its place at the head of the queue:
// whoever consumes next runs it first, then the rest of its key, in order.
// Its delay is given up for its place (the next consumer runs it at once).
// The runs it had in place are not carried over: on a quorum queue the
// broker counts the delivery (x-delivery-count), and the loop counts it as
// one run, so the next run is Attempt 2 with Deliveries 2 whatever ran
// before, as after a crash on Kafka.
func TestOrderedQueueKeepsOrderWhenStoppedMidRetry(t *testing.T) {
	for _, tc := range []struct {
		name string
		stop func(b *rabbit.Broker, stop func() error) error
	}{
		{"graceful shutdown", func(_ *rabbit.Broker, stop func() error) error { return stop() }},
		{"crash", func(b *rabbit.Broker, stop func() error) error {
			// The connection goes without a settlement, as in a crash.
			if err := b.Close(); err != nil {
				return err
			}
			_ = stop() // Run's error says the broker is closed
			return nil
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			name := testenv.UniqueName(t, "restart")
			deleteLater(t, []string{name}, []string{name})
			b1 := dial(t, rabbit.WithTopology(orderedTopology(name)))
			const n = 20
			publishSeq(t, b1, rabbit.ToExchange(name), "order-1", n)

			var first completions
			c1, err := b1.NewConsumer(t.Context(), name, consumer.WithConcurrency(4), consumer.WithRedeliveryBackoff(10*time.Millisecond, 10*time.Millisecond))
			must(t, err)
			stop1 := runLoop(t, c1, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
				seq, _ := strconv.Atoi(string(m.Body))
				first.note(seq, m)
				if seq != 0 {
					first.done(seq)
					return nil
				}
				if m.Attempt < 3 {
					return errors.New("transient")
				}
				return consumer.RetryAfter(errors.New("not yet"), time.Minute)
			}))
			testenv.WaitFor(t, 20*time.Second, "message 0 to fail three times", func() bool {
				first.mu.Lock()
				defer first.mu.Unlock()
				return len(first.runs[0]) >= 3
			})
			time.Sleep(200 * time.Millisecond) // it waits in place now
			must(t, tc.stop(b1, stop1))
			if got := first.len(); got != 0 {
				t.Fatalf("%d messages completed behind the failing message 0 (order %v)", got, first.order)
			}

			b2 := dial(t, rabbit.WithTopology(orderedTopology(name)))
			var second completions
			c2, err := b2.NewConsumer(t.Context(), name, consumer.WithConcurrency(4))
			must(t, err)
			runLoop(t, c2, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
				seq, _ := strconv.Atoi(string(m.Body))
				second.note(seq, m)
				second.done(seq)
				return nil
			}))
			testenv.WaitFor(t, 30*time.Second, "all 20 messages completed by the next consumer", func() bool { return second.len() >= n })

			second.mu.Lock()
			defer second.mu.Unlock()
			if !slices.Equal(second.order[:n], seqs(n)) {
				t.Fatalf("the next consumer completed %v, want 0…%d", second.order, n-1)
			}
			r := second.runs[0][0]
			if r.deliveries != 2 || r.attempt != 2 {
				t.Errorf("message 0 came back with Attempt %d, Deliveries %d; want 2 and 2 (x-delivery-count 1)", r.attempt, r.deliveries)
			}
		})
	}
}
