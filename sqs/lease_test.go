package sqs_test

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
	ferrysqs "github.com/ferrymq/ferry/sqs"
)

// fetchN fetches n deliveries from drv within 30 s.
func fetchN(t *testing.T, drv driver.Driver, n int) []driver.Message {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var got []driver.Message
	for len(got) < n {
		var err error
		got, err = drv.Fetch(ctx, got, n-len(got))
		if err != nil {
			t.Fatalf("fetch: %v (got %d of %d)", err, len(got), n)
		}
	}
	return got
}

// stealOne receives one message of url with the raw client (whose
// visibility has run out), so the handle the driver holds is no longer
// good; it returns the message's id.
func stealOne(t *testing.T, c *awssqs.Client, url string) string {
	t.Helper()
	out, err := c.ReceiveMessage(context.Background(), &awssqs.ReceiveMessageInput{QueueUrl: aws.String(url), MaxNumberOfMessages: 1, VisibilityTimeout: 60, WaitTimeSeconds: 5})
	if err != nil || len(out.Messages) != 1 {
		t.Fatalf("steal a message: %v (%d messages)", err, len(out.Messages))
	}
	return aws.ToString(out.Messages[0].MessageId)
}

// TestBatchDeleteWithOneBadReceiptHandleFailsOnlyThatEntry: three acks in
// one DeleteMessageBatch, one of them with a receipt handle SQS no longer
// takes (its visibility ran out and another receive took the message):
// Settle reports exactly that entry, by index, in a *driver.SettleError,
// and the other two are deleted.
func TestBatchDeleteWithOneBadReceiptHandleFailsOnlyThatEntry(t *testing.T) {
	var cs calls
	c := newClient(t, &cs)
	b := newBroker(t, c)
	name, url := createQueue(t, c, "baddelete", queueConfig{visibility: time.Second})
	if err := b.Publish(context.Background(), name, consumer.Message{Body: []byte("1")}, consumer.Message{Body: []byte("2")}, consumer.Message{Body: []byte("3")}); err != nil {
		t.Fatal(err)
	}
	drv, err := b.Driver(context.Background(), name, driver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer drv.Close()
	got := fetchN(t, drv, 3)
	time.Sleep(1500 * time.Millisecond) // every visibility runs out
	stolen := stealOne(t, c, url)
	batch := make([]driver.Settlement, len(got))
	bad := -1
	for i, m := range got {
		batch[i] = driver.Settlement{Handle: m.Handle, Action: driver.Ack}
		if m.ID == stolen {
			bad = i
		}
	}
	before := cs.get("DeleteMessageBatch")
	err = drv.Settle(context.Background(), batch)
	if n := cs.get("DeleteMessageBatch") - before; n != 1 {
		t.Errorf("DeleteMessageBatch calls = %d, want 1 for 3 acks", n)
	}
	var se *driver.SettleError
	if !errors.As(err, &se) || !slices.Equal(se.Failed, []int{bad}) {
		t.Fatalf("Settle = %v, want a *driver.SettleError failing exactly entry %d", err, bad)
	}
	var ee *ferrysqs.EntryError
	if !errors.As(err, &ee) || ee.Code != "ReceiptHandleIsInvalid" {
		t.Errorf("Settle error %v does not carry SQS's ReceiptHandleIsInvalid entry error", err)
	}
	visible, inflight, _ := depth(t, c, url)
	if visible != 0 || inflight != 1 {
		t.Errorf("queue holds %d visible and %d in flight, want only the stolen message, in flight", visible, inflight)
	}
}

// TestExpiredHandleEndsExtensionQuietly: an extension SQS refuses because
// the receipt handle is no longer good ends that message's extension
// without an error, counts it once in Stats.LeasesLost, and the message is
// not asked for again; the other messages are extended.
func TestExpiredHandleEndsExtensionQuietly(t *testing.T) {
	var cs calls
	c := newClient(t, &cs)
	b := newBroker(t, c)
	name, url := createQueue(t, c, "lostlease", queueConfig{visibility: time.Second})
	if err := b.Publish(context.Background(), name, consumer.Message{Body: []byte("1")}, consumer.Message{Body: []byte("2")}); err != nil {
		t.Fatal(err)
	}
	drv, err := b.Driver(context.Background(), name, driver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer drv.Close()
	got := fetchN(t, drv, 2)
	time.Sleep(1500 * time.Millisecond)
	stolen := stealOne(t, c, url)
	ext := drv.(driver.Extender)
	var entries atomic.Int64
	cs.setHook(func(op string, in any) {
		if op == "ChangeMessageVisibilityBatch" {
			entries.Add(int64(len(in.(*awssqs.ChangeMessageVisibilityBatchInput).Entries)))
		}
	})
	handles := []any{got[0].Handle, got[1].Handle}
	if err := ext.Extend(context.Background(), handles, 30*time.Second); err != nil {
		t.Fatalf("Extend with one expired handle = %v, want nil", err)
	}
	if n := b.Stats().LeasesLost; n != 1 {
		t.Errorf("LeasesLost = %d, want 1", n)
	}
	if n := entries.Load(); n != 2 {
		t.Errorf("first extension sent %d entries, want 2", n)
	}
	if err := ext.Extend(context.Background(), handles, 30*time.Second); err != nil {
		t.Fatalf("second Extend = %v, want nil", err)
	}
	if n := entries.Load(); n != 3 {
		t.Errorf("after the second extension %d entries were sent in all, want 3: the lost lease is not asked for again", n)
	}
	if n := b.Stats().LeasesLost; n != 1 {
		t.Errorf("LeasesLost = %d after the second extension, want still 1", n)
	}
	// The other message was extended: it stays invisible past its
	// original visibility of one second.
	time.Sleep(1500 * time.Millisecond)
	if visible, _, _ := depth(t, c, url); visible != 0 {
		t.Errorf("%d message(s) visible, want 0: the good lease was not extended", visible)
	}
	_ = stolen
}

// TestHandlerThreeTimesTheVisibilityGetsOneDelivery: a handler that runs
// three times the queue's visibility timeout keeps its message, while a
// second consumer polls the queue: one delivery in all, and SQS counted one
// receive.
func TestHandlerThreeTimesTheVisibilityGetsOneDelivery(t *testing.T) {
	c := newClient(t, nil)
	b := newBroker(t, c)
	const vis = 2 * time.Second
	name, url := createQueue(t, c, "long", queueConfig{visibility: vis})
	var mu sync.Mutex
	var deliveries []int
	h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		deliveries = append(deliveries, m.Deliveries)
		mu.Unlock()
		select {
		case <-time.After(3 * vis):
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})
	for range 2 {
		l, err := b.NewConsumer(context.Background(), name)
		if err != nil {
			t.Fatal(err)
		}
		start(t, l, h)
	}
	if err := b.Publish(context.Background(), name, consumer.Message{Body: []byte("long")}); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 30*time.Second, "the message to be deleted", func() bool {
		v, f, _ := depth(t, c, url)
		mu.Lock()
		defer mu.Unlock()
		return len(deliveries) > 0 && v == 0 && f == 0
	})
	time.Sleep(vis + time.Second)
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(deliveries, []int{1}) {
		t.Errorf("deliveries (by receive count) = %v, want [1]", deliveries)
	}
}

