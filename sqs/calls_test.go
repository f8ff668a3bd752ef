package sqs_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
)

// publishMany publishes n small messages to queue through a broker of its
// own (its calls are not counted), several Publish calls at once.
func publishMany(t testing.TB, queue string, n int) {
	t.Helper()
	b := newBroker(t, newClient(t, nil))
	const per = 500
	errs := make(chan error, n/per+1)
	sem := make(chan struct{}, 4)
	for i := 0; i < n; i += per {
		sem <- struct{}{}
		go func() {
			defer func() { <-sem }()
			msgs := make([]consumer.Message, min(per, n-i))
			for j := range msgs {
				msgs[j] = consumer.Message{Body: []byte(fmt.Sprint("message ", i+j)), Headers: map[string]string{"seq": fmt.Sprint(i + j)}}
			}
			errs <- b.Publish(context.Background(), queue, msgs...)
		}()
	}
	for i := 0; i < n; i += per {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
}

// TestAPICallsPerMessageAtSteadyState: consuming 10,000 messages with
// handlers that succeed costs at most 0.25 API calls per message
// (receives, deletes, visibility changes and sends, counted by an SDK
// middleware on the consumer's client), against about 2 for an adapter
// that receives one message and deletes one per call.
func TestAPICallsPerMessageAtSteadyState(t *testing.T) {
	const n = 10_000
	var cs calls
	c := newClient(t, &cs)
	b := newBroker(t, c)
	name, _ := createQueue(t, c, "calls", queueConfig{visibility: 30 * time.Second})
	publishMany(t, name, n)

	l, err := b.NewConsumer(context.Background(), name, consumer.WithConcurrency(16))
	if err != nil {
		t.Fatal(err)
	}
	before := cs.snapshot()
	var handled atomic.Int64
	begin := time.Now()
	r := start(t, l, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		handled.Add(1)
		return nil
	}))
	testenv.WaitFor(t, 120*time.Second, "every message handled", func() bool { return handled.Load() >= n })
	took := time.Since(begin)
	testenv.WaitFor(t, 10*time.Second, "every ack to be sent", func() bool { return l.Stats().InFlight == 0 })
	after := cs.snapshot()
	r.stop(t)
	if s := l.Stats(); s.Failed != 0 || s.Returned != 0 || s.SettleErrors != 0 || s.Acked != n {
		t.Errorf("stats %+v, want %d acked and no failures", s, n)
	}
	total := 0
	per := map[string]float64{}
	for op, k := range after {
		k -= before[op]
		switch op {
		case "ReceiveMessage", "DeleteMessageBatch", "ChangeMessageVisibilityBatch", "SendMessageBatch",
			"DeleteMessage", "ChangeMessageVisibility", "SendMessage":
			total += k
			per[op] = float64(k) / n
		}
	}
	ratio := float64(total) / n
	t.Logf("%d messages in %s (%.0f/s): %d calls, %.3f per message %v", n, took.Round(time.Millisecond), n/took.Seconds(), total, ratio, per)
	if ratio > 0.25 {
		t.Errorf("%.3f API calls per message, want at most 0.25 (%v)", ratio, per)
	}
}
