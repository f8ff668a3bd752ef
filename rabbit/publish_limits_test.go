package rabbit_test

import (
	"context"
	"errors"
	"fmt"
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

// goodPublishers publishes good messages from 4 goroutines, calls of 5
// messages each, to dest until stop is closed, and returns how many calls
// were confirmed and the errors of those that failed.
func goodPublishers(t *testing.T, b *rabbit.Broker, dest string, stop <-chan struct{}) (wait func() (confirmed int64, failed []error)) {
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
		ok   atomic.Int64
	)
	for g := range 4 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				msgs := make([]consumer.Message, 5)
				for j := range msgs {
					msgs[j] = consumer.Message{Key: "good", Body: []byte(fmt.Sprintf("g%d-%d-%d", g, i, j)), Headers: map[string]string{"n": "1"}}
				}
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				err := b.Publish(ctx, dest, msgs...)
				cancel()
				if err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
					continue
				}
				ok.Add(int64(len(msgs)))
			}
		})
	}
	return func() (int64, []error) {
		wg.Wait()
		return ok.Load(), errs
	}
}

// The publish of a bad message fails that message alone, with its own
// reason, while 4 goroutines publish good messages through the same Broker
// (and, but for the missing exchange, to the same destination): not one
// good message fails. What AMQP or the broker's limits cannot carry (a
// message id, header name or routing key over 255 bytes, a body over the
// maximum message size, properties over a frame) is refused before it is
// sent, with a *rabbit.LimitError naming the limit; a publish the broker
// refuses (a missing exchange) fails with its 404, as ErrRefused, not
// ErrNotConfirmed. Before, each of them closed the shared channel or the
// connection, and failed the good messages in flight with ErrNotConfirmed.
func TestBadPublishesFailAloneAmongConcurrentGoodOnes(t *testing.T) {
	ex := testenv.UniqueName(t, "bad")
	q := ex + "-q"
	deleteLater(t, []string{q}, []string{ex})
	b := dial(t, rabbit.WithTopology(rabbit.Topology{
		Exchanges: []rabbit.Exchange{{Name: ex, Kind: "direct"}},
		Queues:    []rabbit.Queue{{Name: q, DeadLetterExchange: ex + ".dlx"}},
		Bindings:  []rabbit.Binding{{Exchange: ex, Queue: q, Key: "good"}, {Exchange: ex, Queue: q, Key: "other"}},
	}))
	long := strings.Repeat("x", 300)
	huge := make([]byte, rabbit.DefaultMaxMessageSize+1<<20) // 129 MiB

	type bad struct {
		name     string
		exchange string
		msg      consumer.Message
		check    func(err error) error
	}
	limit := func(sentinel error, field string, size, max int) func(error) error {
		return func(err error) error {
			var le *rabbit.LimitError
			if !errors.Is(err, sentinel) || !errors.As(err, &le) {
				return fmt.Errorf("got %v, want %v in a *rabbit.LimitError", err, sentinel)
			}
			if le.Field != field || le.Size != size || le.Limit != max {
				return fmt.Errorf("got %+v, want field %q, size %d, limit %d", le, field, size, max)
			}
			if errors.Is(err, rabbit.ErrNotConfirmed) {
				return fmt.Errorf("%v matches ErrNotConfirmed: the message was never sent", err)
			}
			return nil
		}
	}
	bads := []bad{
		{"message id", ex, consumer.Message{ID: long, Key: "good", Body: []byte("x")}, limit(rabbit.ErrTooLong, "message id", 300, 255)},
		{"header name", ex, consumer.Message{Key: "good", Body: []byte("x"), Headers: map[string]string{long: "v"}}, limit(rabbit.ErrTooLong, "header name", 300, 255)},
		{"routing key", ex, consumer.Message{Key: long, Body: []byte("x")}, limit(rabbit.ErrTooLong, "routing key", 300, 255)},
		{"headers over a frame", ex, consumer.Message{Key: "good", Body: []byte("x"), Headers: map[string]string{"big": strings.Repeat("y", 200_000)}}, func(err error) error {
			var le *rabbit.LimitError
			if !errors.Is(err, rabbit.ErrTooLarge) || !errors.As(err, &le) || le.Field != "properties" || le.Limit != 131072-8-14 {
				return fmt.Errorf("got %v (%+v), want ErrTooLarge for properties over the 131050 bytes a frame of 131072 holds", err, le)
			}
			return nil
		}},
		{"body", ex, consumer.Message{Key: "good", Body: huge}, limit(rabbit.ErrTooLarge, "body", len(huge), rabbit.DefaultMaxMessageSize)},
		{"missing exchange", ex + "-missing", consumer.Message{Key: "good", Body: []byte("x")}, func(err error) error {
			var ae *amqp.Error
			if !errors.Is(err, rabbit.ErrRefused) || !errors.As(err, &ae) || ae.Code != amqp.NotFound {
				return fmt.Errorf("got %v, want ErrRefused with the broker's 404", err)
			}
			if errors.Is(err, rabbit.ErrNotConfirmed) {
				return fmt.Errorf("%v matches ErrNotConfirmed: the broker refused it", err)
			}
			return nil
		}},
	}

	stop := make(chan struct{})
	wait := goodPublishers(t, b, rabbit.ToExchange(ex), stop)
	time.Sleep(200 * time.Millisecond) // the good publishers are busy
	for round := range 5 {
		for _, bd := range bads {
			err := b.Publish(testenv.Context(t, 30*time.Second), rabbit.ToExchange(bd.exchange), bd.msg)
			var pe *consumer.PublishError
			if !errors.As(err, &pe) || len(pe.Failed) != 1 || pe.Failed[0].Index != 0 {
				t.Errorf("round %d, %s: Publish = %v, want a *consumer.PublishError for message 0", round, bd.name, err)
				continue
			}
			if cerr := bd.check(pe.Failed[0].Err); cerr != nil {
				t.Errorf("round %d, %s: %v", round, bd.name, cerr)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	// The others of a call go out: a 5-byte message after the 129 MiB one.
	err := b.Publish(testenv.Context(t, 30*time.Second), rabbit.ToExchange(ex), consumer.Message{Key: "good", Body: huge}, consumer.Message{Key: "other", Body: []byte("small")})
	var pe *consumer.PublishError
	if !errors.As(err, &pe) || len(pe.Failed) != 1 || pe.Failed[0].Index != 0 || !errors.Is(pe.Failed[0].Err, rabbit.ErrTooLarge) {
		t.Errorf("Publish of a 129 MiB message and a 5-byte one = %v, want the first alone to fail with ErrTooLarge", err)
	}
	close(stop)
	confirmed, failed := wait()
	for i, err := range failed {
		if i < 5 {
			t.Errorf("a good publish failed: %v", err)
		}
	}
	if len(failed) > 0 {
		t.Fatalf("%d good publish calls failed (%d messages confirmed)", len(failed), confirmed)
	}
	if confirmed < 100 {
		t.Fatalf("only %d good messages were confirmed: the publishers did not run alongside the bad ones", confirmed)
	}
	ch := rawChannel(t)
	testenv.WaitFor(t, 10*time.Second, fmt.Sprintf("the %d good messages and the small one in the queue", confirmed), func() bool {
		qi, err := ch.QueueDeclarePassive(q, true, false, false, false, amqp.Table{"x-queue-type": "quorum"})
		return err == nil && int64(qi.Messages) == confirmed+1
	})
	t.Logf("%d good messages confirmed alongside %d bad publishes", confirmed, 5*len(bads)+1)
}

// WithMaxMessageSize sets the largest body Publish sends; it is validated.
func TestMaxMessageSizeOption(t *testing.T) {
	for _, n := range []int{0, -1, 512<<20 + 1} {
		_, err := rabbit.Dial(amqpURL(t), rabbit.WithMaxMessageSize(n))
		var ce *consumer.ConfigError
		if !errors.As(err, &ce) || ce.Field != "MaxMessageSize" {
			t.Errorf("WithMaxMessageSize(%d): Dial = %v, want a ConfigError for MaxMessageSize", n, err)
		}
	}
	q := testenv.UniqueName(t, "maxsize")
	deleteLater(t, []string{q}, nil)
	b := dial(t, rabbit.WithMaxMessageSize(1024), rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: q, Classic: true}}}))
	err := b.Publish(testenv.Context(t, 10*time.Second), q,
		consumer.Message{Body: make([]byte, 1024)}, consumer.Message{Body: make([]byte, 1025)})
	var pe *consumer.PublishError
	var le *rabbit.LimitError
	if !errors.As(err, &pe) || len(pe.Failed) != 1 || pe.Failed[0].Index != 1 || !errors.As(pe.Failed[0].Err, &le) || le.Limit != 1024 || le.Size != 1025 {
		t.Fatalf("Publish of 1024 and 1025 bytes under a 1024-byte maximum = %v, want the second alone to fail with a LimitError", err)
	}
	if !strings.Contains(le.Error(), "1025") || !strings.Contains(le.Error(), "1024") {
		t.Errorf("the error %q does not name the size and the limit", le)
	}
}

