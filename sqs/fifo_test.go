package sqs_test

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/smithy-go/middleware"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
)

// TestFIFOKeepsGroupOrderWithConcurrency16And5PercentErrors: 20 groups of
// 25 messages on a FIFO queue, 16 handlers, and about one run in twenty
// failing: within each group no two handlers run at once and the
// successful runs complete in publish order.
func TestFIFOKeepsGroupOrderWithConcurrency16And5PercentErrors(t *testing.T) {
	c := newClient(t, nil)
	b := newBroker(t, c)
	name, _ := createQueue(t, c, "fifo-order", queueConfig{fifo: true, visibility: 30 * time.Second})
	const groups, per = 20, 25
	var msgs []consumer.Message
	for i := range per {
		for g := range groups {
			msgs = append(msgs, consumer.Message{Key: fmt.Sprint("group-", g), Body: []byte(fmt.Sprint(i)), ID: fmt.Sprint(g, "-", i)})
		}
	}
	if err := b.Publish(context.Background(), name, msgs...); err != nil {
		t.Fatal(err)
	}
	var (
		mu       sync.Mutex
		done     = map[string][]string{}
		running  = map[string]bool{}
		overlaps []string
		failures int
	)
	fails := func(m *consumer.Message) bool {
		h := fnv.New32a()
		fmt.Fprint(h, m.Key, string(m.Body), m.Attempt)
		return h.Sum32()%20 == 0
	}
	l, err := b.NewConsumer(context.Background(), name, consumer.WithConcurrency(16),
		consumer.WithRedeliveryBackoff(time.Second, time.Second))
	if err != nil {
		t.Fatal(err)
	}
	start(t, l, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		if running[m.Key] {
			overlaps = append(overlaps, m.Key+"#"+string(m.Body))
		}
		running[m.Key] = true
		mu.Unlock()
		time.Sleep(time.Millisecond)
		mu.Lock()
		defer mu.Unlock()
		running[m.Key] = false
		if fails(m) {
			failures++
			return errDown
		}
		done[m.Key] = append(done[m.Key], string(m.Body))
		return nil
	}))
	testenv.WaitFor(t, 120*time.Second, "every message to be handled", func() bool {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, d := range done {
			n += len(d)
		}
		return n >= groups*per
	})
	mu.Lock()
	defer mu.Unlock()
	if len(overlaps) > 0 {
		t.Errorf("%d messages ran while an earlier one of their group ran: %v", len(overlaps), overlaps[:min(5, len(overlaps))])
	}
	want := make([]string, per)
	for i := range want {
		want[i] = fmt.Sprint(i)
	}
	for g := range groups {
		if got := done[fmt.Sprint("group-", g)]; !slices.Equal(got, want) {
			t.Errorf("group-%d completed in the order %v", g, got)
		}
	}
	if failures == 0 {
		t.Error("no handler failed; the test wants about 5% to")
	}
	t.Logf("%d failed runs of %d messages", failures, groups*per)
}

// TestFIFOReceiveRetryReusesAttemptID: when a ReceiveMessage on a FIFO
// queue fails after SQS may have taken messages for it (here: its answer is
// lost on the way back), the next receive sends the same
// ReceiveRequestAttemptId, so SQS hands the same messages over at once
// instead of keeping their group invisible for the visibility timeout.
func TestFIFOReceiveRetryReusesAttemptID(t *testing.T) {
	var cs calls
	var mu sync.Mutex
	var ids []string
	lost, lostID := false, ""
	loseFirstAnswer := func(stack *middleware.Stack) error {
		return stack.Initialize.Add(middleware.InitializeMiddlewareFunc("lose-answer",
			func(ctx context.Context, in middleware.InitializeInput, next middleware.InitializeHandler) (middleware.InitializeOutput, middleware.Metadata, error) {
				rin, ok := in.Parameters.(*awssqs.ReceiveMessageInput)
				out, md, err := next.HandleInitialize(ctx, in)
				if !ok || err != nil {
					return out, md, err
				}
				mu.Lock()
				defer mu.Unlock()
				ids = append(ids, aws.ToString(rin.ReceiveRequestAttemptId))
				if r, _ := out.Result.(*awssqs.ReceiveMessageOutput); r != nil && len(r.Messages) > 0 && !lost {
					lost, lostID = true, aws.ToString(rin.ReceiveRequestAttemptId)
					return out, md, errors.New("connection reset by peer (the answer was lost)")
				}
				return out, md, err
			}), middleware.After)
	}
	c := newClient(t, &cs, func(o *awssqs.Options) { o.APIOptions = append(o.APIOptions, loseFirstAnswer) })
	b := newBroker(t, c)
	name, _ := createQueue(t, c, "fifo-attempt", queueConfig{fifo: true, visibility: 30 * time.Second})
	if err := b.Publish(context.Background(), name, consumer.Message{Key: "g", Body: []byte("1")}, consumer.Message{Key: "g", Body: []byte("2")}); err != nil {
		t.Fatal(err)
	}
	begin := time.Now()
	got := consumeN(t, b, name, 2, consumer.WithFetchBackoff(100*time.Millisecond))
	if took := time.Since(begin); took > 10*time.Second {
		t.Errorf("the messages took %s to arrive after the lost answer; the retry did not get them back", took)
	}
	if string(got[0].Body) != "1" || string(got[1].Body) != "2" {
		t.Errorf("got %q then %q", got[0].Body, got[1].Body)
	}
	mu.Lock()
	defer mu.Unlock()
	if !lost {
		t.Fatal("no answer was lost")
	}
	// A receive after the lost one carries the same attempt id.
	reused := 0
	for i, id := range ids {
		if id == "" {
			t.Fatalf("receive %d carried no ReceiveRequestAttemptId", i)
		}
		if id == lostID {
			reused++
		}
	}
	if reused < 2 {
		t.Errorf("attempt ids %v: no receive after the lost answer reused %s", ids, lostID)
	}
}
