package rabbit_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/rabbit"
)

// logBuf keeps what a Broker logged, and shows it in the test's output.
type logBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func capture(t *testing.T) (*slog.Logger, *logBuf) {
	var lb logBuf
	return slog.New(slog.NewTextHandler(io.MultiWriter(t.Output(), &lb), &slog.HandlerOptions{Level: slog.LevelDebug})), &lb
}

// seen records which messages a handler got, by the test's id header.
type seen struct {
	mu     sync.Mutex
	counts map[string]int
	total  atomic.Int64
}

func (s *seen) add(id string) {
	s.mu.Lock()
	if s.counts == nil {
		s.counts = map[string]int{}
	}
	s.counts[id]++
	s.mu.Unlock()
	s.total.Add(1)
}

func (s *seen) has(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.counts[id] > 0
}

// anyFrom says whether an id numbered n or later was seen.
func (s *seen) anyFrom(n int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for id := range s.counts {
		if i, err := strconv.Atoi(id); err == nil && i >= n {
			return true
		}
	}
	return false
}

func (s *seen) dups() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, c := range s.counts {
		n += c - 1
	}
	return n
}

// runLoop runs c with h until the test ends or stop is called.
func runLoop(t *testing.T, c consumer.Consumer, h consumer.Handler) (stop func() error) {
	return testenv.Start(t, func(ctx context.Context) error { return c.Run(ctx, h) }).Stop
}

// faultTopology is a quorum queue behind a fanout exchange, both named name.
func faultTopology(name string) rabbit.Topology {
	return rabbit.Topology{
		Exchanges: []rabbit.Exchange{{Name: name, Kind: "fanout"}},
		Queues:    []rabbit.Queue{{Name: name, DeadLetterExchange: name + ".dlx"}},
		Bindings:  []rabbit.Binding{{Exchange: name, Queue: name}},
	}
}

// busyThroughFault runs a consumer and a publisher, both busy, through
// fault, and checks that both resume by themselves: every confirmed message
// is consumed, no channel is closed by an ack of a stale delivery tag, and
// duplicates are at most what was delivered and unacked when channels were
// lost.
func busyThroughFault(t *testing.T, fault func(name string)) {
	busyThroughFaultAt(t, amqpURL(t), fault)
}

// faultRun is what busyThroughFaultAt counted.
type faultRun struct {
	confirmed, consumed, dups int
	// resumed is how long after the fault the first message published
	// after it was consumed.
	resumed time.Duration
}

