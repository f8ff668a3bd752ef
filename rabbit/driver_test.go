package rabbit_test

import (
	"context"
	"errors"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/rabbit"
)

func fetchN(t *testing.T, d driver.Driver, n int) []driver.Message {
	t.Helper()
	var msgs []driver.Message
	ctx := testenv.Context(t, 20*time.Second)
	for len(msgs) < n {
		var err error
		msgs, err = d.Fetch(ctx, msgs, n-len(msgs))
		if err != nil && (driver.IsFatal(err) || ctx.Err() != nil) {
			t.Fatal(err)
		}
		if err != nil {
			t.Logf("Fetch reported: %v", err)
		}
	}
	return msgs
}

func queueCounts(t *testing.T, q string) (ready, unackedN int) {
	t.Helper()
	qi, err := rawChannel(t).QueueDeclarePassive(q, true, false, false, false, amqp.Table{"x-queue-type": "quorum"})
	must(t, err)
	return qi.Messages, unacked(t, q)
}

// Acks settled out of order are safe, and contiguous ones go out as one
// basic.ack with multiple: acking the upper half first sends one frame per
// delivery (the lower half is unsettled), then the lower half goes out as
// a single frame; a reject in the middle comes back once; the queue ends
// empty and the channel is never closed by a wrong tag.
func TestAcksBatchedWithMultipleAndSafeOutOfOrder(t *testing.T) {
	q := testenv.UniqueName(t, "acks")
	deleteLater(t, []string{q}, nil)
	b := dial(t, rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: q, DeadLetterExchange: "x"}}}))
	msgs := make([]consumer.Message, 10)
	for i := range msgs {
		msgs[i] = consumer.Message{Body: []byte{byte('0' + i)}}
	}
	must(t, b.Publish(testenv.Context(t, 10*time.Second), q, msgs...))
	d, err := openDriver(t, b, q, driver.Config{MaxInFlight: 10})
	must(t, err)
	t.Cleanup(func() { d.Close() })
	got := fetchN(t, d, 10)
	ack := func(ms ...driver.Message) {
		t.Helper()
		var batch []driver.Settlement
		for _, m := range ms {
			batch = append(batch, driver.Settlement{Handle: m.Handle, Action: driver.Ack})
		}
		must(t, d.Settle(testenv.Context(t, 10*time.Second), batch))
	}
	ack(got[6:]...)
	if n := rabbit.AckFrames(d); n != 4 {
		t.Fatalf("acking 4 deliveries above an unsettled one sent %d frames, want 4 single acks", n)
	}
	must(t, d.Settle(testenv.Context(t, 10*time.Second), []driver.Settlement{{Handle: got[5].Handle, Action: driver.Return}}))
	ack(got[:5]...)
	if n := rabbit.AckFrames(d); n != 5 {
		t.Fatalf("acking the 5 lowest deliveries sent %d frames, want 1 (multiple)", n-4)
	}
	again := fetchN(t, d, 1)
	if string(again[0].Body) != "5" || again[0].Deliveries != 2 {
		t.Fatalf("redelivered %q on delivery %d, want the rejected 5 on its 2nd", again[0].Body, again[0].Deliveries)
	}
	ack(again...)
	testenv.WaitFor(t, 10*time.Second, "an empty queue with nothing unacked", func() bool {
		r, u := queueCounts(t, q)
		return r == 0 && u == 0
	})
}

// A delivery of a channel that closed is never acked on the next channel:
// Settle reports it stale, and the message comes back.
func TestStaleDeliveryIsNotAckedOnTheNewChannel(t *testing.T) {
	q := testenv.UniqueName(t, "stale")
	deleteLater(t, []string{q}, nil)
	logger, logs := capture(t)
	b := dial(t, rabbit.WithLogger(logger), rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: q, DeadLetterExchange: "x"}}}))
	must(t, b.Publish(testenv.Context(t, 10*time.Second), q, consumer.Message{ID: "one", Body: []byte("1")}, consumer.Message{ID: "two", Body: []byte("2")}))
	d, err := openDriver(t, b, q, driver.Config{MaxInFlight: 1})
	must(t, err)
	t.Cleanup(func() { d.Close() })
	first := fetchN(t, d, 1)

	// Close the consuming connection from the broker's side.
	for _, line := range splitLines(ctl(t, "list_connections", "pid", "client_properties")) {
		if containsAll(line, "ferry consume") {
			ctl(t, "close_connection", fields(line)[0], "ferry test: stale tag")
		}
	}
	var rev driver.Revocation
	select {
	case rev = <-d.Revoked():
	case <-time.After(20 * time.Second):
		t.Fatal("no revocation after the channel closed")
	}
	if len(rev.Lanes) != 1 || rev.Lanes[0] != "" {
		t.Errorf("revoked lanes %q, want [\"\"]", rev.Lanes)
	}
	close(rev.Done)
	// The new channel delivers again: tag 1 there is another delivery.
	second := fetchN(t, d, 1)
	err = d.Settle(testenv.Context(t, 10*time.Second), []driver.Settlement{{Handle: first[0].Handle, Action: driver.Ack}})
	var se *driver.SettleError
	if !errors.As(err, &se) || !errors.Is(err, rabbit.ErrStaleDelivery) || len(se.Failed) != 1 {
		t.Fatalf("Settle of a closed channel's delivery = %v, want a SettleError with ErrStaleDelivery", err)
	}
	must(t, d.Settle(testenv.Context(t, 10*time.Second), []driver.Settlement{{Handle: second[0].Handle, Action: driver.Ack}}))
	third := fetchN(t, d, 1)
	must(t, d.Settle(testenv.Context(t, 10*time.Second), []driver.Settlement{{Handle: third[0].Handle, Action: driver.Ack}}))
	ids := map[string]bool{second[0].ID: true, third[0].ID: true}
	if !ids["one"] || !ids["two"] {
		t.Errorf("after the reconnect got %v, want both messages", ids)
	}
	if containsAll(logs.String(), "unknown delivery tag") {
		t.Error("a stale tag closed the new channel")
	}
}

