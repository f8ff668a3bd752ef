package integration_test

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/ferrymq/ferry/internal/testenv"
)

func sqsClient(t *testing.T) *sqs.Client {
	t.Helper()
	endpoint := testenv.RequireSQS(t)
	return sqs.New(sqs.Options{
		Region:       testenv.SQSRegion(),
		BaseEndpoint: aws.String(endpoint),
		Credentials:  credentials.NewStaticCredentialsProvider(testenv.SQSAccessKey, testenv.SQSSecretKey, ""),
	})
}

// createQueue creates a queue with attrs and deletes it when the test ends.
func createQueue(t *testing.T, ctx context.Context, c *sqs.Client, name string, attrs map[string]string) (url, arn string) {
	t.Helper()
	out, err := c.CreateQueue(ctx, &sqs.CreateQueueInput{QueueName: aws.String(name), Attributes: attrs})
	if err != nil {
		t.Fatalf("create queue %s: %v", name, err)
	}
	url = aws.ToString(out.QueueUrl)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		c.DeleteQueue(ctx, &sqs.DeleteQueueInput{QueueUrl: aws.String(url)})
	})
	a, err := c.GetQueueAttributes(ctx, &sqs.GetQueueAttributesInput{
		QueueUrl: aws.String(url), AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameQueueArn},
	})
	if err != nil {
		t.Fatalf("queue attributes of %s: %v", name, err)
	}
	return url, a.Attributes[string(types.QueueAttributeNameQueueArn)]
}

func receive(t *testing.T, ctx context.Context, c *sqs.Client, url string, max, wait int32) []types.Message {
	t.Helper()
	out, err := c.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{
		QueueUrl:                    aws.String(url),
		MaxNumberOfMessages:         max,
		WaitTimeSeconds:             wait,
		MessageSystemAttributeNames: []types.MessageSystemAttributeName{types.MessageSystemAttributeNameAll},
	})
	if err != nil {
		t.Fatalf("receive from %s: %v", url, err)
	}
	return out.Messages
}

func receiveCount(t *testing.T, m types.Message) int {
	t.Helper()
	n, err := strconv.Atoi(m.Attributes[string(types.MessageSystemAttributeNameApproximateReceiveCount)])
	if err != nil {
		t.Fatalf("ApproximateReceiveCount of %s: %v (attributes %v)", aws.ToString(m.MessageId), err, m.Attributes)
	}
	return n
}

// TestSQSRoundTrip sends, receives and deletes one message.
func TestSQSRoundTrip(t *testing.T) {
	t.Parallel()
	c := sqsClient(t)
	ctx := testenv.Context(t, 30*time.Second)
	url, _ := createQueue(t, ctx, c, testenv.UniqueName(t, ""), nil)
	if _, err := c.SendMessage(ctx, &sqs.SendMessageInput{QueueUrl: aws.String(url), MessageBody: aws.String("hello"),
		MessageAttributes: map[string]types.MessageAttributeValue{"event-id": {DataType: aws.String("String"), StringValue: aws.String("e1")}},
	}); err != nil {
		t.Fatalf("send: %v", err)
	}
	out, err := c.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{QueueUrl: aws.String(url), WaitTimeSeconds: 5,
		MessageAttributeNames: []string{"All"}})
	if err != nil || len(out.Messages) != 1 {
		t.Fatalf("receive: %v, %d messages", err, len(out.Messages))
	}
	m := out.Messages[0]
	if aws.ToString(m.Body) != "hello" || aws.ToString(m.MessageAttributes["event-id"].StringValue) != "e1" {
		t.Fatalf("got body %q attributes %v", aws.ToString(m.Body), m.MessageAttributes)
	}
	if _, err := c.DeleteMessage(ctx, &sqs.DeleteMessageInput{QueueUrl: aws.String(url), ReceiptHandle: m.ReceiptHandle}); err != nil {
		t.Fatalf("delete: %v", err)
	}
}