// busyThroughFaultAt is busyThroughFault with Brokers dialed at url, with
// opts after the test's own.
func busyThroughFaultAt(t *testing.T, url string, fault func(name string), opts ...rabbit.Option) faultRun {
	name := testenv.UniqueName(t, "")
	deleteLaterAt(t, url, []string{name}, []string{name})
	logger, logs := capture(t)
	opts = append([]rabbit.Option{rabbit.WithLogger(logger), rabbit.WithReconnectBackoff(50*time.Millisecond, 500*time.Millisecond),
		rabbit.WithTopology(faultTopology(name)), rabbit.WithConnectionName(name)}, opts...)
	cb, err := rabbit.Dial(url, opts...)
	must(t, err)
	t.Cleanup(func() { cb.Close() })
	pb, err := rabbit.Dial(url, opts...)
	must(t, err)
	t.Cleanup(func() { pb.Close() })

	const prefetch = 16
	var got seen
	c, err := cb.NewConsumer(t.Context(), name, consumer.WithConcurrency(4), consumer.WithMaxInFlight(prefetch),
		consumer.WithLogger(logger), consumer.WithFetchBackoff(500*time.Millisecond))
	must(t, err)
	stopConsumer := runLoop(t, c, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if err := sleepCtx(ctx, 10*time.Millisecond); err != nil {
			return err
		}
		got.add(m.Header("id"))
		return nil
	}))

	// Publish batches of 10, one every 20ms, until 600 are confirmed and
	// ten of them from batches begun after the fault.
	var confirmed []string
	var pubErrs int
	var sent atomic.Int64 // messages made so far
	pubDone := make(chan struct{})
	faulted := make(chan struct{})
	faultOver := make(chan struct{})
	over := func() bool {
		select {
		case <-faultOver:
			return true
		default:
			return false
		}
	}
	go func() {
		defer close(pubDone)
		n, afterFault := 0, 0 // afterFault: confirmed of batches begun after the fault
		var reached200 sync.Once
		for len(confirmed) < 600 || afterFault < 10 {
			select {
			case <-t.Context().Done(): // the test failed and ends
				return
			case <-time.After(20 * time.Millisecond):
			}
			begunAfter := over()
			batch := make([]consumer.Message, 10)
			for i := range batch {
				batch[i] = consumer.Message{Body: []byte("x"), Headers: map[string]string{"id": strconv.Itoa(n)}}
				n++
			}
			sent.Store(int64(n))
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			err := pb.Publish(ctx, rabbit.ToExchange(name), batch...)
			cancel()
			failed := map[int]bool{}
			if err != nil {
				pubErrs++
				var pe *consumer.PublishError
				if !errors.As(err, &pe) {
					for i := range batch {
						failed[i] = true
					}
				} else {
					for _, f := range pe.Failed {
						failed[f.Index] = true
					}
				}
				time.Sleep(50 * time.Millisecond)
			}
			for i, m := range batch {
				if !failed[i] {
					confirmed = append(confirmed, m.Headers["id"])
					if begunAfter {
						afterFault++
					}
				}
			}
			if len(confirmed) >= 200 {
				reached200.Do(func() { close(faulted) })
			}
		}
	}()
	select {
	case <-faulted:
	case <-time.After(60 * time.Second):
		t.Fatal("200 messages were not published within 60s")
	}
	testenv.WaitFor(t, 30*time.Second, "the consumer to be busy", func() bool { return got.total.Load() >= 100 })
	fault(name)
	mark, faultEnd := int(sent.Load()), time.Now()
	close(faultOver)
	testenv.WaitFor(t, 120*time.Second, "a message published after the fault to be consumed", func() bool { return got.anyFrom(mark) })
	resumed := time.Since(faultEnd)
	select {
	case <-pubDone:
	case <-time.After(120 * time.Second):
		t.Fatal("the publisher did not confirm 600 messages within 120s of the fault")
	}
	testenv.WaitFor(t, 90*time.Second, "every confirmed message to be consumed", func() bool {
		for _, id := range confirmed {
			if !got.has(id) {
				return false
			}
		}
		return true
	})
	st := c.Stats()
	must(t, stopConsumer())
	if strings.Contains(logs.String(), "unknown delivery tag") {
		t.Error("a channel was closed by an ack of an unknown (stale) delivery tag")
	}
	if st.Revoked == 0 && st.SettleErrors == 0 {
		t.Log("the fault cost the loop no revocation (the channel died between deliveries)")
	}
	// Each lost channel can hand back at most its prefetch of unacked
	// deliveries; count the channels lost by the revocations logged.
	lost := max(1, strings.Count(logs.String(), "consuming channel closed")+strings.Count(logs.String(), "connection lost"))
	if d := got.dups(); d > prefetch*lost {
		t.Errorf("%d duplicate deliveries, more than the %d unacked deliveries %d lost channel(s) can hand back", d, prefetch*lost, lost)
	}
	t.Logf("confirmed %d, consumed %d deliveries, %d duplicates, %d publish errors, resumed %v after the fault, loop stats %+v",
		len(confirmed), got.total.Load(), got.dups(), pubErrs, resumed.Round(time.Millisecond), st)
	return faultRun{confirmed: len(confirmed), consumed: int(got.total.Load()), dups: got.dups(), resumed: resumed}
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// envRestart allows TestBrokerRestartResumesConsumersAndPublishers to stop
// and start the RabbitMQ application (rabbitmqctl stop_app, start_app). It
// is off by default because every other test using RabbitMQ at the same
// time (go test ./... runs packages in parallel, and other checkouts share
// the broker) would see it go away; make test-restarts sets it.
const envRestart = "FERRY_TEST_RABBIT_RESTART"