// TestExtensionStopsAtTheVisibilityLimit: SQS keeps a message invisible at
// most 12 hours after one receive; the driver never asks beyond what is
// left, and once nothing is left it stops extending (counted in
// Stats.VisibilityCapped) and the message is delivered again. The limit is
// shortened to a few seconds here.
func TestExtensionStopsAtTheVisibilityLimit(t *testing.T) {
	var cs calls
	c := newClient(t, &cs)
	b := newBroker(t, c)
	name, _ := createQueue(t, c, "cap", queueConfig{visibility: time.Second})
	const limit = 4 * time.Second
	drv, err := b.Driver(context.Background(), name, driver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ferrysqs.SetMaxVisibility(drv, limit)
	var first time.Time
	var mu sync.Mutex
	var asked []string
	cs.setHook(func(op string, in any) {
		if op != "ChangeMessageVisibilityBatch" {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		for _, e := range in.(*awssqs.ChangeMessageVisibilityBatchInput).Entries {
			until := time.Since(first) + time.Duration(e.VisibilityTimeout)*time.Second
			if until > limit+500*time.Millisecond {
				asked = append(asked, strconv.Itoa(int(e.VisibilityTimeout))+"s at "+time.Since(first).String())
			}
		}
	})
	l, err := consumer.New(drv)
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	release := make(chan struct{})
	start(t, l, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if runs.Add(1) == 1 {
			mu.Lock()
			first = time.Now()
			mu.Unlock()
			<-release
		}
		return nil
	}))
	if err := b.Publish(context.Background(), name, consumer.Message{Body: []byte("capped")}); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 20*time.Second, "the message to be delivered again after the limit", func() bool { return runs.Load() >= 2 })
	close(release)
	mu.Lock()
	elapsed := time.Since(first)
	mu.Unlock()
	if elapsed < limit-time.Second {
		t.Errorf("delivered again %s after the first run, before the %s limit", elapsed, limit)
	}
	if n := b.Stats().VisibilityCapped; n != 1 {
		t.Errorf("VisibilityCapped = %d, want 1", n)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(asked) > 0 {
		t.Errorf("extensions asked beyond the limit: %v", asked)
	}
}

var _ = types.Message{}

