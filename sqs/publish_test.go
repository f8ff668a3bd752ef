package sqs_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/aws/smithy-go/middleware"

	"github.com/ferrymq/ferry/consumer"
	ferrysqs "github.com/ferrymq/ferry/sqs"
)

// receiveAll receives n messages from url with the raw client, deleting
// none, within 30 s.
func receiveAll(t *testing.T, c *awssqs.Client, url string, n int) []types.Message {
	t.Helper()
	var got []types.Message
	deadline := time.Now().Add(30 * time.Second)
	for len(got) < n && time.Now().Before(deadline) {
		out, err := c.ReceiveMessage(context.Background(), &awssqs.ReceiveMessageInput{
			QueueUrl: aws.String(url), MaxNumberOfMessages: 10, WaitTimeSeconds: 1, VisibilityTimeout: 60,
			MessageAttributeNames:       []string{"All"},
			MessageSystemAttributeNames: []types.MessageSystemAttributeName{types.MessageSystemAttributeNameAll},
		})
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, out.Messages...)
	}
	if len(got) < n {
		t.Fatalf("received %d messages, want %d", len(got), n)
	}
	return got
}

// consumeN runs a consumer of queue until it handled n messages and
// returns them, in the order handled.
func consumeN(t *testing.T, b *ferrysqs.Broker, queue string, n int, opts ...consumer.Option) []consumer.Message {
	t.Helper()
	l, err := b.NewConsumer(context.Background(), queue, opts...)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan consumer.Message, n)
	r := start(t, l, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		c := *m
		c.Body = bytes.Clone(m.Body)
		got <- c
		return nil
	}))
	var out []consumer.Message
	timeout := time.After(30 * time.Second)
	for len(out) < n {
		select {
		case m := <-got:
			out = append(out, m)
		case <-timeout:
			t.Fatalf("handled %d messages, want %d", len(out), n)
		}
	}
	r.stop(t)
	return out
}

// TestPublishBatchesTenAtATime: 25 messages go out in three
// SendMessageBatch calls, all taken.
func TestPublishBatchesTenAtATime(t *testing.T) {
	var cs calls
	c := newClient(t, &cs)
	b := newBroker(t, c)
	name, _ := createQueue(t, c, "batch", queueConfig{})
	msgs := make([]consumer.Message, 25)
	for i := range msgs {
		msgs[i].Body = []byte(fmt.Sprint("m", i))
	}
	if err := b.Publish(context.Background(), name, msgs...); err != nil {
		t.Fatal(err)
	}
	if n := cs.get("SendMessageBatch"); n != 3 {
		t.Errorf("SendMessageBatch calls = %d, want 3 for 25 messages", n)
	}
	if got := consumeN(t, b, name, 25); len(got) != 25 {
		t.Errorf("consumed %d", len(got))
	}
}