// TestBrokerRestartResumesConsumersAndPublishers stops and starts the
// RabbitMQ application under a busy consumer and publisher.
func TestBrokerRestartResumesConsumersAndPublishers(t *testing.T) {
	if os.Getenv(envRestart) != "1" {
		t.Skipf("restarts the shared RabbitMQ: set %s=1 to run it", envRestart)
	}
	amqpURL(t)
	ctl(t, "status")
	stopped := false
	t.Cleanup(func() {
		if stopped {
			ctl(t, "start_app")
		}
	})
	busyThroughFault(t, func(string) {
		ctl(t, "stop_app")
		stopped = true
		time.Sleep(2 * time.Second)
		ctl(t, "start_app")
		stopped = false
	})
}

// TestForcedConnectionCloseResumes closes every connection of the test's
// Brokers from the broker's side.
func TestForcedConnectionCloseResumes(t *testing.T) {
	amqpURL(t)
	busyThroughFault(t, func(name string) {
		n := 0
		for _, line := range strings.Split(ctl(t, "list_connections", "pid", "client_properties"), "\n") {
			if !strings.Contains(line, name) {
				continue
			}
			ctl(t, "close_connection", strings.Fields(line)[0], "ferry test: forced close")
			n++
		}
		if n != 3 {
			t.Fatalf("closed %d connections, want 3: the two brokers' publishing connections and the consuming one", n)
		}
	})
}

// TestDeliveryLimitEndsInDeadLetterExchange: a poison message on a quorum
// queue with a delivery limit ends in the dead-letter exchange with its
// story (the x-death record, the reason and the source queue), whether it
// was returned at once (the broker counts and dead-letters it) or with a
// delay (the driver dead-letters it once its deliveries pass the limit).
func TestDeliveryLimitEndsInDeadLetterExchange(t *testing.T) {
	for _, tc := range []struct {
		name   string
		fail   error
		reason string
	}{
		{"immediate", errors.New("poison"), "delivery_limit"},
		{"delayed", consumer.RetryAfter(errors.New("poison"), time.Second), "rejected"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			name := testenv.UniqueName(t, "limit")
			dlx, dlq := name+".dlx", name+".dlq"
			deleteLater(t, []string{name, dlq}, []string{dlx})
			b := dial(t, rabbit.WithTopology(rabbit.Topology{
				Exchanges: []rabbit.Exchange{{Name: dlx, Kind: "fanout"}},
				Queues: []rabbit.Queue{
					{Name: name, DeadLetterExchange: dlx, DeliveryLimit: 2},
					{Name: dlq, DeadLetterExchange: dlx + ".none"},
				},
				Bindings: []rabbit.Binding{{Exchange: dlx, Queue: dlq}},
			}), rabbit.WithRetryDelays(time.Second))
			must(t, b.Publish(testenv.Context(t, 10*time.Second), name, consumer.Message{ID: "poison-1", Key: "k", Body: []byte("bad")}))
			var runs atomic.Int64
			c, err := b.NewConsumer(t.Context(), name, consumer.WithRedeliveryBackoff(0, 0))
			must(t, err)
			stop := runLoop(t, c, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
				runs.Add(1)
				return tc.fail
			}))
			ch := rawChannel(t)
			var d amqp.Delivery
			testenv.WaitFor(t, 30*time.Second, "the message in the dead-letter queue", func() bool {
				m, ok, err := ch.Get(dlq, true)
				if err != nil {
					t.Fatal(err)
				}
				d = m
				return ok
			})
			must(t, stop())
			if string(d.Body) != "bad" || d.MessageId != "poison-1" {
				t.Errorf("dead letter body %q id %q", d.Body, d.MessageId)
			}
			// x-death holds the newest death first: the one from the queue.
			deaths, _ := d.Headers["x-death"].([]any)
			if len(deaths) == 0 {
				t.Fatalf("no x-death record: headers %v", d.Headers)
			}
			last, _ := deaths[0].(amqp.Table)
			if last["queue"] != name || last["reason"] != tc.reason {
				t.Errorf("newest x-death %v, want queue %s and reason %s", last, name, tc.reason)
			}
			if n := runs.Load(); n != 3 {
				t.Errorf("the handler ran %d times, want 3 (the delivery limit 2 allows 3 deliveries)", n)
			}
			t.Logf("dead letter headers: %v", d.Headers)
		})
	}
}