// A body over the broker's own max_message_size, let through by a
// WithMaxMessageSize above it, is refused by the broker (406
// PRECONDITION_FAILED): it fails with that reason, as ErrRefused, and the
// good messages published meanwhile to another queue of the same Broker
// are not failed by it: each destination has a channel of its own, queues
// too, though they all publish through the default exchange.
func TestBodyOverTheBrokersMaximumIsRefusedWithItsReason(t *testing.T) {
	q := testenv.UniqueName(t, "over")
	good := q + "-good"
	deleteLater(t, []string{q, good}, nil)
	b := dial(t, rabbit.WithMaxMessageSize(512<<20), rabbit.WithTopology(rabbit.Topology{
		Queues: []rabbit.Queue{{Name: q, Classic: true}, {Name: good, Classic: true}},
	}))
	stop := make(chan struct{})
	wait := goodPublishers(t, b, good, stop)
	time.Sleep(200 * time.Millisecond)
	err := b.Publish(testenv.Context(t, 60*time.Second), q, consumer.Message{Body: make([]byte, rabbit.DefaultMaxMessageSize+1<<20)})
	close(stop)
	var ae *amqp.Error
	if !errors.Is(err, rabbit.ErrRefused) || !errors.As(err, &ae) || ae.Code != amqp.PreconditionFailed || errors.Is(err, rabbit.ErrNotConfirmed) {
		t.Errorf("Publish of 129 MiB = %v, want ErrRefused with the broker's 406", err)
	}
	confirmed, failed := wait()
	if len(failed) > 0 {
		t.Fatalf("%d good publish calls to another queue failed, the first: %v", len(failed), failed[0])
	}
	if confirmed == 0 {
		t.Fatal("no good message was confirmed")
	}
	if err := b.Publish(testenv.Context(t, 10*time.Second), q, consumer.Message{Body: []byte("after")}); err != nil {
		t.Errorf("publish to the queue after its refusal: %v", err)
	}
}

