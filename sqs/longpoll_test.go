package sqs_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/ferrymq/ferry/consumer"
	ferrysqs "github.com/ferrymq/ferry/sqs"
)

// TestLongPollOutlivesPlainHTTPClientTimeout: a client configured with an
// ordinary *http.Client whose Timeout (5 s) is shorter than the long poll
// (20 s) does not cut the poll: receives get a per-request client whose
// timeout outlives it, and a message sent to an idle consumer is handled at
// once (found by review).
func TestLongPollOutlivesPlainHTTPClientTimeout(t *testing.T) {
	c := newClient(t, nil, func(o *awssqs.Options) {
		o.HTTPClient = &http.Client{Timeout: 5 * time.Second}
	})
	b := newBroker(t, c, ferrysqs.WithWaitTime(20*time.Second))
	name, url := createQueue(t, c, "rv-httptimeout", queueConfig{visibility: 60 * time.Second})
	l, err := b.NewConsumer(context.Background(), name, consumer.WithMaxInFlight(10))
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan time.Time, 1)
	r := start(t, l, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		select {
		case got <- time.Now():
		default:
		}
		return nil
	}))
	time.Sleep(6 * time.Second) // the first long poll has been cut at 5 s
	sent := time.Now()
	if err := b.Publish(context.Background(), name, consumer.Message{Body: []byte("m")}); err != nil {
		t.Fatal(err)
	}
	select {
	case at := <-got:
		t.Logf("handled %s after it was sent", at.Sub(sent))
	case <-time.After(8 * time.Second):
		visible, inflight, _ := depth(t, c, url)
		t.Errorf("a message sent to an idle consumer was not handled within 8 s (queue: %d visible, %d in flight): a long poll cut by the 5 s HTTP timeout took it", visible, inflight)
	}
	r.stop(t)
}