// TestQueueDeletedUnderConsumer: the broker cancels the consumer when its
// queue is deleted; the driver reports it (the loop counts a fetch error
// and logs ErrConsumerCancelled), keeps trying, and consumes again once the
// queue is declared again.
func TestQueueDeletedUnderConsumer(t *testing.T) {
	name := testenv.UniqueName(t, "deleted")
	deleteLater(t, []string{name}, nil)
	ch := rawChannel(t)
	args := amqp.Table{"x-queue-type": "quorum"}
	_, err := ch.QueueDeclare(name, true, false, false, false, args)
	must(t, err)
	logger, logs := capture(t)
	b := dial(t, rabbit.WithLogger(logger))
	var got seen
	c, err := b.NewConsumer(t.Context(), name, consumer.WithLogger(logger), consumer.WithFetchBackoff(200*time.Millisecond))
	must(t, err)
	stop := runLoop(t, c, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		got.add(string(m.Body))
		return nil
	}))
	must(t, b.Publish(testenv.Context(t, 10*time.Second), name, consumer.Message{Body: []byte("before")}))
	testenv.WaitFor(t, 20*time.Second, "the first message", func() bool { return got.has("before") })

	_, err = ch.QueueDelete(name, false, false, false)
	must(t, err)
	testenv.WaitFor(t, 20*time.Second, "the cancellation to be reported", func() bool {
		return c.Stats().FetchErrors > 0 && strings.Contains(logs.String(), rabbit.ErrConsumerCancelled.Error())
	})
	time.Sleep(500 * time.Millisecond) // a few failed attempts on the missing queue
	_, err = ch.QueueDeclare(name, true, false, false, false, args)
	must(t, err)
	must(t, b.Publish(testenv.Context(t, 10*time.Second), name, consumer.Message{Body: []byte("after")}))
	testenv.WaitFor(t, 30*time.Second, "a message published after the queue came back", func() bool { return got.has("after") })
	must(t, stop())
}

// memoryAlarm raises a memory alarm (a watermark far below what the node
// uses); clear, also run when the test ends, restores 0.4 and waits until
// the alarm is gone.
func memoryAlarm(t *testing.T) (clear func()) {
	ctl(t, "status")
	var once sync.Once
	clear = func() {
		once.Do(func() {
			ctl(t, "set_vm_memory_high_watermark", "0.4")
			// The node clears the alarm at its next memory check: wait for
			// it, so that later tests start without one.
			deadline := time.Now().Add(30 * time.Second)
			for strings.TrimSpace(ctl(t, "eval", "rabbit_alarm:get_alarms().")) != "[]" {
				if time.Now().After(deadline) {
					t.Error("the memory alarm did not clear within 30s of restoring the watermark")
					return
				}
				time.Sleep(200 * time.Millisecond)
			}
		})
	}
	t.Cleanup(clear)
	ctl(t, "set_vm_memory_high_watermark", "0.0000001")
	return clear
}