// A message whose key is too long for a routing key (here 300 bytes, read
// from HeaderKey: keys of a queue, or of another broker, have no such
// limit) is dead-lettered once, not forever: the dead letter is routed by
// the key cut to 255 bytes and carries the whole key in HeaderKey, so its
// consumer reads the whole Key. The DeadLetter's publish does not fail, and
// the original is acked. Before, every attempt of the dead-letter publish
// closed the publishing connection, and the message came back to fail again.
func TestDeadLetterOfAKeyTooLongForARoutingKeyIsPublished(t *testing.T) {
	name := testenv.UniqueName(t, "dlkey")
	dlx, dlq := name+".dlx", name+".dlq"
	deleteLater(t, []string{name, dlq}, []string{dlx})
	b := dial(t, rabbit.WithTopology(rabbit.Topology{
		Exchanges: []rabbit.Exchange{{Name: dlx, Kind: "fanout"}},
		Queues:    []rabbit.Queue{{Name: name, DeadLetterExchange: dlx}, {Name: dlq, DeadLetterExchange: dlx + ".none"}},
		Bindings:  []rabbit.Binding{{Exchange: dlx, Queue: dlq}},
	}))
	key := strings.Repeat("é", 150) // 300 bytes: cut at a rune, 254
	must(t, b.Publish(testenv.Context(t, 10*time.Second), name, consumer.Message{ID: "poison", Key: key, Body: []byte("bad")}))

	dl, err := consumer.NewDeadLetter(b, rabbit.ToExchange(dlx))
	must(t, err)
	var runs atomic.Int64
	c, err := b.NewConsumer(t.Context(), name, consumer.WithRedeliveryBackoff(10*time.Millisecond, 10*time.Millisecond))
	must(t, err)
	stop := runLoop(t, c, dl.Wrap(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		runs.Add(1)
		if m.Key != key {
			return fmt.Errorf("key %q, want the 300-byte key", m.Key)
		}
		return consumer.Permanent(errors.New("poison"))
	})))

	d2, err := openDriver(t, b, dlq, driver.Config{})
	must(t, err)
	t.Cleanup(func() { d2.Close() })
	got := fetchN(t, d2, 1)[0]
	time.Sleep(300 * time.Millisecond) // time for the message to come back, were it not acked
	must(t, stop())
	if got.Key != key || got.Headers[consumer.HeaderDLQKey] != key || string(got.Body) != "bad" || got.Headers[consumer.HeaderDLQMessageID] != "poison" {
		t.Errorf("dead letter key %q (%d bytes), ferry-dlq-key %d bytes, body %q, headers %v", got.Key, len(got.Key), len(got.Headers[consumer.HeaderDLQKey]), got.Body, got.Headers)
	}
	var d amqp.Delivery
	if !d2.As(got.Handle, &d) || d.RoutingKey != strings.Repeat("é", 127) {
		t.Errorf("dead letter routed by %q (%d bytes), want the key cut to 254 bytes", d.RoutingKey, len(d.RoutingKey))
	}
	if n := runs.Load(); n != 1 {
		t.Errorf("the handler ran %d times, want 1 (dead-lettered on the first failure)", n)
	}
	if dl.Count() != 1 || dl.PublishFailures() != 0 {
		t.Errorf("DeadLetter count %d, publish failures %d; want 1 and 0", dl.Count(), dl.PublishFailures())
	}
	ready, unackedN := queueCounts(t, name)
	if ready+unackedN != 0 {
		t.Errorf("the source queue holds %d ready and %d unacked messages, want none", ready, unackedN)
	}
}