// TestPublishRefusesBeforeAnyCall: a message over the queue's size limit
// and a FIFO message without a key are refused by Publish itself, with
// errors that say why, and no SendMessageBatch is made for them; the
// other messages of the call are published.
func TestPublishRefusesBeforeAnyCall(t *testing.T) {
	var cs calls
	c := newClient(t, &cs)
	b := newBroker(t, c)
	std, _ := createQueue(t, c, "size", queueConfig{})
	fifo, _ := createQueue(t, c, "nokey", queueConfig{fifo: true})
	ctx := context.Background()

	big := consumer.Message{Body: bytes.Repeat([]byte("x"), ferrysqs.DefaultMaxMessageSize+1)}
	err := b.Publish(ctx, std, big)
	var pe *consumer.PublishError
	if !errors.As(err, &pe) || len(pe.Failed) != 1 || !errors.Is(err, ferrysqs.ErrMessageTooLarge) {
		t.Fatalf("Publish of %d bytes = %v, want a *consumer.PublishError wrapping ErrMessageTooLarge", len(big.Body), err)
	}
	if !strings.Contains(err.Error(), std) {
		t.Errorf("error %q does not name the queue", err)
	}
	noKey := consumer.Message{Body: []byte("no key")}
	err = b.Publish(ctx, fifo, noKey)
	if !errors.As(err, &pe) || len(pe.Failed) != 1 || !errors.Is(err, ferrysqs.ErrInvalidMessage) {
		t.Fatalf("Publish without a key to a FIFO queue = %v, want a *consumer.PublishError wrapping ErrInvalidMessage", err)
	}
	if n := cs.get("SendMessageBatch"); n != 0 {
		t.Fatalf("SendMessageBatch calls = %d, want 0: refused messages must not reach SQS", n)
	}

	// A binary body that fits raw but not base64-encoded is refused too.
	bin := consumer.Message{Body: bytes.Repeat([]byte{0}, ferrysqs.DefaultMaxMessageSize*4/5)}
	if err := b.Publish(ctx, std, bin); !errors.Is(err, ferrysqs.ErrMessageTooLarge) {
		t.Errorf("Publish of a %d-byte binary body = %v, want ErrMessageTooLarge", len(bin.Body), err)
	}

	// With good messages beside them, the good ones go.
	err = b.Publish(ctx, fifo, consumer.Message{Key: "k", Body: []byte("ok-1")}, noKey, consumer.Message{Key: "k2", Body: []byte("ok-2")})
	if !errors.As(err, &pe) || len(pe.Failed) != 1 || pe.Failed[0].Index != 1 {
		t.Fatalf("Publish = %v, want message 1 alone failed", err)
	}
	got := consumeN(t, b, fifo, 2)
	bodies := map[string]bool{string(got[0].Body): true, string(got[1].Body): true}
	if !bodies["ok-1"] || !bodies["ok-2"] {
		t.Errorf("consumed %q and %q, want ok-1 and ok-2", got[0].Body, got[1].Body)
	}
}

// TestPublishRefusesADelaySQSCannotKeep: a NotBefore further than
// MaxDelay is refused with consumer.ErrDelayTooLong, before any call, and
// the message beside it is published; a NotBefore within it is kept, to
// the whole second above it (never early).
func TestPublishRefusesADelaySQSCannotKeep(t *testing.T) {
	c := newClient(t, nil)
	b := newBroker(t, c)
	std, _ := createQueue(t, c, "delay", queueConfig{})
	ctx := context.Background()
	far := consumer.Message{Body: []byte("far"), NotBefore: time.Now().Add(ferrysqs.MaxDelay + time.Minute)}
	err := b.Publish(ctx, std, consumer.Message{Body: []byte("now")}, far)
	var pe *consumer.PublishError
	if !errors.As(err, &pe) || len(pe.Failed) != 1 || pe.Failed[0].Index != 1 || !errors.Is(pe.Failed[0].Err, consumer.ErrDelayTooLong) {
		t.Fatalf("Publish with a NotBefore past %s = %v, want message 1 alone failed with ErrDelayTooLong", ferrysqs.MaxDelay, err)
	}
	if got := consumeN(t, b, std, 1); string(got[0].Body) != "now" {
		t.Fatalf("consumed %q, want the message without a delay", got[0].Body)
	}
	notBefore := time.Now().Add(1500 * time.Millisecond)
	if err := b.Publish(ctx, std, consumer.Message{Body: []byte("soon"), NotBefore: notBefore}); err != nil {
		t.Fatal(err)
	}
	got := consumeN(t, b, std, 1)
	if at := time.Now(); string(got[0].Body) != "soon" || at.Before(notBefore) {
		t.Errorf("consumed %q at %s, want %q not before %s", got[0].Body, at.Format(time.StampMilli), "soon", notBefore.Format(time.StampMilli))
	}
}