// TestMemoryAlarmPublishFailsInTimeAndBreakerOpens: under a memory alarm a
// Publish returns within its deadline with ErrBlocked, the breaker in front
// of a handler that publishes opens (its messages held, not failed), and
// once the alarm clears every message flows.
func TestMemoryAlarmPublishFailsInTimeAndBreakerOpens(t *testing.T) {
	amqpURL(t)
	src, dst := testenv.UniqueName(t, "alarm-src"), testenv.UniqueName(t, "alarm-dst")
	deleteLater(t, []string{src, dst}, nil)
	logger, _ := capture(t)
	b := dial(t, rabbit.WithLogger(logger), rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{
		{Name: src, DeadLetterExchange: "x"}, {Name: dst, DeadLetterExchange: "x"}}}))
	const n = 20
	msgs := make([]consumer.Message, n)
	for i := range msgs {
		msgs[i] = consumer.Message{Body: []byte(strconv.Itoa(i))}
	}
	must(t, b.Publish(testenv.Context(t, 10*time.Second), src, msgs...))

	clear := memoryAlarm(t)
	testenv.WaitFor(t, 20*time.Second, "the broker to block the publishing connection", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		return errors.Is(b.Publish(ctx, dst, consumer.Message{Body: []byte("probe")}), rabbit.ErrBlocked)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	start := time.Now()
	err := b.Publish(ctx, dst, consumer.Message{Body: []byte("blocked")})
	took := time.Since(start)
	cancel()
	if !errors.Is(err, rabbit.ErrBlocked) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Publish under a memory alarm = %v, want ErrBlocked and context.DeadlineExceeded", err)
	}
	if took > 2*time.Second {
		t.Errorf("Publish took %s with a 500ms deadline", took)
	}
	t.Logf("blocked publish: %v", err)

	br, err := consumer.NewBreaker(consumer.BreakerFailures(3), consumer.BreakerOpenFor(500*time.Millisecond))
	must(t, err)
	var forwarded seen
	c, err := b.NewConsumer(t.Context(), src, consumer.WithConcurrency(2), consumer.WithLogger(logger),
		consumer.WithRedeliveryBackoff(10*time.Millisecond, 100*time.Millisecond))
	must(t, err)
	stop := runLoop(t, c, br.Wrap(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		pctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		defer cancel()
		if err := b.Publish(pctx, dst, consumer.Message{ID: m.ID, Body: m.Body}); err != nil {
			return err
		}
		forwarded.add(string(m.Body))
		return nil
	})))
	testenv.WaitFor(t, 30*time.Second, "the breaker to open", func() bool { return br.Opened() > 0 && br.Held() > 0 })
	if got := forwarded.total.Load(); got != 0 {
		t.Fatalf("%d messages forwarded under the alarm", got)
	}
	clear()
	testenv.WaitFor(t, 60*time.Second, fmt.Sprintf("all %d messages to be forwarded after the alarm cleared", n), func() bool {
		for i := range n {
			if !forwarded.has(strconv.Itoa(i)) {
				return false
			}
		}
		return true
	})
	must(t, stop())
	st := c.Stats()
	t.Logf("breaker opened %d times, held %d; loop %+v", br.Opened(), br.Held(), st)
}

// TestCloseReturnsWithinASecond: Close returns within a second with a
// publish waiting on a blocked connection (memory alarm) and a driver whose
// pushed deliveries nobody reads.
func TestCloseReturnsWithinASecond(t *testing.T) {
	amqpURL(t)
	name := testenv.UniqueName(t, "close")
	deleteLater(t, []string{name}, nil)
	logger, _ := capture(t)
	b, err := rabbit.Dial(amqpURL(t), rabbit.WithLogger(logger), rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: name, DeadLetterExchange: "x"}}}))
	must(t, err)
	t.Cleanup(func() { b.Close() })
	msgs := make([]consumer.Message, 100)
	for i := range msgs {
		msgs[i] = consumer.Message{Body: []byte("x")}
	}
	must(t, b.Publish(testenv.Context(t, 10*time.Second), name, msgs...))
	d, err := openDriver(t, b, name, driver.Config{MaxInFlight: 50})
	must(t, err)
	first, err := d.Fetch(testenv.Context(t, 10*time.Second), nil, 1)
	must(t, err)
	if len(first) != 1 {
		t.Fatalf("fetched %d", len(first))
	}
	// 49 more deliveries are pushed to the driver and never read.
	testenv.WaitFor(t, 10*time.Second, "the prefetch to fill", func() bool { return unacked(t, name) == 50 })

	memoryAlarm(t)
	testenv.WaitFor(t, 20*time.Second, "the broker to block the publishing connection", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		return errors.Is(b.Publish(ctx, name, consumer.Message{Body: []byte("probe")}), rabbit.ErrBlocked)
	})
	pubErr := make(chan error, 1)
	go func() {
		pubErr <- b.Publish(context.Background(), name, consumer.Message{Body: []byte("stuck")})
	}()
	time.Sleep(200 * time.Millisecond)

	start := time.Now()
	must(t, b.Close())
	if took := time.Since(start); took > time.Second {
		t.Errorf("Close took %s", took)
	}
	select {
	case err := <-pubErr:
		if !errors.Is(err, rabbit.ErrClosed) {
			t.Errorf("the waiting Publish returned %v, want ErrClosed", err)
		}
	case <-time.After(time.Second):
		t.Error("the waiting Publish did not return within a second of Close")
	}
}

