package sqs_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
)

// CreateSource makes a FIFO queue with its retention and a redrive policy
// to a dead-letter queue it creates; the queue takes and gives a message;
// making it again is not an error; DeleteSource removes it, and deleting a
// queue that is gone is not an error.
func TestAdminCreatesAndDeletesQueues(t *testing.T) {
	cs := &calls{}
	c := newClient(t, cs)
	b := newBroker(t, c)
	// ElasticMQ does not report MessageRetentionPeriod: what was asked of
	// it is read from the call.
	var retention sync.Map
	cs.setHook(func(op string, in any) {
		if ci, ok := in.(*awssqs.CreateQueueInput); ok {
			retention.Store(aws.ToString(ci.QueueName), ci.Attributes["MessageRetentionPeriod"])
		}
	})
	var adm consumer.Admin = b
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	name := testenv.UniqueName(t, "admin") + ".fifo"
	dlq := testenv.UniqueName(t, "admin-dlq") + ".fifo"
	t.Cleanup(func() {
		_ = b.DeleteSource(context.Background(), name)
		_ = b.DeleteSource(context.Background(), dlq)
	})
	// A lease of 90.5 s is asked of SQS as 91 s: rounded up, never shorter.
	cfg := consumer.SourceConfig{FIFO: true, DeadLetter: dlq, MaxDeliveries: 2, Retention: 2 * time.Hour, Lease: 90*time.Second + 500*time.Millisecond}
	if err := adm.CreateSource(ctx, name, cfg); err != nil {
		t.Fatal(err)
	}
	if err := adm.CreateSource(ctx, name, cfg); err != nil {
		t.Fatalf("creating the queue again: %v", err)
	}
	url := queueURL(t, c, name)
	attrs, err := c.GetQueueAttributes(ctx, &awssqs.GetQueueAttributesInput{
		QueueUrl: aws.String(url), AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameAll},
	})
	if err != nil {
		t.Fatal(err)
	}
	a := attrs.Attributes
	if a["FifoQueue"] != "true" {
		t.Fatalf("FifoQueue = %q, want true", a["FifoQueue"])
	}
	if a["VisibilityTimeout"] != "91" {
		t.Fatalf("VisibilityTimeout = %q, want 91 (SourceConfig.Lease)", a["VisibilityTimeout"])
	}
	if r, _ := retention.Load(name); r != "7200" {
		t.Fatalf("CreateQueue asked for MessageRetentionPeriod %q, want 7200", r)
	}
	arn := queueARN(t, c, queueURL(t, c, dlq))
	if rp := a["RedrivePolicy"]; !strings.Contains(rp, arn) || !strings.Contains(strings.ReplaceAll(rp, `"`, ""), "maxReceiveCount:2") {
		t.Fatalf("RedrivePolicy = %q, want one to %s after 2 receives", rp, arn)
	}

	if err := b.Publish(ctx, name, consumer.Message{ID: "m-1", Key: "k", Body: []byte("one")}); err != nil {
		t.Fatal(err)
	}
	d, err := b.Driver(ctx, name, driver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	got, err := d.Fetch(ctx, nil, 10)
	if err != nil || len(got) != 1 || string(got[0].Body) != "one" {
		t.Fatalf("Fetch = %v, %v; want the message published", got, err)
	}
	if l := d.(driver.Extender).Lease(); l != 91*time.Second {
		t.Fatalf("the driver's Lease() = %v, want 91s", l)
	}
	if err := d.Settle(ctx, []driver.Settlement{{Handle: got[0].Handle, Action: driver.Ack}}); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}

	if err := adm.DeleteSource(ctx, name); err != nil {
		t.Fatal(err)
	}
	if _, err := c.GetQueueUrl(ctx, &awssqs.GetQueueUrlInput{QueueName: aws.String(name)}); err == nil {
		t.Fatalf("queue %q is still there", name)
	}
	if err := adm.DeleteSource(ctx, name); err != nil {
		t.Fatalf("deleting a queue that is gone: %v", err)
	}
}

// An SQS FIFO queue's name ends in ".fifo": asking for FIFO with another
// name, or for a dead-letter queue of the other kind, is refused before
// any call, as are a delivery limit with no dead-letter queue and a
// retention or lease SQS does not take.
func TestAdminRefusesFIFONameWithoutSuffix(t *testing.T) {
	cs := &calls{}
	c := newClient(t, cs)
	b := newBroker(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	name := testenv.UniqueName(t, "admin-nofifo")
	for _, tc := range []struct {
		name string
		cfg  consumer.SourceConfig
	}{
		{name, consumer.SourceConfig{FIFO: true}},
		{name + ".fifo", consumer.SourceConfig{DeadLetter: name + "-dlq"}},
		{name, consumer.SourceConfig{MaxDeliveries: 3}},
		{name, consumer.SourceConfig{Retention: time.Second}},
		{name, consumer.SourceConfig{Lease: -time.Second}},
		{name, consumer.SourceConfig{Lease: 13 * time.Hour}},
	} {
		err := b.CreateSource(ctx, tc.name, tc.cfg)
		var ce *consumer.ConfigError
		if !errors.As(err, &ce) {
			t.Fatalf("CreateSource(%q, %+v) = %v, want a *consumer.ConfigError", tc.name, tc.cfg, err)
		}
	}
	if n := len(cs.snapshot()); n != 0 {
		t.Fatalf("refused CreateSource calls made calls to SQS: %v", cs.snapshot())
	}
}

// queueURL returns the URL of queue name.
func queueURL(t testing.TB, c *awssqs.Client, name string) string {
	t.Helper()
	out, err := c.GetQueueUrl(context.Background(), &awssqs.GetQueueUrlInput{QueueName: aws.String(name)})
	if err != nil {
		t.Fatal(err)
	}
	return aws.ToString(out.QueueUrl)
}
