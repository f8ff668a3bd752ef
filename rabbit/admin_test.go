package rabbit_test

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/rabbit"
)

// CreateSource declares a quorum queue with a single active consumer, a
// dead-letter target it declares too, a delivery limit and a message TTL;
// declaring it again is not an error; a message rejected dead-letters to
// the target; DeleteSource removes the queue, and deleting a queue that is
// gone is not an error.
func TestAdminCreatesAndDeletesQueues(t *testing.T) {
	b := dial(t)
	var adm consumer.Admin = b
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	name := testenv.UniqueName(t, "admin")
	dlq := name + "-dlq"
	deleteLater(t, []string{name, dlq}, nil)
	cfg := consumer.SourceConfig{FIFO: true, DeadLetter: dlq, MaxDeliveries: 3, Retention: time.Hour}
	if err := adm.CreateSource(ctx, name, cfg); err != nil {
		t.Fatal(err)
	}
	if err := adm.CreateSource(ctx, name, cfg); err != nil {
		t.Fatalf("declaring the queue again: %v", err)
	}

	// The arguments are the broker's: declaring the queue with exactly
	// these succeeds, and without the TTL it is refused.
	ch := rawChannel(t)
	want := amqp.Table{
		"x-queue-type": "quorum", "x-single-active-consumer": true,
		"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq,
		"x-delivery-limit": int64(3), "x-message-ttl": int64(3600000),
	}
	if _, err := ch.QueueDeclare(name, true, false, false, false, want); err != nil {
		t.Fatalf("the queue's arguments are not %v: %v", want, err)
	}
	delete(want, "x-message-ttl")
	if _, err := ch.QueueDeclare(name, true, false, false, false, want); err == nil {
		t.Fatal("the queue was declared without x-message-ttl")
	}
	ch = rawChannel(t)
	if _, err := ch.QueueDeclarePassive(dlq, true, false, false, false, nil); err != nil {
		t.Fatalf("the dead-letter queue was not declared: %v", err)
	}

	if err := b.Publish(ctx, name, consumer.Message{ID: "m-1", Key: "k", Body: []byte("one")}); err != nil {
		t.Fatal(err)
	}
	// basic.get is refused on a single-active-consumer queue: consume.
	deliveries, err := ch.Consume(name, "", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	var d amqp.Delivery
	select {
	case d = <-deliveries:
	case <-ctx.Done():
		t.Fatal("no delivery of the message published")
	}
	if string(d.Body) != "one" {
		t.Fatalf("got %q, want the message published", d.Body)
	}
	if err := d.Reject(false); err != nil {
		t.Fatal(err)
	}
	if d := getOne(t, ch, dlq); string(d.Body) != "one" {
		t.Fatalf("the dead-letter queue got %q, want the message rejected", d.Body)
	}

	if err := adm.DeleteSource(ctx, name); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclarePassive(name, true, false, false, false, nil); err == nil {
		t.Fatalf("queue %q is still there", name)
	}
	if err := adm.DeleteSource(ctx, name); err != nil {
		t.Fatalf("deleting a queue that is gone: %v", err)
	}
}

// A delivery limit without a dead-letter target would drop messages, and a
// RabbitMQ delivery holds no lease: both are refused, naming the field,
// before anything is declared.
func TestAdminRefusesDeliveryLimitWithoutDeadLetter(t *testing.T) {
	b := dial(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	name := testenv.UniqueName(t, "admin-nodlq")
	deleteLater(t, []string{name}, nil)
	for _, tc := range []struct {
		cfg   consumer.SourceConfig
		field string
	}{
		{consumer.SourceConfig{MaxDeliveries: 3}, "SourceConfig.MaxDeliveries"},
		{consumer.SourceConfig{Lease: time.Minute}, "SourceConfig.Lease"},
	} {
		err := b.CreateSource(ctx, name, tc.cfg)
		var ce *consumer.ConfigError
		if !errors.As(err, &ce) || ce.Field != tc.field {
			t.Fatalf("CreateSource(%+v) = %v, want a *consumer.ConfigError naming %s", tc.cfg, err, tc.field)
		}
	}
	if _, err := rawChannel(t).QueueDeclarePassive(name, true, false, false, false, nil); err == nil {
		t.Fatalf("a refused CreateSource declared %q", name)
	}
}

// A queue CreateSource makes without a DeadLetter drops nothing however
// often a message goes back: on RabbitMQ 4 its default delivery limit of 20
// would drop the message at its 21st delivery, with nowhere to dead-letter
// it. On 3.x there is no default limit, and this passes either way.
func TestAdminQueueWithoutDeadLetterDropsNothing(t *testing.T) {
	b := dial(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	name := testenv.UniqueName(t, "admin-nolimit")
	deleteLater(t, []string{name}, nil)
	if err := b.CreateSource(ctx, name, consumer.SourceConfig{}); err != nil {
		t.Fatal(err)
	}
	if err := b.CreateSource(ctx, name, consumer.SourceConfig{}); err != nil {
		t.Fatalf("declaring the queue again: %v", err)
	}
	if err := b.Publish(ctx, name, consumer.Message{ID: "m-1", Body: []byte("one")}); err != nil {
		t.Fatal(err)
	}
	ch := rawChannel(t)
	const returns = 25 // past RabbitMQ 4's default limit of 20
	for i := range returns {
		d := getOne(t, ch, name)
		if err := d.Nack(false, true); err != nil {
			t.Fatalf("return %d: %v", i+1, err)
		}
	}
	if d := getOne(t, ch, name); string(d.Body) != "one" {
		t.Fatalf("after %d returns got %q, want the message", returns, d.Body)
	}
}

// On RabbitMQ 4, a queue that exists with the broker's default delivery
// limit and no dead-letter exchange (declared by an earlier Ferry, or by
// hand) is kept by CreateSource, not refused for the argument it now
// declares, and the Broker warns that the queue drops.
func TestAdminKeepsAQueueWithTheDefaultLimitAndWarns(t *testing.T) {
	if serverMajor := serverVersion(t); !strings.HasPrefix(serverMajor, "4.") {
		t.Skipf("RabbitMQ %s sets no default delivery limit", serverMajor)
	}
	rec := newRecorder(t)
	b := dial(t, rabbit.WithLogger(slog.New(rec)))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	name := testenv.UniqueName(t, "admin-default-limit")
	deleteLater(t, []string{name}, nil)
	if _, err := rawChannel(t).QueueDeclare(name, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
		t.Fatal(err)
	}
	if err := b.CreateSource(ctx, name, consumer.SourceConfig{}); err != nil {
		t.Fatalf("CreateSource of a queue with the default limit: %v", err)
	}
	warns := rec.matching("rabbit: CreateSource found the quorum queue declared with RabbitMQ's default delivery limit")
	if len(warns) != 1 || !slices.Contains(warns[0].values("queue"), name) {
		t.Fatalf("warnings %v, want one naming queue %s", warns, name)
	}
}

// getOne takes one message of queue, unacked, waiting for it to be there.
func getOne(t *testing.T, ch *amqp.Channel, queue string) amqp.Delivery {
	t.Helper()
	for start := time.Now(); time.Since(start) < 30*time.Second; time.Sleep(20 * time.Millisecond) {
		d, ok, err := ch.Get(queue, false)
		if err != nil {
			t.Fatalf("get from %q: %v", queue, err)
		}
		if ok {
			return d
		}
	}
	t.Fatalf("no message in %q within 30s", queue)
	return amqp.Delivery{}
}