// TestZeroDelayReturnIsNotAHotLoop: a handler that fails asking to be run
// again at once (RetryAfter with no delay) gets its message back after a
// second, SQS's least visibility change, not in a tight loop of receives.
func TestZeroDelayReturnIsNotAHotLoop(t *testing.T) {
	c := newClient(t, nil)
	b := newBroker(t, c)
	name, _ := createQueue(t, c, "hot", queueConfig{visibility: 30 * time.Second})
	l, err := b.NewConsumer(context.Background(), name, consumer.WithRedeliveryBackoff(0, 0))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var at []time.Time
	start(t, l, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		at = append(at, time.Now())
		mu.Unlock()
		return consumer.RetryAfter(errDown, 0)
	}))
	if err := b.Publish(context.Background(), name, consumer.Message{Body: []byte("again")}); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 30*time.Second, "three runs", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(at) >= 3
	})
	mu.Lock()
	defer mu.Unlock()
	for i := 1; i < len(at); i++ {
		if gap := at[i].Sub(at[i-1]); gap < 900*time.Millisecond {
			t.Errorf("run %d came %s after the one before; a failed run comes back after at least a second", i+1, gap)
		}
	}
}

// TestLeaseHoldsAfterQueueVisibilityLowered: the Broker knows a queue's
// visibility from when it looked the queue up; after the queue's
// visibility is lowered, receives still ask for the lease the driver
// assumes, so a handler running longer than the new visibility keeps its
// message (found by review).
func TestLeaseHoldsAfterQueueVisibilityLowered(t *testing.T) {
	c := newClient(t, nil)
	b := newBroker(t, c)
	name, url := createQueue(t, c, "rv-stalevis", queueConfig{visibility: 30 * time.Second})
	ctx := context.Background()
	// The broker looks the queue up (visibility 30 s) ...
	if err := b.Publish(ctx, name, consumer.Message{Body: []byte("slow")}); err != nil {
		t.Fatal(err)
	}
	// ... and then the queue's visibility is lowered to 2 s.
	if _, err := c.SetQueueAttributes(ctx, &awssqs.SetQueueAttributesInput{
		QueueUrl:   aws.String(url),
		Attributes: map[string]string{string(types.QueueAttributeNameVisibilityTimeout): "2"},
	}); err != nil {
		t.Fatal(err)
	}
	l, err := b.NewConsumer(ctx, name, consumer.WithConcurrency(1), consumer.WithMaxInFlight(1))
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	started := make(chan struct{}, 4)
	r := start(t, l, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		runs.Add(1)
		started <- struct{}{}
		time.Sleep(7 * time.Second) // 3.5 times the queue's visibility now
		return nil
	}))
	select {
	case <-started:
	case <-time.After(30 * time.Second):
		t.Fatal("the handler never started")
	}
	// Another receiver polls the queue while the handler runs.
	var stolen []string
	deadline := time.Now().Add(6 * time.Second)
	for time.Now().Before(deadline) {
		out, err := c.ReceiveMessage(ctx, &awssqs.ReceiveMessageInput{
			QueueUrl: aws.String(url), MaxNumberOfMessages: 1, WaitTimeSeconds: 1, VisibilityTimeout: 60,
		})
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range out.Messages {
			stolen = append(stolen, aws.ToString(m.Body))
		}
	}
	r.stop(t)
	if len(stolen) > 0 {
		t.Errorf("another receiver got %q while the handler was still running (runs %d): the consumer kept a lease of 30 s the queue no longer gives (visibility now 2 s)",
			stolen, runs.Load())
	}
}

// TestHandOverDropsMessagesWhoseExtensionExpired: a message that waited in
// the driver's buffer long enough to be extended before its hand-over, and
// whose extension SQS refused because its handle is no longer good, is not
// handed to the loop (another receive may hold it); it counts in
// LeasesLost. The good message next to it is handed over.
func TestHandOverDropsMessagesWhoseExtensionExpired(t *testing.T) {
	c := newClient(t, nil)
	b := newBroker(t, c)
	name, url := createQueue(t, c, "handover-expired", queueConfig{visibility: 30 * time.Second})
	ctx := context.Background()
	if _, err := c.SendMessage(ctx, &awssqs.SendMessageInput{QueueUrl: aws.String(url), MessageBody: aws.String("good")}); err != nil {
		t.Fatal(err)
	}
	out, err := c.ReceiveMessage(ctx, &awssqs.ReceiveMessageInput{QueueUrl: aws.String(url), WaitTimeSeconds: 1, MaxNumberOfMessages: 1})
	if err != nil || len(out.Messages) != 1 {
		t.Fatalf("receive: %v, %d messages", err, len(out.Messages))
	}
	stale := out.Messages[0]
	stale.MessageId = aws.String("stale")
	stale.Body = aws.String("stale")
	stale.ReceiptHandle = aws.String("stale#handle")
	d, err := b.Driver(ctx, name, driver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	// Both waited in the buffer for half the lease.
	if err := ferrysqs.Buffer(ctx, d, []types.Message{out.Messages[0], stale}, 15*time.Second); err != nil {
		t.Fatal(err)
	}
	got, err := d.Fetch(ctx, nil, 10)
	if err != nil {
		t.Fatal(err)
	}
	var bodies []string
	for _, m := range got {
		bodies = append(bodies, string(m.Body))
	}
	if !slices.Equal(bodies, []string{"good"}) {
		t.Errorf("handed over %q, want only the good message", bodies)
	}
	if n := b.Stats().LeasesLost; n != 1 {
		t.Errorf("LeasesLost = %d, want 1", n)
	}
}
