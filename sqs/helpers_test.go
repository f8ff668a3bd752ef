package sqs_test

import (
	"context"
	"fmt"
	"maps"
	"net/http"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awsmiddleware "github.com/aws/aws-sdk-go-v2/aws/middleware"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/credentials"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/aws/smithy-go/middleware"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	ferrysqs "github.com/ferrymq/ferry/sqs"
)

// calls counts the API calls a client makes, by operation, through an SDK
// middleware: each call once, whatever the SDK's own retries.
type calls struct {
	mu sync.Mutex
	n  map[string]int
	// hook, when set, sees each call's input before it is sent.
	hook func(op string, in any)
}

func (c *calls) add(stack *middleware.Stack) error {
	return stack.Initialize.Add(middleware.InitializeMiddlewareFunc("ferry-test-count",
		func(ctx context.Context, in middleware.InitializeInput, next middleware.InitializeHandler) (middleware.InitializeOutput, middleware.Metadata, error) {
			op := awsmiddleware.GetOperationName(ctx)
			c.mu.Lock()
			if c.n == nil {
				c.n = make(map[string]int)
			}
			c.n[op]++
			hook := c.hook
			c.mu.Unlock()
			if hook != nil {
				hook(op, in.Parameters)
			}
			return next.HandleInitialize(ctx, in)
		}), middleware.After)
}

func (c *calls) snapshot() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return maps.Clone(c.n)
}

func (c *calls) get(op string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[op]
}

func (c *calls) setHook(h func(op string, in any)) {
	c.mu.Lock()
	c.hook = h
	c.mu.Unlock()
}

// newClient returns an SDK client of the test server, counting its calls
// in cs when cs is not nil.
func newClient(t testing.TB, cs *calls, opts ...func(*awssqs.Options)) *awssqs.Client {
	t.Helper()
	endpoint := testenv.RequireSQS(t)
	o := awssqs.Options{
		Region:       testenv.SQSRegion(),
		BaseEndpoint: aws.String(endpoint),
		Credentials:  credentials.NewStaticCredentialsProvider(testenv.SQSAccessKey, testenv.SQSSecretKey, ""),
	}
	if cs != nil {
		o.APIOptions = append(o.APIOptions, cs.add)
	}
	// Enough idle connections for a consumer's receives and batch calls:
	// with the SDK's default of 10 per host, connections are closed and
	// opened all the time, and a receive whose answer is cut on a closing
	// connection leaves its messages invisible until their visibility
	// timeout (aws-sdk-go-v2 issue 2737).
	o.HTTPClient = awshttp.NewBuildableClient().WithTransportOptions(func(tr *http.Transport) {
		tr.MaxIdleConnsPerHost = 100
	})
	return awssqs.New(o, opts...)
}

// newBroker returns a Broker over c, closed when the test ends.
func newBroker(t testing.TB, c *awssqs.Client, opts ...ferrysqs.Option) *ferrysqs.Broker {
	t.Helper()
	b, err := ferrysqs.New(c, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// queueConfig is what a test asks of a queue.
type queueConfig struct {
	fifo       bool
	visibility time.Duration
	redriveTo  string // DLQ ARN
	maxRecv    int
}

// createQueue creates a queue of a unique name and deletes it when the
// test ends; it returns the name and the URL.
func createQueue(t testing.TB, c *awssqs.Client, prefix string, cfg queueConfig) (string, string) {
	t.Helper()
	return createNamedQueue(t, c, testenv.UniqueName(t, prefix), cfg)
}

// createNamedQueue creates the queue name (with ".fifo" added for a FIFO
// queue) and deletes it when the test ends; it returns the name and the
// URL.
func createNamedQueue(t testing.TB, c *awssqs.Client, name string, cfg queueConfig) (string, string) {
	t.Helper()
	attrs := map[string]string{}
	if cfg.fifo {
		name += ".fifo"
		attrs["FifoQueue"] = "true"
	}
	if cfg.visibility > 0 {
		attrs["VisibilityTimeout"] = strconv.Itoa(int(cfg.visibility / time.Second))
	}
	if cfg.redriveTo != "" {
		attrs["RedrivePolicy"] = fmt.Sprintf(`{"deadLetterTargetArn":%q,"maxReceiveCount":"%d"}`, cfg.redriveTo, cfg.maxRecv)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := c.CreateQueue(ctx, &awssqs.CreateQueueInput{QueueName: aws.String(name), Attributes: attrs})
	if err != nil {
		t.Fatalf("create queue %s: %v", name, err)
	}
	url := aws.ToString(out.QueueUrl)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, _ = c.DeleteQueue(ctx, &awssqs.DeleteQueueInput{QueueUrl: aws.String(url)})
	})
	return name, url
}

// queueARN returns a queue's ARN.
func queueARN(t testing.TB, c *awssqs.Client, url string) string {
	t.Helper()
	out, err := c.GetQueueAttributes(context.Background(), &awssqs.GetQueueAttributesInput{
		QueueUrl: aws.String(url), AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameQueueArn},
	})
	if err != nil {
		t.Fatal(err)
	}
	return out.Attributes[string(types.QueueAttributeNameQueueArn)]
}

// depth returns a queue's visible, in-flight and delayed message counts.
func depth(t testing.TB, c *awssqs.Client, url string) (visible, inflight, delayed int) {
	t.Helper()
	out, err := c.GetQueueAttributes(context.Background(), &awssqs.GetQueueAttributesInput{
		QueueUrl: aws.String(url), AttributeNames: []types.QueueAttributeName{
			types.QueueAttributeNameApproximateNumberOfMessages,
			types.QueueAttributeNameApproximateNumberOfMessagesNotVisible,
			types.QueueAttributeNameApproximateNumberOfMessagesDelayed,
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	n := func(a types.QueueAttributeName) int {
		v, _ := strconv.Atoi(out.Attributes[string(a)])
		return v
	}
	return n(types.QueueAttributeNameApproximateNumberOfMessages),
		n(types.QueueAttributeNameApproximateNumberOfMessagesNotVisible),
		n(types.QueueAttributeNameApproximateNumberOfMessagesDelayed)
}

// running is one consumer's Run in its own goroutine.
type running struct {
	cancel context.CancelFunc
	done   chan error
}

func start(t testing.TB, c interface {
	Run(context.Context, consumer.Handler) error
}, h consumer.Handler) *running {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- c.Run(ctx, h) }()
	t.Cleanup(func() { r.stop(t) })
	return r
}

// stop cancels the run and waits for it to return, failing the test on an
// error or when it does not return within a minute.
func (r *running) stop(t testing.TB) {
	t.Helper()
	if r.cancel == nil {
		return
	}
	r.cancel()
	r.cancel = nil
	select {
	case err := <-r.done:
		if err != nil {
			t.Errorf("Run returned %v", err)
		}
	case <-time.After(time.Minute):
		t.Errorf("Run did not return within a minute of its cancellation")
	}
}