// TestSQSReceiveCountVisibilityAndRedrive checks that a message received and
// not deleted stays hidden for its visibility timeout, comes back with
// ApproximateReceiveCount one higher, and after maxReceiveCount receives is
// moved to the dead-letter queue of the redrive policy.
func TestSQSReceiveCountVisibilityAndRedrive(t *testing.T) {
	t.Parallel()
	c := sqsClient(t)
	ctx := testenv.Context(t, 60*time.Second)
	name := testenv.UniqueName(t, "")
	_, dlqARN := createQueue(t, ctx, c, name+"-dlq", nil)
	url, _ := createQueue(t, ctx, c, name, map[string]string{
		"VisibilityTimeout": "1",
		"RedrivePolicy":     fmt.Sprintf(`{"deadLetterTargetArn":%q,"maxReceiveCount":"2"}`, dlqARN),
	})
	dlqURL, err := c.GetQueueUrl(ctx, &sqs.GetQueueUrlInput{QueueName: aws.String(name + "-dlq")})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.SendMessage(ctx, &sqs.SendMessageInput{QueueUrl: aws.String(url), MessageBody: aws.String("poison")}); err != nil {
		t.Fatal(err)
	}

	first := receive(t, ctx, c, url, 1, 5)
	if len(first) != 1 || receiveCount(t, first[0]) != 1 {
		t.Fatalf("first receive: %d messages, want 1 with ApproximateReceiveCount 1", len(first))
	}
	received := time.Now()
	if hidden := receive(t, ctx, c, url, 1, 0); len(hidden) != 0 {
		t.Fatalf("the message is visible again at once, within its visibility timeout")
	}
	second := receive(t, ctx, c, url, 1, 5) // long poll until it is visible again
	if len(second) != 1 {
		t.Fatal("the message did not come back after its visibility timeout")
	}
	if d := time.Since(received); d < 900*time.Millisecond {
		t.Errorf("the message came back after %v, before its 1s visibility timeout", d)
	}
	if n := receiveCount(t, second[0]); n != 2 {
		t.Fatalf("second receive: ApproximateReceiveCount %d, want 2", n)
	}
	if aws.ToString(second[0].MessageId) != aws.ToString(first[0].MessageId) {
		t.Fatal("the second receive returned another message")
	}

	// Past maxReceiveCount the next receive moves it to the dead-letter queue.
	if again := receive(t, ctx, c, url, 1, 3); len(again) != 0 {
		t.Fatalf("received the message a third time (count %d), past maxReceiveCount 2", receiveCount(t, again[0]))
	}
	dead := receive(t, ctx, c, aws.ToString(dlqURL.QueueUrl), 1, 5)
	if len(dead) != 1 || aws.ToString(dead[0].Body) != "poison" || aws.ToString(dead[0].MessageId) != aws.ToString(first[0].MessageId) {
		t.Fatalf("dead-letter queue holds %d messages, want the poison one", len(dead))
	}
}

// TestSQSLongPolling checks that an empty receive waits for WaitTimeSeconds
// and that a message sent during a long poll ends it early.
func TestSQSLongPolling(t *testing.T) {
	t.Parallel()
	c := sqsClient(t)
	ctx := testenv.Context(t, 30*time.Second)
	url, _ := createQueue(t, ctx, c, testenv.UniqueName(t, ""), nil)

	start := time.Now()
	if got := receive(t, ctx, c, url, 1, 1); len(got) != 0 {
		t.Fatal("an empty queue returned a message")
	}
	if d := time.Since(start); d < 900*time.Millisecond {
		t.Errorf("an empty 1s long poll returned after %v", d)
	}

	go func() {
		time.Sleep(300 * time.Millisecond)
		c.SendMessage(ctx, &sqs.SendMessageInput{QueueUrl: aws.String(url), MessageBody: aws.String("late")})
	}()
	start = time.Now()
	got := receive(t, ctx, c, url, 1, 10)
	if len(got) != 1 || aws.ToString(got[0].Body) != "late" {
		t.Fatalf("the long poll returned %d messages", len(got))
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("the long poll took %v to return a message sent after 300ms", d)
	}
}

