package integration_test

import (
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/internal/testenv"
)

func amqpChannel(t *testing.T) *amqp.Channel {
	t.Helper()
	url := testenv.RequireRabbitMQ(t)
	conn, err := amqp.DialConfig(url, amqp.Config{Dial: amqp.DefaultDial(5 * time.Second)})
	if err != nil {
		t.Fatalf("dial %s: %v", url, err)
	}
	t.Cleanup(func() { conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	return ch
}

// publishConfirmed publishes body to queue through the default exchange,
// mandatory, and waits for the broker's confirm.
func publishConfirmed(t *testing.T, ch *amqp.Channel, queue, body string) {
	t.Helper()
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	ctx := testenv.Context(t, 10*time.Second)
	dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, true, false,
		amqp.Publishing{Body: []byte(body), DeliveryMode: amqp.Persistent})
	if err != nil {
		t.Fatalf("publish: %v", err)
	}
	if ok, err := dc.WaitContext(ctx); err != nil || !ok {
		t.Fatalf("publish not confirmed: ack=%v err=%v", ok, err)
	}
}

func next(t *testing.T, deliveries <-chan amqp.Delivery) amqp.Delivery {
	t.Helper()
	select {
	case d, ok := <-deliveries:
		if !ok {
			t.Fatal("delivery channel closed")
		}
		return d
	case <-time.After(10 * time.Second):
		t.Fatal("no delivery within 10s")
	}
	panic("unreachable")
}

// TestRabbitMQQuorumDeliveryCount round-trips a message through a quorum
// queue and checks the x-delivery-count header the broker adds after a
// reject with requeue: absent on the first delivery, 1 then 2 after.
func TestRabbitMQQuorumDeliveryCount(t *testing.T) {
	t.Parallel()
	ch := amqpChannel(t)
	q := testenv.UniqueName(t, "")
	if _, err := ch.QueueDeclare(q, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
		t.Fatalf("declare quorum queue: %v", err)
	}
	t.Cleanup(func() { ch.QueueDelete(q, false, false, false) })
	publishConfirmed(t, ch, q, "hello")

	if err := ch.Qos(1, 0, false); err != nil {
		t.Fatal(err)
	}
	deliveries, err := ch.Consume(q, "", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	d := next(t, deliveries)
	if string(d.Body) != "hello" {
		t.Fatalf("body %q", d.Body)
	}
	if v, ok := d.Headers["x-delivery-count"]; ok && v != int64(0) {
		t.Fatalf("first delivery has x-delivery-count %v (%T)", v, v)
	}
	for want := int64(1); want <= 2; want++ {
		if err := d.Reject(true); err != nil {
			t.Fatal(err)
		}
		d = next(t, deliveries)
		if !d.Redelivered {
			t.Errorf("delivery %d is not flagged redelivered", want+1)
		}
		if got := d.Headers["x-delivery-count"]; got != want {
			t.Fatalf("after %d rejects x-delivery-count = %v (%T), want %d", want, got, got, want)
		}
	}
	if err := d.Ack(false); err != nil {
		t.Fatal(err)
	}
	// Acked means gone.
	ins, err := ch.QueueDeclarePassive(q, true, false, false, false, amqp.Table{"x-queue-type": "quorum"})
	if err != nil {
		t.Fatal(err)
	}
	if ins.Messages != 0 {
		t.Errorf("queue still holds %d messages after the ack", ins.Messages)
	}
}

// TestRabbitMQPlugins checks that the plugins the adapters need are enabled:
// a consistent-hash exchange can be declared and routes to a bound queue.
func TestRabbitMQPlugins(t *testing.T) {
	t.Parallel()
	ch := amqpChannel(t)
	ex := testenv.UniqueName(t, "hash")
	if err := ch.ExchangeDeclare(ex, "x-consistent-hash", false, true, false, false, nil); err != nil {
		t.Fatalf("declare x-consistent-hash exchange (plugin rabbitmq_consistent_hash_exchange): %v", err)
	}
	q, err := ch.QueueDeclare("", false, true, true, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.QueueBind(q.Name, "1", ex, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := ch.PublishWithContext(testenv.Context(t, 5*time.Second), ex, "some-key", true, false, amqp.Publishing{Body: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		_, ok, err := ch.Get(q.Name, true)
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the consistent-hash exchange routed nothing to its only queue")
		}
		time.Sleep(20 * time.Millisecond)
	}
}