// Each destination publishes on a channel of its own, and the channels of
// destinations with nothing in flight are closed once there are 32: after
// publishing to 40 exchanges, the publishing connection holds at most 32
// channels, and every message was confirmed.
func TestPublishChannelsPerDestinationStayBounded(t *testing.T) {
	name := testenv.UniqueName(t, "chans")
	q := name + "-q"
	topo := rabbit.Topology{Queues: []rabbit.Queue{{Name: q, Classic: true}}}
	var exchanges []string
	for i := range 40 {
		ex := fmt.Sprintf("%s-%d", name, i)
		exchanges = append(exchanges, ex)
		topo.Exchanges = append(topo.Exchanges, rabbit.Exchange{Name: ex, Kind: "fanout"})
		topo.Bindings = append(topo.Bindings, rabbit.Binding{Exchange: ex, Queue: q})
	}
	deleteLater(t, []string{q}, exchanges)
	b := dial(t, rabbit.WithConnectionName(name), rabbit.WithTopology(topo))
	for _, ex := range exchanges {
		must(t, b.Publish(testenv.Context(t, 10*time.Second), rabbit.ToExchange(ex), consumer.Message{Body: []byte(ex)}))
	}
	channels := -1
	for _, line := range splitLines(ctl(t, "list_connections", "channels", "client_properties")) {
		if containsAll(line, name+" publish") {
			channels, _ = strconv.Atoi(fields(line)[0])
		}
	}
	t.Logf("%d channels on the publishing connection", channels)
	if channels < 0 || channels > 32 {
		t.Errorf("the publishing connection holds %d channels after 40 destinations, want at most 32", channels)
	}
	if ready, _ := queueCounts(t, q); ready != 40 {
		t.Errorf("%d messages in the queue, want 40", ready)
	}
}