// TestBreakerOpenNoPileUpBeyondPrefetch: while a breaker holds every
// message, the broker delivers no more than the prefetch (the loop's
// MaxInFlight), the rest stays ready in the queue, and nothing times out
// (the channel is never lost).
func TestBreakerOpenNoPileUpBeyondPrefetch(t *testing.T) {
	amqpURL(t)
	name := testenv.UniqueName(t, "held")
	deleteLater(t, []string{name}, nil)
	logger, _ := capture(t)
	b := dial(t, rabbit.WithLogger(logger), rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: name, DeadLetterExchange: "x"}}}))
	const n, maxInFlight = 200, 8
	msgs := make([]consumer.Message, n)
	for i := range msgs {
		msgs[i] = consumer.Message{Body: []byte(strconv.Itoa(i))}
	}
	must(t, b.Publish(testenv.Context(t, 10*time.Second), name, msgs...))
	br, err := consumer.NewBreaker(consumer.BreakerFailures(1), consumer.BreakerOpenFor(time.Hour))
	must(t, err)
	var down atomic.Bool
	down.Store(true)
	var handled atomic.Int64
	c, err := b.NewConsumer(t.Context(), name, consumer.WithConcurrency(2), consumer.WithMaxInFlight(maxInFlight), consumer.WithLogger(logger))
	must(t, err)
	stop := runLoop(t, c, br.Wrap(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if down.Load() {
			return errors.New("dependency down")
		}
		handled.Add(1)
		return nil
	})))
	testenv.WaitFor(t, 20*time.Second, "the breaker to open and hold", func() bool { return br.Held() > 0 })
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		if u := unacked(t, name); u > maxInFlight {
			t.Fatalf("the broker counts %d unacked deliveries, above the prefetch %d", u, maxInFlight)
		}
		if st := c.Stats(); st.InFlight > maxInFlight || st.Revoked > 0 {
			t.Fatalf("loop stats %+v: in flight above %d, or a channel lost", st, maxInFlight)
		}
	}
	st := c.Stats()
	must(t, stop())
	ready, err := rawChannel(t).QueueDeclarePassive(name, true, false, false, false, amqp.Table{"x-queue-type": "quorum"})
	must(t, err)
	if ready.Messages < n-maxInFlight {
		t.Errorf("%d messages ready after the consumer stopped, want at least %d", ready.Messages, n-maxInFlight)
	}
	t.Logf("held %d times, loop %+v", br.Held(), st)
}