// TestPublishCarriesAnyNumberOfHeaders: a message with more headers than
// SQS has attributes, some with names or values SQS refuses, arrives with
// all of them; on the wire it has at most ten attributes.
func TestPublishCarriesAnyNumberOfHeaders(t *testing.T) {
	c := newClient(t, nil)
	b := newBroker(t, c)
	name, url := createQueue(t, c, "headers", queueConfig{})
	h := map[string]string{
		"with space":      "v",
		"AWS.reserved":    "v",
		"ünïcode-name":    "v",
		"control-value":   "a\x00b",
		"empty-value":     "",
		"ferry":           "same name as the meta attribute",
		"trace-id":        "abc",
		".leading-period": "v",
	}
	for i := range 20 {
		h[fmt.Sprintf("h%02d", i)] = fmt.Sprint("value ", i)
	}
	for _, k := range []string{consumer.HeaderDLQSource, consumer.HeaderDLQAttempts, consumer.HeaderDLQError, consumer.HeaderDLQReason} {
		h[k] = "dlq " + k
	}
	if err := b.Publish(context.Background(), name, consumer.Message{Body: []byte("body"), Headers: h}); err != nil {
		t.Fatal(err)
	}
	raw := receiveAll(t, c, url, 1)[0]
	if n := len(raw.MessageAttributes); n > ferrysqs.MaxAttributes {
		t.Errorf("the message carries %d attributes, SQS allows %d", n, ferrysqs.MaxAttributes)
	}
	for k := range raw.MessageAttributes {
		if strings.HasPrefix(k, "ferry-") {
			t.Errorf("header %s is a native attribute while user headers are packed (attributes %v); user headers go first", k, keys(raw.MessageAttributes))
		}
	}
	// Back to the queue, and through a consumer.
	if _, err := c.ChangeMessageVisibility(context.Background(), &awssqs.ChangeMessageVisibilityInput{QueueUrl: aws.String(url), ReceiptHandle: raw.ReceiptHandle}); err != nil {
		t.Fatal(err)
	}
	got := consumeN(t, b, name, 1)[0]
	if len(got.Headers) != len(h) {
		t.Errorf("got %d headers, want %d", len(got.Headers), len(h))
	}
	for k, v := range h {
		if g, ok := got.Headers[k]; !ok || g != v {
			t.Errorf("header %q = %q (present %v), want %q", k, g, ok, v)
		}
	}
}

func keys[V any](m map[string]V) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// TestPublishReportsExactlyTheFailedEntries: when SQS refuses one entry of
// a SendMessageBatch (answered with HTTP 200 and a Failed list), Publish
// reports that message alone, by index, with SQS's code; a later message of
// the same key is not sent; the others are published.
func TestPublishReportsExactlyTheFailedEntries(t *testing.T) {
	var cs calls
	c := newClient(t, &cs)
	b := newBroker(t, c)
	name, _ := createQueue(t, c, "partial", queueConfig{})
	// Spoil one entry on its way out, as a message SQS refuses would be:
	// a character SQS does not take in a body.
	cs.setHook(func(op string, in any) {
		if op != "SendMessageBatch" {
			return
		}
		for i, e := range in.(*awssqs.SendMessageBatchInput).Entries {
			if aws.ToString(e.MessageBody) == "spoil" {
				in.(*awssqs.SendMessageBatchInput).Entries[i].MessageBody = aws.String("spoil\x01")
			}
		}
	})
	msgs := []consumer.Message{
		{Key: "a", Body: []byte("a-1")},
		{Key: "b", Body: []byte("spoil")},
		{Key: "c", Body: []byte("c-1")},
	}
	// The later message of key b goes in a second batch, after the first.
	for i := range 8 {
		msgs = append(msgs, consumer.Message{Key: fmt.Sprint("f", i), Body: []byte("filler")})
	}
	msgs = append(msgs, consumer.Message{Key: "b", Body: []byte("b-2")})
	err := b.Publish(context.Background(), name, msgs...)
	var pe *consumer.PublishError
	if !errors.As(err, &pe) {
		t.Fatalf("Publish = %v, want a *consumer.PublishError", err)
	}
	if len(pe.Failed) != 2 || pe.Failed[0].Index != 1 || pe.Failed[1].Index != len(msgs)-1 {
		t.Fatalf("failed = %+v, want messages 1 (refused) and %d (its key's later message)", pe.Failed, len(msgs)-1)
	}
	var ee *ferrysqs.EntryError
	if !errors.As(pe.Failed[0].Err, &ee) || ee.Code == "" {
		t.Errorf("message 1 failed with %v, want an *EntryError with SQS's code", pe.Failed[0].Err)
	} else {
		t.Logf("SQS refused the entry: %v", ee)
	}
	if !errors.Is(pe.Failed[1].Err, ferrysqs.ErrNotSent) {
		t.Errorf("message %d failed with %v, want ErrNotSent", len(msgs)-1, pe.Failed[1].Err)
	}
	cs.setHook(nil)
	got := consumeN(t, b, name, len(msgs)-2)
	for _, m := range got {
		if s := string(m.Body); s == "spoil" || s == "b-2" {
			t.Errorf("%s was published", s)
		}
	}
}

