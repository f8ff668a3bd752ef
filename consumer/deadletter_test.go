package consumer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// recordingPublisher keeps what it is asked to publish; down makes it fail.
// It stands for the dead-letter destination in unit tests; the scenario tests
// use the memory broker.
type recordingPublisher struct {
	mu   sync.Mutex
	down bool
	got  []Message
	dest []string
}

var errPublishDown = errors.New("dead-letter destination unreachable")

func (p *recordingPublisher) Publish(_ context.Context, dest string, msgs ...Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.down {
		return errPublishDown
	}
	p.got = append(p.got, msgs...)
	for range msgs {
		p.dest = append(p.dest, dest)
	}
	return nil
}

func mustDeadLetter(t *testing.T, pub Publisher, opts ...DeadLetterOption) *DeadLetter {
	t.Helper()
	opts = append([]DeadLetterOption{DeadLetterLogger(slog.New(slog.DiscardHandler))}, opts...)
	d, err := NewDeadLetter(pub, "orders-dlq", opts...)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// deliver hands m to h up to limit times, until h returns nil or a hold, as
// the delivery loop would redeliver it to one consumer: one record for all
// the deliveries, Attempt one past the runs made so far, Deliveries the
// delivery's number. It returns the number of deliveries and the last error.
func deliver(h Handler, m Message, limit int) (int, error) {
	var err error
	ctx, _ := withRecord(context.Background())
	m.Attempt = 0
	for delivery := 1; delivery <= limit; delivery++ {
		m.Attempt++
		m.Deliveries = delivery
		if err = h.Handle(ctx, &m); err == nil || errors.Is(err, ErrHeld) {
			return delivery, err
		}
	}
	return limit, err
}

func TestDeadLetterPermanentErrorAtOnceWithTheWholeStory(t *testing.T) {
	pub := &recordingPublisher{}
	d := mustDeadLetter(t, pub, DeadLetterConsumerName("billing"))
	published := time.Date(2026, 1, 2, 3, 4, 5, 6, time.UTC)
	m := Message{ID: "m-1", Key: "cust-7", Body: []byte(`{"x":`), Source: "orders", Lane: "3", Offset: 42,
		Headers: map[string]string{"trace": "abc"}, PublishedAt: published}
	runs := 0
	h := d.Wrap(HandlerFunc(func(context.Context, *Message) error {
		runs++
		var v any
		return Permanent(fmt.Errorf("decode: %w", json.Unmarshal([]byte(`{"x":`), &v)))
	}))
	before := time.Now()
	deliveries, err := deliver(h, m, 10)
	if err != nil || deliveries != 1 || runs != 1 {
		t.Fatalf("err = %v after %d deliveries, %d runs; want nil (acked) after 1", err, deliveries, runs)
	}
	if d.Count() != 1 || len(pub.got) != 1 || pub.dest[0] != "orders-dlq" {
		t.Fatalf("count = %d, published %d to %v", d.Count(), len(pub.got), pub.dest)
	}
	got := pub.got[0]
	if string(got.Body) != `{"x":` || got.Key != "cust-7" || got.ID != "m-1" {
		t.Errorf("dead letter = %+v, want body, key and id unchanged", got)
	}
	host := d.host
	want := map[string]string{
		"trace":              "abc",
		HeaderDLQSource:      "orders",
		HeaderDLQMessageID:   "m-1",
		HeaderDLQKey:         "cust-7",
		HeaderDLQLane:        "3",
		HeaderDLQOffset:      "42",
		HeaderDLQAttempts:    "1",
		HeaderDLQDeliveries:  "1",
		HeaderDLQReason:      DLQReasonPermanent,
		HeaderDLQErrorKind:   "permanent",
		HeaderDLQErrorType:   "*json.SyntaxError",
		HeaderDLQConsumer:    "billing",
		HeaderDLQHost:        host,
		HeaderDLQPublishedAt: published.Format(time.RFC3339Nano),
	}
	for k, v := range want {
		if got.Headers[k] != v {
			t.Errorf("header %s = %q, want %q", k, got.Headers[k], v)
		}
	}
	if !strings.Contains(got.Headers[HeaderDLQError], "decode: unexpected end of JSON input") {
		t.Errorf("error header = %q", got.Headers[HeaderDLQError])
	}
	for _, k := range []string{HeaderDLQFirstFailure, HeaderDLQLastFailure} {
		ts, err := time.Parse(time.RFC3339Nano, got.Headers[k])
		if err != nil || ts.Before(before.Add(-time.Second)) || ts.After(time.Now()) {
			t.Errorf("header %s = %q (%v), want a time of this test", k, got.Headers[k], err)
		}
	}
	if m.Headers[HeaderDLQSource] != "" {
		t.Error("the original message's headers were changed")
	}
}

func TestDeadLetterAfterMaxAttemptsWithoutRetry(t *testing.T) {
	pub := &recordingPublisher{}
	d := mustDeadLetter(t, pub, DeadLetterMaxAttempts(4))
	runs := 0
	h := d.Wrap(HandlerFunc(func(context.Context, *Message) error { runs++; return errDown }))
	published := time.Now().Add(-time.Minute)
	before := time.Now()
	deliveries, err := deliver(h, Message{ID: "m", Offset: -1, PublishedAt: published}, 10)
	if err != nil || deliveries != 4 || runs != 4 || d.Count() != 1 {
		t.Fatalf("err = %v, deliveries %d, runs %d, count %d; want nil, 4, 4, 1", err, deliveries, runs, d.Count())
	}
	hd := pub.got[0].Headers
	if hd[HeaderDLQAttempts] != "4" || hd[HeaderDLQReason] != DLQReasonMaxAttempts || hd[HeaderDLQErrorKind] != "error" {
		t.Errorf("headers = %v", hd)
	}
	if _, ok := hd[HeaderDLQOffset]; ok {
		t.Error("offset header set for a message without an offset")
	}
	first, err := time.Parse(time.RFC3339Nano, hd[HeaderDLQFirstFailure])
	if err != nil || first.Before(before) || !first.Before(time.Now()) || hd[HeaderDLQFirstFailure] == hd[HeaderDLQLastFailure] {
		t.Errorf("first failure = %s (last %s), want the first run's failure, after %s",
			hd[HeaderDLQFirstFailure], hd[HeaderDLQLastFailure], before)
	}
	if hd[HeaderDLQDeliveries] != "4" {
		t.Errorf("deliveries header = %s, want 4", hd[HeaderDLQDeliveries])
	}
	if _, ok := hd[HeaderDLQUnseenDeliveries]; ok {
		t.Error("unseen deliveries header set where every run was counted")
	}
}

// Where earlier deliveries went unseen (another process had them), the
// first failure can be no earlier than the publish, and the headers say how
// many deliveries were counted as one run each.
func TestDeadLetterSaysWhichDeliveriesWentUnseen(t *testing.T) {
	pub := &recordingPublisher{}
	d := mustDeadLetter(t, pub, DeadLetterMaxAttempts(4))
	published := time.Now().Add(-time.Minute)
	h := d.Wrap(HandlerFunc(func(context.Context, *Message) error { return errDown }))
	m := Message{ID: "m", Offset: -1, PublishedAt: published, Attempt: 4, Deliveries: 4, unseen: 3}
	if err := h.Handle(context.Background(), &m); err != nil || d.Count() != 1 {
		t.Fatalf("err = %v, count %d; want the fourth run dead-lettered", err, d.Count())
	}
	hd := pub.got[0].Headers
	if hd[HeaderDLQAttempts] != "4" || hd[HeaderDLQDeliveries] != "4" || hd[HeaderDLQUnseenDeliveries] != "3" {
		t.Errorf("attempts/deliveries/unseen = %s/%s/%s, want 4/4/3", hd[HeaderDLQAttempts], hd[HeaderDLQDeliveries], hd[HeaderDLQUnseenDeliveries])
	}
	if hd[HeaderDLQFirstFailure] != published.UTC().Format(time.RFC3339Nano) {
		t.Errorf("first failure = %s, want the publish time %s", hd[HeaderDLQFirstFailure], published.UTC().Format(time.RFC3339Nano))
	}
}

func TestDeadLetterPublishFailureAcksNothing(t *testing.T) {
	pub := &recordingPublisher{down: true}
	d := mustDeadLetter(t, pub)
	h := d.Wrap(HandlerFunc(func(context.Context, *Message) error { return Permanent(errDown) }))
	m := &Message{ID: "m", Attempt: 1}
	err := h.Handle(context.Background(), m)
	var dle *DeadLetterError
	if !errors.As(err, &dle) || !errors.Is(err, errPublishDown) || dle.Cause == nil {
		t.Fatalf("Handle = %v, want a DeadLetterError wrapping the publish error", err)
	}
	if IsPermanent(err) {
		t.Error("a failed dead-letter publish looks permanent; it must come back")
	}
	if d.Count() != 0 || d.PublishFailures() != 1 {
		t.Errorf("count = %d, failures = %d; want 0, 1", d.Count(), d.PublishFailures())
	}
	pub.down = false
	if err := h.Handle(context.Background(), m); err != nil || d.Count() != 1 {
		t.Errorf("after the destination came back: %v, count %d", err, d.Count())
	}
}

func TestDeadLetterNeverTakesHeldOrShutDownMessages(t *testing.T) {
	pub := &recordingPublisher{}
	d := mustDeadLetter(t, pub, DeadLetterMaxAttempts(1))
	held := d.Wrap(HandlerFunc(func(context.Context, *Message) error { return Hold(Permanent(errDown), time.Second) }))
	if err := held.Handle(context.Background(), &Message{Attempt: 9}); !errors.Is(err, ErrHeld) {
		t.Errorf("held: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	failed := d.Wrap(HandlerFunc(func(context.Context, *Message) error { return Permanent(errDown) }))
	if err := failed.Handle(ctx, &Message{Attempt: 9}); !IsPermanent(err) {
		t.Errorf("cancelled: %v", err)
	}
	if len(pub.got) != 0 {
		t.Errorf("dead-lettered %d messages, want none", len(pub.got))
	}
}

func TestDeadLetterUnderAnOuterTimeoutStillPublishes(t *testing.T) {
	pub := &recordingPublisher{}
	d := mustDeadLetter(t, pub, DeadLetterMaxAttempts(1))
	h := Chain(HandlerFunc(func(ctx context.Context, _ *Message) error {
		<-ctx.Done()
		return ctx.Err()
	}), Timeout(time.Millisecond), d.Wrap)
	if err := h.Handle(context.Background(), &Message{Attempt: 1}); err != nil {
		t.Fatalf("Handle = %v, want nil (dead-lettered)", err)
	}
	if d.Count() != 1 || pub.got[0].Headers[HeaderDLQErrorKind] != "timeout" {
		t.Errorf("count %d, headers %v", d.Count(), pub.got)
	}
}

// TestAttemptsAgreeWhicheverSideOfRetryDeadLetterIs is the guarantee that
// does not depend on composition order: the handler runs exactly MaxAttempts
// times before the message is dead-lettered, and a permanent error once.
func TestAttemptsAgreeWhicheverSideOfRetryDeadLetterIs(t *testing.T) {
	for _, c := range []struct{ max, perDelivery int }{{5, 3}, {3, 3}, {1, 3}, {7, 2}, {4, 1}, {2, 5}} {
		for _, order := range []string{"deadletter-outside", "deadletter-inside"} {
			for _, permanent := range []bool{false, true} {
				name := fmt.Sprintf("max%d/per%d/%s/permanent=%v", c.max, c.perDelivery, order, permanent)
				t.Run(name, func(t *testing.T) {
					pub := &recordingPublisher{}
					d := mustDeadLetter(t, pub, DeadLetterMaxAttempts(c.max))
					r := mustRetry(t, RetryAttempts(c.perDelivery))
					var slept []time.Duration
					noSleep(r, &slept)
					runs := 0
					base := HandlerFunc(func(context.Context, *Message) error {
						runs++
						if permanent {
							return Permanent(errDown)
						}
						return errDown
					})
					var h Handler
					if order == "deadletter-outside" {
						h = Chain(base, d.Wrap, r.Wrap)
					} else {
						h = Chain(base, r.Wrap, d.Wrap)
					}
					_, err := deliver(h, Message{ID: "m", Offset: -1}, 100)
					want := c.max
					if permanent {
						want = 1
					}
					if err != nil || runs != want || d.Count() != 1 {
						t.Fatalf("err %v, runs %d, dead-lettered %d; want nil, %d, 1", err, runs, d.Count(), want)
					}
					if got := pub.got[0].Headers[HeaderDLQAttempts]; got != strconv.Itoa(want) {
						t.Errorf("attempts header = %s, want %d", got, want)
					}
				})
			}
		}
	}
}

func TestNewDeadLetterRejectsBadConfigNamingTheField(t *testing.T) {
	for field, f := range map[string]func() error{
		"DeadLetter.Publisher":   func() error { _, err := NewDeadLetter(nil, "q"); return err },
		"DeadLetter.Destination": func() error { _, err := NewDeadLetter(&recordingPublisher{}, ""); return err },
		"DeadLetter.MaxAttempts": func() error {
			_, err := NewDeadLetter(&recordingPublisher{}, "q", DeadLetterMaxAttempts(0))
			return err
		},
		"DeadLetter.ConsumerName": func() error {
			_, err := NewDeadLetter(&recordingPublisher{}, "q", DeadLetterConsumerName(""))
			return err
		},
		"DeadLetter.Logger": func() error { _, err := NewDeadLetter(&recordingPublisher{}, "q", DeadLetterLogger(nil)); return err },
	} {
		var ce *ConfigError
		if err := f(); !errors.As(err, &ce) || ce.Field != field {
			t.Errorf("%s: err = %v, want a ConfigError naming it", field, err)
		}
	}
}

func TestErrorHeadersClassifyAndCut(t *testing.T) {
	if k := errorKind(&PanicError{Value: "x"}); k != "panic" {
		t.Errorf("panic kind = %s", k)
	}
	if k := errorKind(&TimeoutError{Timeout: time.Second}); k != "timeout" {
		t.Errorf("timeout kind = %s", k)
	}
	if ty := errorType(errors.Join(fmt.Errorf("a: %w", &PanicError{Value: 1}), errDown)); ty != "*consumer.PanicError" {
		t.Errorf("type = %s", ty)
	}
	long := strings.Repeat("é", maxErrorHeader)
	cut := truncateUTF8(long, maxErrorHeader+1)
	if len(cut) > maxErrorHeader+1 || !strings.HasPrefix(long, cut) || strings.ContainsRune(cut, '\uFFFD') {
		t.Errorf("cut to %d bytes, valid prefix: %v", len(cut), strings.HasPrefix(long, cut))
	}
}

// TestDeadLetterSendDeadLettersNowWithItsStory: Send publishes the message
// at once, whatever its attempts, with reason max-attempts for an
// ordinary error and permanent for a permanent one, and the first failure
// it is given; a failed publish is a
// *DeadLetterError, and Send without a cause is refused.
func TestDeadLetterSendDeadLettersNowWithItsStory(t *testing.T) {
	pub := &recordingPublisher{}
	d := mustDeadLetter(t, pub)
	m := Message{ID: "m-1", Key: "k", Body: []byte("b"), Source: "orders", Offset: 7, Attempt: 2}
	first := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	if err := d.Send(context.Background(), &m, errors.New("down"), first); err != nil {
		t.Fatal(err)
	}
	if err := d.Send(context.Background(), &m, Permanent(errors.New("bad")), time.Time{}); err != nil {
		t.Fatal(err)
	}
	if len(pub.got) != 2 || d.Count() != 2 {
		t.Fatalf("published %d, counted %d; want 2 and 2", len(pub.got), d.Count())
	}
	for i, want := range []map[string]string{
		{HeaderDLQReason: DLQReasonMaxAttempts, HeaderDLQAttempts: "2", HeaderDLQSource: "orders", HeaderDLQOffset: "7", HeaderDLQError: "down",
			HeaderDLQFirstFailure: first.Format(time.RFC3339Nano)},
		{HeaderDLQReason: DLQReasonPermanent, HeaderDLQErrorKind: "permanent"},
	} {
		for k, v := range want {
			if got := pub.got[i].Headers[k]; got != v {
				t.Errorf("dead letter %d: %s = %q, want %q", i+1, k, got, v)
			}
		}
	}
	pub.down = true
	var dle *DeadLetterError
	if err := d.Send(context.Background(), &m, errors.New("down"), time.Time{}); !errors.As(err, &dle) {
		t.Errorf("Send with the destination down: %v, want a *DeadLetterError", err)
	}
	if err := d.Send(context.Background(), &m, nil, time.Time{}); !errors.Is(err, ErrInvalidConfig) {
		t.Errorf("Send without a cause: %v, want a configuration error", err)
	}
}
