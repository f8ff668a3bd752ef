package rabbit_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/rabbit"
)

// An unroutable message fails alone, with ErrUnroutable; the other
// messages of the call are confirmed and in the queue. A later message of
// the failed message's key is never sent (ErrEarlierFailed), so a key's
// messages cannot overtake one another.
func TestUnroutablePublishFailsThatMessageOnly(t *testing.T) {
	ex := testenv.UniqueName(t, "route")
	q := ex + "-a"
	deleteLater(t, []string{q}, []string{ex})
	b := dial(t, rabbit.WithTopology(rabbit.Topology{
		Exchanges: []rabbit.Exchange{{Name: ex, Kind: "direct"}},
		Queues:    []rabbit.Queue{{Name: q, DeadLetterExchange: ex}},
		Bindings:  []rabbit.Binding{{Exchange: ex, Queue: q, Key: "a"}},
	}))
	msgs := []consumer.Message{
		{Key: "a", Body: []byte("a1")},
		{Key: "b", Body: []byte("b1")}, // no binding for b
		{Key: "a", Body: []byte("a2")},
		{Key: "b", Body: []byte("b2")}, // after a failed b: never sent
		{Body: []byte("no key")},       // routing key "": unroutable too
	}
	err := b.Publish(testenv.Context(t, 10*time.Second), rabbit.ToExchange(ex), msgs...)
	var pe *consumer.PublishError
	if !errors.As(err, &pe) {
		t.Fatalf("Publish = %v, want a *consumer.PublishError", err)
	}
	want := map[int]error{1: rabbit.ErrUnroutable, 3: rabbit.ErrEarlierFailed, 4: rabbit.ErrUnroutable}
	if len(pe.Failed) != len(want) {
		t.Fatalf("failed %+v, want indexes 1, 3 and 4", pe.Failed)
	}
	for _, f := range pe.Failed {
		if !errors.Is(f.Err, want[f.Index]) {
			t.Errorf("message %d failed with %v, want %v", f.Index, f.Err, want[f.Index])
		}
	}
	ch := rawChannel(t)
	testenv.WaitFor(t, 10*time.Second, "two messages in the queue", func() bool {
		qi, err := ch.QueueDeclarePassive(q, true, false, false, false, amqp.Table{"x-queue-type": "quorum"})
		return err == nil && qi.Messages == 2
	})
	// The publishing channel survives: the next publish works.
	if err := b.Publish(testenv.Context(t, 10*time.Second), rabbit.ToExchange(ex), consumer.Message{Key: "a", Body: []byte("a3")}); err != nil {
		t.Fatalf("publish after a return: %v", err)
	}
}

// A message the queue refuses (a full queue with reject-publish) is
// nacked: an error for that message, matching ErrNacked.
func TestNackedPublishFailsThatMessage(t *testing.T) {
	q := testenv.UniqueName(t, "full")
	deleteLater(t, []string{q}, nil)
	b := dial(t, rabbit.WithTopology(rabbit.Topology{
		Queues: []rabbit.Queue{{Name: q, Classic: true, Args: amqp.Table{"x-max-length": int64(1), "x-overflow": "reject-publish"}}},
	}))
	err := b.Publish(testenv.Context(t, 10*time.Second), q, consumer.Message{Body: []byte("fits")})
	if err != nil {
		t.Fatal(err)
	}
	err = b.Publish(testenv.Context(t, 10*time.Second), q, consumer.Message{Body: []byte("too many")})
	if !errors.Is(err, rabbit.ErrNacked) {
		t.Fatalf("Publish to a full queue = %v, want ErrNacked", err)
	}
}

// Publishing to an exchange that does not exist fails with the broker's
// 404, reachable with errors.As, and the next publish works (a new channel).
func TestPublishToMissingExchangeIsABrokerError(t *testing.T) {
	q := testenv.UniqueName(t, "after404")
	deleteLater(t, []string{q}, nil)
	b := dial(t, rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: q, DeadLetterExchange: "x"}}}))
	err := b.Publish(testenv.Context(t, 10*time.Second), rabbit.ToExchange(testenv.UniqueName(t, "nowhere")), consumer.Message{Body: []byte("x")})
	var ae *amqp.Error
	if !errors.As(err, &ae) || ae.Code != amqp.NotFound {
		t.Fatalf("Publish to a missing exchange = %v, want an *amqp091.Error 404", err)
	}
	if err := b.Publish(testenv.Context(t, 10*time.Second), q, consumer.Message{Body: []byte("y")}); err != nil {
		t.Fatalf("publish after the 404: %v", err)
	}
}

