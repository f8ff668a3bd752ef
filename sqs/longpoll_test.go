package sqs_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/ferrymq/ferry/consumer"
	ferrysqs "github.com/ferrymq/ferry/sqs"
)

// TestStopStrandsNoMessageInOpenLongPolls: cancelling a ReceiveMessage
// only closes the client's side; ElasticMQ, like SQS, keeps the poll open
// and hands it the next messages, which then stay invisible for the
// visibility timeout. A consumer that stops lets its open long poll end by
// itself and gives back what it brings, so a message published right after
// the stop is received by the next consumer at once (found by review).
func TestStopStrandsNoMessageInOpenLongPolls(t *testing.T) {
	c := newClient(t, nil)
	b := newBroker(t, c, ferrysqs.WithWaitTime(ferrysqs.MaxWaitTime))
	name, url := createQueue(t, c, "rv-cutpoll", queueConfig{visibility: 60 * time.Second})
	l, err := b.NewConsumer(context.Background(), name, consumer.WithMaxInFlight(10))
	if err != nil {
		t.Fatal(err)
	}
	r := start(t, l, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error { return nil }))
	time.Sleep(time.Second) // its long poll (3 s) is open on the empty queue
	r.stop(t)               // graceful stop: Run returns
	// Right after the stop, a producer publishes.
	if err := b.Publish(context.Background(), name, consumer.Message{Body: []byte("after the stop")}); err != nil {
		t.Fatal(err)
	}
	// A fresh receiver (the next instance of the service) polls for 5 s.
	var got int
	deadline := time.Now().Add(5 * time.Second)
	for got == 0 && time.Now().Before(deadline) {
		out, err := c.ReceiveMessage(context.Background(), &awssqs.ReceiveMessageInput{
			QueueUrl: aws.String(url), MaxNumberOfMessages: 10, WaitTimeSeconds: 1,
		})
		if err != nil {
			t.Fatal(err)
		}
		got += len(out.Messages)
	}
	if got == 0 {
		visible, inflight, _ := depth(t, c, url)
		t.Errorf("a message published after the consumer stopped could not be received for 5 s (queue: %d visible, %d in flight): a cut long poll of the stopped consumer took it, invisible for the 60 s visibility timeout",
			visible, inflight)
	}
}

// TestLongPollOutlivesPlainHTTPClientTimeout: a client configured with an
// ordinary *http.Client whose Timeout (2 s) is shorter than the long poll
// (3 s) does not cut the poll: receives get a per-request client whose
// timeout outlives it, and a message sent to an idle consumer is handled at
// once, on its first receive (found by review).
func TestLongPollOutlivesPlainHTTPClientTimeout(t *testing.T) {
	c := newClient(t, nil, func(o *awssqs.Options) {
		o.HTTPClient = &http.Client{Timeout: 2 * time.Second}
	})
	b := newBroker(t, c, ferrysqs.WithWaitTime(ferrysqs.MaxWaitTime))
	name, url := createQueue(t, c, "rv-httptimeout", queueConfig{visibility: 60 * time.Second})
	l, err := b.NewConsumer(context.Background(), name, consumer.WithMaxInFlight(10))
	if err != nil {
		t.Fatal(err)
	}
	type handled struct {
		at      time.Time
		attempt int
	}
	got := make(chan handled, 1)
	r := start(t, l, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		select {
		case got <- handled{time.Now(), m.Attempt}:
		default:
		}
		return nil
	}))
	time.Sleep(2500 * time.Millisecond) // a long poll cut by the HTTP timeout would have been cut at 2 s, and be open in SQS for another second
	sent := time.Now()
	if err := b.Publish(context.Background(), name, consumer.Message{Body: []byte("m")}); err != nil {
		t.Fatal(err)
	}
	select {
	case h := <-got:
		t.Logf("handled %s after it was sent, attempt %d", h.at.Sub(sent), h.attempt)
		// A poll cut by the HTTP timeout would have taken it first:
		// handled only after pollVisibility, on a later receive.
		if d := h.at.Sub(sent); d > 2*time.Second || h.attempt != 1 {
			t.Errorf("handled %s after it was sent on attempt %d, want at once on attempt 1: a long poll cut by the 2 s HTTP timeout took it first", d, h.attempt)
		}
	case <-time.After(8 * time.Second):
		visible, inflight, _ := depth(t, c, url)
		t.Errorf("a message sent to an idle consumer was not handled within 8 s (queue: %d visible, %d in flight): a long poll cut by the 2 s HTTP timeout took it", visible, inflight)
	}
	r.stop(t)
}
