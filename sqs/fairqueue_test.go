package sqs_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/ferrymq/ferry/consumer"
	ferrysqs "github.com/ferrymq/ferry/sqs"
)

// With WithFairQueues, a message published to a standard queue carries its
// Key as its message group id (a Key that is no valid group id as its
// hash), a message without a Key carries none, and a consumer reads every
// Key back exactly; without the option no message of a standard queue has
// a group. What SQS does with the groups (serving a quiet tenant before a
// noisy one) is SQS's: ElasticMQ keeps the id and does not reorder.
func TestFairQueuesSendTheKeyAsTheMessageGroup(t *testing.T) {
	c := newClient(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	longKey := "tenant/" + strings.Repeat("x", 200) // over 128 characters
	msgs := []consumer.Message{
		{ID: "m-1", Key: "tenant-a", Body: []byte("a")},
		{ID: "m-2", Key: longKey, Body: []byte("b")},
		{ID: "m-3", Body: []byte("c")},
	}
	for _, fair := range []bool{true, false} {
		name, url := createQueue(t, c, "fair", queueConfig{})
		b := newBroker(t, c, ferrysqs.WithFairQueues(fair))
		if err := b.Publish(ctx, name, msgs...); err != nil {
			t.Fatal(err)
		}
		groups := map[string]string{} // body -> group id
		for _, m := range receiveAll(t, c, url, len(msgs)) {
			groups[aws.ToString(m.Body)] = m.Attributes[string(types.MessageSystemAttributeNameMessageGroupId)]
			if _, err := c.ChangeMessageVisibility(ctx, &awssqs.ChangeMessageVisibilityInput{VisibilityTimeout: 0, QueueUrl: aws.String(url), ReceiptHandle: m.ReceiptHandle}); err != nil {
				t.Fatal(err)
			}
		}
		switch {
		case fair && (groups["a"] != "tenant-a" || groups["b"] == "" || len(groups["b"]) > 128 || groups["c"] != ""):
			t.Fatalf("fair queues: the message groups by body are %q; want a's Key, b's Key hashed to a valid id, none for c", groups)
		case !fair && (groups["a"] != "" || groups["b"] != "" || groups["c"] != ""):
			t.Fatalf("without fair queues, messages of a standard queue have groups %q; want none", groups)
		}
		keys := map[string]string{}
		for _, m := range consumeN(t, b, name, len(msgs)) {
			keys[string(m.Body)] = m.Key
		}
		if keys["a"] != "tenant-a" || keys["b"] != longKey || keys["c"] != "" {
			t.Fatalf("fair=%v: the consumer read the keys %q, want each message's own", fair, keys)
		}
	}
}