// Lag reports the queue's ready messages and the consumer's unsettled
// deliveries, those it fetched and those the broker pushed ahead.
func TestLagReportsReadyAndUnacked(t *testing.T) {
	q := testenv.UniqueName(t, "lag")
	deleteLater(t, []string{q}, nil)
	b := dial(t, rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: q, DeadLetterExchange: "x"}}}))
	msgs := make([]consumer.Message, 30)
	for i := range msgs {
		msgs[i] = consumer.Message{Body: []byte("x")}
	}
	must(t, b.Publish(testenv.Context(t, 10*time.Second), q, msgs...))
	d, err := openDriver(t, b, q, driver.Config{MaxInFlight: 5})
	must(t, err)
	t.Cleanup(func() { d.Close() })
	got := fetchN(t, d, 5)
	testenv.WaitFor(t, 10*time.Second, "25 ready", func() bool {
		l, err := d.Lag(context.Background())
		must(t, err)
		return l.Messages == 25 && l.InFlight == 5
	})
	must(t, d.Settle(testenv.Context(t, 10*time.Second), []driver.Settlement{{Handle: got[0].Handle, Action: driver.Ack}}))
	// The broker pushes one more in the acked one's place: not fetched
	// yet, it is this consumer's all the same, and not done.
	testenv.WaitFor(t, 10*time.Second, "24 ready and 5 in flight (4 fetched, 1 pushed ahead)", func() bool {
		l, err := d.Lag(context.Background())
		must(t, err)
		return l.Messages == 24 && l.InFlight == 5
	})
}

// TestDeletedDelayQueueIsDeclaredAgain: once a delay queue is gone
// (deleted by an operator or a cleanup script), every delayed retry of the
// source queue is requeued at once, with no delay, for as long as the
// publishing connection lives: the delay queue is never declared again.
//
// driver.go:962-966: declareDelay remembers a delay queue as declared per
// publishing connection and skips the declare; the copy published to the
// missing queue is returned (unroutable), retryLater marks the original
// kindReject (driver.go:939-947) and Settle requeues it immediately
// (driver.go:755-756). A handler asking for a 1s (or 30 min) back-off
// against a struggling dependency then spins at full speed: a retry storm,
// and on a quorum queue each requeue counts a delivery toward the limit.
func TestDeletedDelayQueueIsDeclaredAgain(t *testing.T) {
	name := testenv.UniqueName(t, "rv-delay")
	deleteLater(t, []string{name}, nil)
	b := dial(t, rabbit.WithRetryDelays(time.Second),
		rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: name, Classic: true}}}))
	must(t, b.Publish(testenv.Context(t, 5*time.Second), name, consumer.Message{ID: "m1", Body: []byte("x")}))
	d, err := openDriver(t, b, name, driver.Config{MaxInFlight: 1})
	must(t, err)
	t.Cleanup(func() { d.Close() })
	fetch := func() driver.Message {
		t.Helper()
		ms, err := d.Fetch(testenv.Context(t, 10*time.Second), nil, 1)
		if err != nil || len(ms) != 1 {
			t.Fatalf("Fetch = %d messages, %v", len(ms), err)
		}
		return ms[0]
	}
	retry := func(m driver.Message) error {
		return d.Settle(testenv.Context(t, 15*time.Second), []driver.Settlement{{Handle: m.Handle, Action: driver.Return, Delay: time.Second}})
	}
	// The first delayed retry declares the delay queue and goes through it.
	must(t, retry(fetch()))
	m := fetch()

	// The delay queue is deleted; the next delayed retry must still wait.
	ch := rawChannel(t)
	if _, err := ch.QueueDelete(name+".ferry-delay.1000ms", false, false, false); err != nil {
		t.Fatal(err)
	}
	if err := retry(m); err != nil {
		t.Errorf("a delayed retry after the delay queue was deleted: %v", err)
	}
	start := time.Now()
	fetch()
	if took := time.Since(start); took < 800*time.Millisecond {
		t.Errorf("the message asked back after 1s came back after %s", took.Round(time.Millisecond))
	}
}