// TestSQSFIFOAndBatches checks FIFO message groups (order per group, a group
// held while a message of it is in flight), deduplication by id, and the
// batch calls (send, change visibility, delete).
func TestSQSFIFOAndBatches(t *testing.T) {
	t.Parallel()
	c := sqsClient(t)
	ctx := testenv.Context(t, 30*time.Second)
	url, _ := createQueue(t, ctx, c, testenv.UniqueName(t, "")+".fifo", map[string]string{
		"FifoQueue": "true", "VisibilityTimeout": "30",
	})

	var entries []types.SendMessageBatchRequestEntry
	for i, g := range []string{"a", "b", "a", "b", "a"} {
		entries = append(entries, types.SendMessageBatchRequestEntry{
			Id: aws.String(fmt.Sprint(i)), MessageBody: aws.String(fmt.Sprintf("%s%d", g, i)),
			MessageGroupId: aws.String(g), MessageDeduplicationId: aws.String(fmt.Sprint("d", i)),
		})
	}
	sent, err := c.SendMessageBatch(ctx, &sqs.SendMessageBatchInput{QueueUrl: aws.String(url), Entries: entries})
	if err != nil || len(sent.Successful) != 5 || len(sent.Failed) != 0 {
		t.Fatalf("send batch: %v, %d sent, failed %v", err, len(sent.Successful), sent.Failed)
	}
	// The same deduplication id again: accepted, not enqueued.
	if _, err := c.SendMessage(ctx, &sqs.SendMessageInput{QueueUrl: aws.String(url), MessageBody: aws.String("dup"),
		MessageGroupId: aws.String("a"), MessageDeduplicationId: aws.String("d0")}); err != nil {
		t.Fatalf("send duplicate: %v", err)
	}

	groupOf := func(m types.Message) string {
		return m.Attributes[string(types.MessageSystemAttributeNameMessageGroupId)]
	}
	bodies := func(ms []types.Message) map[string][]string {
		out := map[string][]string{}
		for _, m := range ms {
			out[groupOf(m)] = append(out[groupOf(m)], aws.ToString(m.Body))
			if m.Attributes[string(types.MessageSystemAttributeNameSequenceNumber)] == "" {
				t.Errorf("message %s has no SequenceNumber", aws.ToString(m.Body))
			}
		}
		return out
	}

	// The head of the queue: group a's first message, kept in flight.
	head := receive(t, ctx, c, url, 1, 5)
	if len(head) != 1 || aws.ToString(head[0].Body) != "a0" {
		t.Fatalf("first receive: %v, want a0", bodies(head))
	}
	// While a0 is in flight group a is held: only b's messages come, in order.
	bs := receive(t, ctx, c, url, 10, 1)
	if got := bodies(bs); fmt.Sprint(got) != "map[b:[b1 b3]]" {
		t.Fatalf("with a0 in flight received %v, want only b: [b1 b3]", got)
	}
	// Nothing else: group a is held, and the duplicate of a0 was not enqueued.
	if more := receive(t, ctx, c, url, 10, 0); len(more) != 0 {
		t.Fatalf("received %v while group a was held", bodies(more))
	}

	// Batch calls: make b's messages visible again, delete a0.
	var vis []types.ChangeMessageVisibilityBatchRequestEntry
	for i, m := range bs {
		vis = append(vis, types.ChangeMessageVisibilityBatchRequestEntry{Id: aws.String(fmt.Sprint(i)), ReceiptHandle: m.ReceiptHandle, VisibilityTimeout: 0})
	}
	cv, err := c.ChangeMessageVisibilityBatch(ctx, &sqs.ChangeMessageVisibilityBatchInput{QueueUrl: aws.String(url), Entries: vis})
	if err != nil || len(cv.Successful) != 2 || len(cv.Failed) != 0 {
		t.Fatalf("change visibility batch: %v, %+v", err, cv)
	}
	dm, err := c.DeleteMessageBatch(ctx, &sqs.DeleteMessageBatchInput{QueueUrl: aws.String(url), Entries: []types.DeleteMessageBatchRequestEntry{
		{Id: aws.String("a0"), ReceiptHandle: head[0].ReceiptHandle},
	}})
	if err != nil || len(dm.Successful) != 1 || len(dm.Failed) != 0 {
		t.Fatalf("delete batch: %v, %+v", err, dm)
	}

	var rest []types.Message
	for deadline := time.Now().Add(10 * time.Second); len(rest) < 4 && time.Now().Before(deadline); {
		rest = append(rest, receive(t, ctx, c, url, 10, 1)...)
	}
	if got := bodies(rest); fmt.Sprint(got) != "map[a:[a2 a4] b:[b1 b3]]" {
		t.Fatalf("after the batch calls received %v, want a: [a2 a4], b: [b1 b3]", got)
	}
	for _, m := range rest {
		want := 1
		if groupOf(m) == "b" {
			want = 2
		}
		if n := receiveCount(t, m); n != want {
			t.Errorf("%s: ApproximateReceiveCount %d, want %d", aws.ToString(m.Body), n, want)
		}
	}
}