// TestPublishLaterMessageOfFailedKeyInSameBatchIsNotSent: when SQS refuses
// one entry of a SendMessageBatch, a later message of the same key in the
// same Publish call is not sent (ErrNotSent) and does not reach the queue,
// so it cannot overtake the failed one (found by review).
func TestPublishLaterMessageOfFailedKeyInSameBatchIsNotSent(t *testing.T) {
	var cs calls
	c := newClient(t, &cs)
	b := newBroker(t, c)
	name, url := createQueue(t, c, "rv-samebatch", queueConfig{fifo: true, visibility: 30 * time.Second})
	// Spoil one entry on its way out, as a message SQS refuses would be.
	cs.setHook(func(op string, in any) {
		if op != "SendMessageBatch" {
			return
		}
		for i, e := range in.(*awssqs.SendMessageBatchInput).Entries {
			if aws.ToString(e.MessageBody) == "g-1" {
				in.(*awssqs.SendMessageBatchInput).Entries[i].MessageBody = aws.String("g-1\x01")
			}
		}
	})
	msgs := []consumer.Message{
		{Key: "g", Body: []byte("g-1")},
		{Key: "g", Body: []byte("g-2")},
	}
	err := b.Publish(context.Background(), name, msgs...)
	cs.setHook(nil)
	var pe *consumer.PublishError
	if !errors.As(err, &pe) {
		t.Fatalf("Publish = %v, want a *consumer.PublishError", err)
	}
	failed := map[int]error{}
	for _, f := range pe.Failed {
		failed[f.Index] = f.Err
	}
	if _, ok := failed[0]; !ok {
		t.Fatalf("failed = %+v, want message 0 (refused by SQS) among them", pe.Failed)
	}
	if e, ok := failed[1]; !ok || !errors.Is(e, ferrysqs.ErrNotSent) {
		t.Errorf("message 1 (g-2, a later message of the failed key g) reported as %v (present %v), want ErrNotSent", e, ok)
	}
	out, rerr := c.ReceiveMessage(context.Background(), &awssqs.ReceiveMessageInput{
		QueueUrl: aws.String(url), MaxNumberOfMessages: 10, WaitTimeSeconds: 1,
	})
	if rerr != nil {
		t.Fatal(rerr)
	}
	for _, m := range out.Messages {
		t.Errorf("the queue holds %q: a later message of key g overtook the failed g-1", aws.ToString(m.Body))
	}
}

// An entry that SQS's answer names neither successful nor failed is not
// taken for sent: Publish fails it (the caller publishes it again), and
// only it. (The answer is the real server's, with one success cut out on
// its way back.)
func TestPublishFailsAnEntryTheAnswerDoesNotName(t *testing.T) {
	cut := func(stack *middleware.Stack) error {
		return stack.Initialize.Add(middleware.InitializeMiddlewareFunc("ferry-test-cut-success",
			func(ctx context.Context, in middleware.InitializeInput, next middleware.InitializeHandler) (middleware.InitializeOutput, middleware.Metadata, error) {
				out, md, err := next.HandleInitialize(ctx, in)
				if r, ok := out.Result.(*awssqs.SendMessageBatchOutput); ok && err == nil && len(r.Successful) > 1 {
					r.Successful = r.Successful[1:]
				}
				return out, md, err
			}), middleware.After)
	}
	c := newClient(t, nil, func(o *awssqs.Options) { o.APIOptions = append(o.APIOptions, cut) })
	b := newBroker(t, c)
	name, _ := createQueue(t, c, "unnamed", queueConfig{})
	err := b.Publish(context.Background(), name,
		consumer.Message{Body: []byte("a")}, consumer.Message{Body: []byte("b")}, consumer.Message{Body: []byte("c")})
	var pe *consumer.PublishError
	if !errors.As(err, &pe) || len(pe.Failed) != 1 || !strings.Contains(err.Error(), "neither successful nor failed") {
		t.Fatalf("Publish with an entry the answer does not name = %v; want that entry alone failed, saying so", err)
	}
}
