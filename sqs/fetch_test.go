package sqs_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/smithy-go/middleware"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	ferrysqs "github.com/ferrymq/ferry/sqs"
)

// openReceives counts the ReceiveMessage calls of a client that have not
// answered yet.
type openReceives struct{ n atomic.Int64 }

func (o *openReceives) add(stack *middleware.Stack) error {
	return stack.Initialize.Add(middleware.InitializeMiddlewareFunc("ferry-test-open-receives",
		func(ctx context.Context, in middleware.InitializeInput, next middleware.InitializeHandler) (middleware.InitializeOutput, middleware.Metadata, error) {
			if _, ok := in.Parameters.(*awssqs.ReceiveMessageInput); !ok {
				return next.HandleInitialize(ctx, in)
			}
			o.n.Add(1)
			defer o.n.Add(-1)
			return next.HandleInitialize(ctx, in)
		}), middleware.After)
}

// publishN publishes n messages named prefix-0 ... to queue.
func publishN(t *testing.T, b *ferrysqs.Broker, queue, prefix string, n int) {
	t.Helper()
	msgs := make([]consumer.Message, n)
	for i := range msgs {
		msgs[i].Body = []byte(fmt.Sprint(prefix, "-", i))
	}
	if err := b.Publish(context.Background(), queue, msgs...); err != nil {
		t.Fatal(err)
	}
}

func ackAll(t *testing.T, drv driver.Driver, ms []driver.Message) {
	t.Helper()
	batch := make([]driver.Settlement, len(ms))
	for i, m := range ms {
		batch[i] = driver.Settlement{Handle: m.Handle, Action: driver.Ack}
	}
	if err := drv.Settle(context.Background(), batch); err != nil {
		t.Fatal(err)
	}
}

// TestFetchHandsOverAReceiveWhileOthersPoll: with a backlog, Fetch opens
// several receives at once, and returns what the first one to answer
// brought without waiting for the others, which go on polling (issue 32
// D7: a receive's messages waited for every receive of the fetch, a
// second for those that found nothing). What they bring comes with the
// next Fetch, and nothing is lost or left invisible.
func TestFetchHandsOverAReceiveWhileOthersPoll(t *testing.T) {
	var open openReceives
	c := newClient(t, nil, func(o *awssqs.Options) { o.APIOptions = append(o.APIOptions, open.add) })
	b := newBroker(t, c)
	name, url := createQueue(t, c, "handover", queueConfig{visibility: 30 * time.Second})
	drv, err := b.Driver(context.Background(), name, driver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer drv.Close()
	publishN(t, b, name, "first", 10)
	ackAll(t, drv, fetchN(t, drv, 10)) // a full receive: the queue has a backlog

	publishN(t, b, name, "then", 5)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	got, err := drv.Fetch(ctx, nil, 30) // room for three receives
	if err != nil {
		t.Fatal(err)
	}
	stillOpen := open.n.Load()
	if len(got) == 0 || stillOpen == 0 {
		t.Fatalf("Fetch returned %d messages with %d receives still open; want the first answer's messages while the other receives poll", len(got), stillOpen)
	}
	all := got
	for len(all) < 5 {
		more, err := drv.Fetch(ctx, nil, 30-len(all))
		if err != nil {
			t.Fatal(err)
		}
		all = append(all, more...)
	}
	if len(all) != 5 {
		t.Errorf("fetched %d messages, want the 5 published", len(all))
	}
	if visible, inflight, _ := depth(t, c, url); visible != 0 || inflight != len(all) {
		t.Errorf("queue: %d visible, %d in flight; want every message held by the driver", visible, inflight)
	}
	ackAll(t, drv, all)
}

// TestDrainHandsOverWhatOpenReceivesBring: when the loop stops, receives
// a Fetch opened may still be open (Fetch returned with the first
// answer). Drain waits a moment for them and hands over what they and the
// earlier answers brought, within the room the last Fetch left, for the
// loop to run; nothing they brought is left invisible, and Close leaves
// nothing behind.
func TestDrainHandsOverWhatOpenReceivesBring(t *testing.T) {
	c := newClient(t, nil)
	b := newBroker(t, c)
	name, url := createQueue(t, c, "drain-open", queueConfig{visibility: 30 * time.Second})
	drv, err := b.Driver(context.Background(), name, driver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	publishN(t, b, name, "first", 10)
	ackAll(t, drv, fetchN(t, drv, 10)) // a full receive: the queue has a backlog

	publishN(t, b, name, "then", 12)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	got, err := drv.Fetch(ctx, nil, 30) // three receives: 12 messages for them, and one more that waits
	if err != nil {
		t.Fatal(err)
	}
	publishN(t, b, name, "late", 3) // for a receive still open
	time.Sleep(200 * time.Millisecond)
	drained, err := drv.(driver.Drainer).Drain(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	handed := len(got) + len(drained)
	t.Logf("Fetch handed over %d, Drain %d", len(got), len(drained))
	if len(drained) == 0 || handed > 30 {
		t.Errorf("Drain handed over %d after Fetch's %d; want what the other receives brought, within the room of 30", len(drained), len(got))
	}
	if visible, inflight, _ := depth(t, c, url); visible+inflight != 15 || inflight != handed {
		t.Errorf("queue: %d visible, %d in flight, %d handed over; want every message handed over or visible", visible, inflight, handed)
	}
	ackAll(t, drv, append(got, drained...))
	if err := drv.Close(); err != nil {
		t.Fatal(err)
	}
	if visible, inflight, _ := depth(t, c, url); visible != 15-handed || inflight != 0 {
		t.Errorf("after Close: %d visible, %d in flight; want the %d not handed over visible", visible, inflight, 15-handed)
	}
}