// Publishing straight to a queue keeps the Key: it travels in a header the
// consumer reads it from, and the routing key is the queue's name.
func TestPublishToQueueKeepsTheKey(t *testing.T) {
	q := testenv.UniqueName(t, "direct")
	deleteLater(t, []string{q}, nil)
	b := dial(t, rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: q, DeadLetterExchange: "x"}}}))
	must(t, b.Publish(testenv.Context(t, 10*time.Second), q, consumer.Message{ID: "m1", Key: "order-7", Body: []byte("x"), Headers: map[string]string{"h": "v"}}))
	c, err := b.NewConsumer(t.Context(), q)
	must(t, err)
	got := make(chan consumer.Message, 1)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- c.Run(ctx, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			got <- *m
			cancel()
			return nil
		}))
	}()
	select {
	case m := <-got:
		if m.Key != "order-7" || m.ID != "m1" || m.Headers["h"] != "v" || m.Headers[rabbit.HeaderKey] != "" {
			t.Errorf("got key %q id %q headers %v", m.Key, m.ID, m.Headers)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("nothing delivered")
	}
	cancel()
	must(t, <-done)
}

// A call with more messages than the confirm window goes through: the
// window frees as confirms arrive, not when the call ends.
func TestPublishMoreThanTheWindowInOneCall(t *testing.T) {
	q := testenv.UniqueName(t, "window")
	deleteLater(t, []string{q}, nil)
	b := dial(t, rabbit.WithConfirmWindow(8), rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: q, Classic: true}}}))
	msgs := make([]consumer.Message, 50)
	for i := range msgs {
		msgs[i] = consumer.Message{Body: []byte("x")}
	}
	if err := b.Publish(testenv.Context(t, 20*time.Second), q, msgs...); err != nil {
		t.Fatalf("publish 50 messages through a window of 8: %v", err)
	}
	qi, err := rawChannel(t).QueueDeclarePassive(q, true, false, false, false, nil)
	must(t, err)
	if qi.Messages != 50 {
		t.Errorf("%d messages in the queue, want 50", qi.Messages)
	}
}

// TestUnroutableNeverReportedAsPublished: an unroutable (mandatory,
// returned) message is sometimes reported as published (nil error) when it
// is not the first message of its Publish call.
//
// publish.go:341-347: publishRaw syncs with the drain goroutine (the
// barrier that makes sure every basic.return handed to drain is recorded)
// only once per channel per call, right after the FIRST confirm of the
// call. The returns of the later messages arrive after that barrier: the
// library's reader hands basic.return to drain (unbuffered) and then
// resolves the confirm; the publishing goroutine, woken by the confirm, can
// read pd.returned (publish.go:345-346) before drain has run markReturned
// (publish.go:181). The message is then reported confirmed although the
// broker dropped it: a silent loss (an outbox relay deletes the row).
func TestUnroutableNeverReportedAsPublished(t *testing.T) {
	ex := testenv.UniqueName(t, "rv-ret")
	q := ex + "-a"
	deleteLater(t, []string{q}, []string{ex})
	b := dial(t, rabbit.WithTopology(rabbit.Topology{
		Exchanges: []rabbit.Exchange{{Name: ex, Kind: "direct"}},
		Queues:    []rabbit.Queue{{Name: q, Classic: true}},
		Bindings:  []rabbit.Binding{{Exchange: ex, Queue: q, Key: "a"}},
	}))
	const calls, per = 30, 200
	missed := 0
	for c := range calls {
		// Message 0 is routable; messages 1..per are keyless (routing key
		// ""), which nothing is bound to: every one of them is returned.
		msgs := make([]consumer.Message, per+1)
		msgs[0] = consumer.Message{Key: "a", Body: []byte("routable")}
		for i := 1; i <= per; i++ {
			msgs[i] = consumer.Message{Body: []byte(fmt.Sprintf("unroutable %d/%d", c, i))}
		}
		err := b.Publish(testenv.Context(t, 20*time.Second), rabbit.ToExchange(ex), msgs...)
		var pe *consumer.PublishError
		if !errors.As(err, &pe) {
			t.Fatalf("call %d: Publish = %v, want a *consumer.PublishError", c, err)
		}
		failed := map[int]bool{}
		for _, f := range pe.Failed {
			if !errors.Is(f.Err, rabbit.ErrUnroutable) {
				t.Fatalf("call %d: message %d failed with %v, want ErrUnroutable", c, f.Index, f.Err)
			}
			failed[f.Index] = true
		}
		for i := 1; i <= per; i++ {
			if !failed[i] {
				missed++
			}
		}
		if failed[0] {
			t.Fatalf("call %d: the routable message failed", c)
		}
	}
	if missed > 0 {
		t.Errorf("%d of %d unroutable messages were reported as published (nil error): lost without an error", missed, calls*per)
	}
}
