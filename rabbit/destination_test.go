package rabbit_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/rabbit"
)

// depth is the number of ready messages in queue, asked of the broker
// from outside the package.
func depth(t *testing.T, ch *amqp.Channel, queue string) int {
	t.Helper()
	qi, err := ch.QueueDeclarePassive(queue, true, false, false, false, amqp.Table{"x-queue-type": "quorum"})
	if err != nil {
		t.Fatalf("inspect %s: %v", queue, err)
	}
	return qi.Messages
}

// A plain destination is the queue of that name, as on every broker, even
// when an exchange has the name too (here bound to another queue): the
// message goes straight to the queue. ToExchange(name) goes through the
// exchange, and the deprecated ToQueue still names the queue.
func TestPlainDestinationIsTheQueueAndToExchangeTheExchange(t *testing.T) {
	name := testenv.UniqueName(t, "dest")
	bound := name + "-bound"
	deleteLater(t, []string{name, bound}, []string{name})
	b := dial(t, rabbit.WithTopology(rabbit.Topology{
		Exchanges: []rabbit.Exchange{{Name: name, Kind: "fanout"}},
		Queues:    []rabbit.Queue{{Name: name, DeadLetterExchange: "x"}, {Name: bound, DeadLetterExchange: "x"}},
		Bindings:  []rabbit.Binding{{Exchange: name, Queue: bound}},
	}))
	ch := rawChannel(t)

	must(t, b.Publish(testenv.Context(t, 10*time.Second), name, consumer.Message{Key: "k", Body: []byte("to the queue")}))
	testenv.WaitFor(t, 10*time.Second, "the message in the queue", func() bool { return depth(t, ch, name) == 1 })
	if n := depth(t, ch, bound); n != 0 {
		t.Fatalf("the plain name went through the exchange: %d messages in %s", n, bound)
	}

	must(t, b.Publish(testenv.Context(t, 10*time.Second), rabbit.ToExchange(name), consumer.Message{Key: "k", Body: []byte("through the exchange")}))
	testenv.WaitFor(t, 10*time.Second, "the message in the exchange's queue", func() bool { return depth(t, ch, bound) == 1 })

	must(t, b.Publish(testenv.Context(t, 10*time.Second), rabbit.ToQueue(name), consumer.Message{Body: []byte("deprecated form")}))
	testenv.WaitFor(t, 10*time.Second, "ToQueue's message in the queue", func() bool { return depth(t, ch, name) == 2 })

	d, err := b.Driver(t.Context(), name, driver.Config{})
	must(t, err)
	defer d.Close()
	msgs, err := d.Fetch(testenv.Context(t, 10*time.Second), nil, 1)
	must(t, err)
	if len(msgs) != 1 || string(msgs[0].Body) != "to the queue" || msgs[0].Key != "k" {
		t.Fatalf("fetched %+v, want the first message with its key k", msgs)
	}
	if got := b.DestinationName(rabbit.ToExchange(name)); got != name {
		t.Errorf("DestinationName(ToExchange(%q)) = %q", name, got)
	}
}