// TestAcksFlowUnderMemoryAlarm: an alarm blocks the publishing connection
// only; the consuming connection still takes deliveries and its acks reach
// the broker, so the queue drains while publishers wait.
func TestAcksFlowUnderMemoryAlarm(t *testing.T) {
	amqpURL(t)
	name := testenv.UniqueName(t, "acks-alarm")
	deleteLater(t, []string{name}, nil)
	logger, _ := capture(t)
	b := dial(t, rabbit.WithLogger(logger), rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: name, DeadLetterExchange: "x"}}}))
	msgs := make([]consumer.Message, 20)
	for i := range msgs {
		msgs[i] = consumer.Message{Body: []byte(strconv.Itoa(i))}
	}
	must(t, b.Publish(testenv.Context(t, 10*time.Second), name, msgs...))
	memoryAlarm(t)
	testenv.WaitFor(t, 20*time.Second, "the broker to block the publishing connection", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		return errors.Is(b.Publish(ctx, name+"-nowhere", consumer.Message{Body: []byte("probe")}), rabbit.ErrBlocked)
	})
	var got seen
	c, err := b.NewConsumer(t.Context(), name, consumer.WithLogger(logger))
	must(t, err)
	stop := runLoop(t, c, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		got.add(string(m.Body))
		return nil
	}))
	testenv.WaitFor(t, 20*time.Second, "20 messages handled under the alarm", func() bool { return got.total.Load() >= 20 })
	ch := rawChannel(t)
	testenv.WaitFor(t, 20*time.Second, "the acks to reach the broker (an empty queue, nothing unacked)", func() bool {
		qi, err := ch.QueueDeclarePassive(name, true, false, false, false, amqp.Table{"x-queue-type": "quorum"})
		return err == nil && qi.Messages == 0 && unacked(t, name) == 0
	})
	must(t, stop())
}

// TestVhostRefusedOnReconnectIsRetried: a vhost refused on a reconnect (530
// NOT_ALLOWED, what a restarting node answers before its vhosts are up; here
// the vhost is deleted and made again) is retried, not fatal: the consumer
// resumes once the vhost is back. Before, the driver gave up for good.
func TestVhostRefusedOnReconnectIsRetried(t *testing.T) {
	vhost := testenv.UniqueName(t, "vh")
	name := vhost + "-q"
	makeVhost := func() {
		ctl(t, "add_vhost", vhost)
		ctl(t, "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
	}
	makeVhost()
	t.Cleanup(func() { ctl(t, "delete_vhost", vhost) })
	u := strings.TrimSuffix(amqpURL(t), "/")
	if i := strings.LastIndex(u, "/"); i > len("amqp://") {
		u = u[:i]
	}
	b, err := rabbit.Dial(u+"/"+vhost, rabbit.WithLogger(testLogger(t)),
		rabbit.WithReconnectBackoff(50*time.Millisecond, 300*time.Millisecond),
		rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: name, Classic: true}}}))
	must(t, err)
	t.Cleanup(func() { b.Close() })
	d, err := openDriver(t, b, name, driver.Config{})
	must(t, err)
	t.Cleanup(func() { d.Close() })
	got := make(chan error, 100)
	go func() {
		for {
			ms, err := d.Fetch(context.Background(), nil, 1)
			if len(ms) > 0 {
				got <- nil
				return
			}
			if err != nil {
				select {
				case got <- err:
				default:
				}
				if driver.IsFatal(err) {
					return
				}
			}
		}
	}()
	testenv.WaitFor(t, 10*time.Second, "a consumer on the queue", func() bool {
		for _, line := range strings.Split(ctl(t, "list_queues", "-p", vhost, "name", "consumers"), "\n") {
			if f := strings.Fields(line); len(f) == 2 && f[0] == name && f[1] == "1" {
				return true
			}
		}
		return false
	})
	ctl(t, "delete_vhost", vhost)
	time.Sleep(1500 * time.Millisecond) // the driver redials into the missing vhost
	makeVhost()
	deadline := time.After(20 * time.Second)
	for {
		err := b.Publish(testenv.Context(t, 2*time.Second), name, consumer.Message{Body: []byte("back")})
		if err == nil {
			break
		}
		select {
		case <-deadline:
			t.Fatalf("Publish after the vhost came back: %v", err)
		case <-time.After(200 * time.Millisecond):
		}
	}
	for {
		select {
		case err := <-got:
			if err == nil {
				return
			}
			t.Logf("Fetch: %v", err)
			if driver.IsFatal(err) {
				t.Fatalf("a vhost refused on a reconnect was fatal: %v", err)
			}
		case <-deadline:
			t.Fatal("no delivery after the vhost came back")
		}
	}
}