// The README's snippet, consumer.Standard(b, "orders-dlq"), dead-letters a
// poison message into the queue orders-dlq. (When the name was taken for an
// exchange, the dead letter failed with a 404 and the message came back
// for ever.)
func TestStandardDeadLettersToAQueueNamedPlainly(t *testing.T) {
	src := testenv.UniqueName(t, "orders")
	dlq := src + "-dlq"
	deleteLater(t, []string{src, dlq}, nil)
	b := dial(t, rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{
		{Name: src, DeadLetterExchange: "x"},
		{Name: dlq, DeadLetterExchange: "x"},
	}}))
	stack, err := consumer.Standard(b, dlq)
	must(t, err)
	// Published from outside, so that only the dead letter goes through
	// the Broker's Publish.
	ch := rawChannel(t)
	must(t, ch.PublishWithContext(testenv.Context(t, 10*time.Second), "", src, true, false, amqp.Publishing{
		MessageId: "poison-1", Headers: amqp.Table{rabbit.HeaderKey: "o-9"}, Body: []byte("not json"),
	}))
	c, err := b.NewConsumer(t.Context(), src)
	must(t, err)
	stop := runLoop(t, c, stack.Wrap(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		return consumer.Permanent(errors.New("undecodable order"))
	})))
	var d amqp.Delivery
	testenv.WaitFor(t, 30*time.Second, "the dead letter in "+dlq, func() bool {
		m, ok, err := ch.Get(dlq, true)
		must(t, err)
		d = m
		return ok
	})
	must(t, stop())
	if string(d.Body) != "not json" || d.MessageId != "poison-1" || d.Headers[consumer.HeaderDLQReason] != consumer.DLQReasonPermanent {
		t.Errorf("dead letter body %q id %q headers %v", d.Body, d.MessageId, d.Headers)
	}
	if d.Headers[rabbit.HeaderKey] != "o-9" {
		t.Errorf("the dead letter's key travels as %v, want o-9 in %s", d.Headers[rabbit.HeaderKey], rabbit.HeaderKey)
	}
	if n := stack.DeadLetter.Count(); n != 1 {
		t.Errorf("DeadLetter.Count() = %d, want 1", n)
	}
}

// A plain name that no queue has fails the message with ErrUnroutable and
// an error naming the queue; the broker refused nothing (no channel was
// closed), and the next publish on the same Broker, to the same missing
// queue or to a good one, goes on as before. A name an exchange of the
// Topology has is not taken for the exchange: the error says to use
// ToExchange.
func TestPublishToAMissingQueueFailsNamingIt(t *testing.T) {
	good := testenv.UniqueName(t, "good")
	missing := good + "-missing"
	ex := good + "-exchange"
	deleteLater(t, []string{good}, []string{ex})
	b := dial(t, rabbit.WithTopology(rabbit.Topology{
		Exchanges: []rabbit.Exchange{{Name: ex, Kind: "fanout"}},
		Queues:    []rabbit.Queue{{Name: good, DeadLetterExchange: "x"}},
		Bindings:  []rabbit.Binding{{Exchange: ex, Queue: good}},
	}))
	check := func(dest, hint string) {
		t.Helper()
		err := b.Publish(testenv.Context(t, 10*time.Second), dest, consumer.Message{Body: []byte("lost")})
		var pe *consumer.PublishError
		if !errors.As(err, &pe) || len(pe.Failed) != 1 || !errors.Is(err, rabbit.ErrUnroutable) {
			t.Fatalf("Publish to %s = %v, want a *consumer.PublishError matching ErrUnroutable", dest, err)
		}
		if errors.Is(err, rabbit.ErrRefused) || errors.Is(err, rabbit.ErrNotConfirmed) {
			t.Errorf("Publish to %s = %v: the channel was closed", dest, err)
		}
		if msg := err.Error(); !strings.Contains(msg, `queue "`+dest+`"`) || !strings.Contains(msg, hint) {
			t.Errorf("Publish to %s = %q, want it to name the queue and say %q", dest, msg, hint)
		}
	}
	for range 3 {
		check(missing, "rabbit.ToExchange names an exchange")
		must(t, b.Publish(testenv.Context(t, 10*time.Second), good, consumer.Message{Body: []byte("kept")}))
	}
	check(ex, `the Topology declares an exchange "`+ex+`": publish to rabbit.ToExchange("`+ex+`")`)
	must(t, b.Publish(testenv.Context(t, 10*time.Second), rabbit.ToExchange(ex), consumer.Message{Body: []byte("kept")}))
	ch := rawChannel(t)
	testenv.WaitFor(t, 10*time.Second, "every good message in the queue", func() bool { return depth(t, ch, good) == 4 })
}
