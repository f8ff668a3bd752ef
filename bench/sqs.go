package bench

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/ferrytest"
	ferrysqs "github.com/ferrymq/ferry/sqs"
)

// SQSConfig says where the SQS-compatible server is.
type SQSConfig struct {
	Endpoint, Region, AccessKey, SecretKey string
}

// countingTransport counts the HTTP requests a client sends: each API
// call once, and each of the SDK's own retries once more.
type countingTransport struct {
	next http.RoundTripper
	n    atomic.Int64
}

func (t *countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	t.n.Add(1)
	return t.next.RoundTrip(r)
}

// sqsVisibility is the queues' visibility timeout: short, so that a
// receive whose answer is lost delays its messages by seconds.
const sqsVisibility = 5

// SQSSuite compares Ferry's SQS consumer and publisher with a raw
// aws-sdk-go-v2 loop, counting HTTP requests per message. Watermill's SQS
// adapter (watermill-aws) is not measured: the module proxy this was built
// with does not serve it (see the note the suite adds).
func SQSSuite(cfg SQSConfig, run string) (*Suite, error) {
	newClient := func(ct *countingTransport) *awssqs.Client {
		// Enough idle connections for the receives and batch calls: with
		// the default of 2 per host, connections are closed and opened all
		// the time.
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.MaxIdleConnsPerHost = 100
		var rt http.RoundTripper = tr
		if ct != nil {
			ct.next = tr
			rt = ct
		}
		return awssqs.New(awssqs.Options{
			Region: cfg.Region, BaseEndpoint: aws.String(cfg.Endpoint),
			Credentials: credentials.NewStaticCredentialsProvider(cfg.AccessKey, cfg.SecretKey, ""),
			HTTPClient:  &http.Client{Transport: rt},
		})
	}
	ct := &countingTransport{}
	counted := newClient(ct)
	plain := newClient(nil)
	br, err := ferrysqs.New(counted, ferrysqs.WithLogger(quiet), ferrysqs.WithMaxReceivers(Concurrency))
	if err != nil {
		return nil, err
	}
	var seq atomic.Int64
	var mu sync.Mutex
	urls := map[string]string{}
	create := func(ctx context.Context, p string) (string, error) {
		name := fmt.Sprintf("ferry-bench-%s-%s-%d", run, p, seq.Add(1))
		out, err := plain.CreateQueue(ctx, &awssqs.CreateQueueInput{QueueName: aws.String(name),
			Attributes: map[string]string{"VisibilityTimeout": strconv.Itoa(sqsVisibility)}})
		if err != nil {
			return "", fmt.Errorf("create queue %s: %w", name, err)
		}
		mu.Lock()
		urls[name] = aws.ToString(out.QueueUrl)
		mu.Unlock()
		return name, nil
	}
	url := func(name string) string {
		mu.Lock()
		defer mu.Unlock()
		return urls[name]
	}
	// drop deletes a queue a variant is done with: the publish variants
	// leave 100,000 messages each, and ElasticMQ keeps every message in its
	// heap (three rounds of them once ran it out of memory).
	drop := func(name string) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		mu.Lock()
		u, ok := urls[name]
		delete(urls, name)
		mu.Unlock()
		if ok {
			_, _ = plain.DeleteQueue(ctx, &awssqs.DeleteQueueInput{QueueUrl: aws.String(u)})
		}
	}
	s := &Suite{Broker: ferrytest.SQS}
	s.Close = func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		mu.Lock()
		for _, u := range urls {
			_, _ = plain.DeleteQueue(ctx, &awssqs.DeleteQueueInput{QueueUrl: aws.String(u)})
		}
		mu.Unlock()
		br.Close()
	}
	send := func(ctx context.Context, c *awssqs.Client, u string, lo, hi int) error {
		entries := make([]types.SendMessageBatchRequestEntry, 0, 10)
		for i := lo; i < hi; i++ {
			entries = append(entries, types.SendMessageBatchRequestEntry{
				Id: aws.String(strconv.Itoa(i - lo)), MessageBody: aws.String(string(Body(i))),
				MessageAttributes: map[string]types.MessageAttributeValue{
					WatermillUUIDHeader: {DataType: aws.String("String"), StringValue: aws.String(UUID(i))}},
			})
		}
		out, err := c.SendMessageBatch(ctx, &awssqs.SendMessageBatchInput{QueueUrl: aws.String(u), Entries: entries})
		if err == nil && len(out.Failed) > 0 {
			err = fmt.Errorf("%d entries failed: %s", len(out.Failed), aws.ToString(out.Failed[0].Message))
		}
		return err
	}
	s.Fill = func(ctx context.Context, n int) (Source, error) {
		q, err := create(ctx, "consume")
		if err != nil {
			return Source{}, err
		}
		u := url(q)
		return Source{Name: q, N: n}, parallel(ctx, Concurrency, n, 10, func(ctx context.Context, lo, hi int) error {
			return send(ctx, plain, u, lo, hi)
		})
	}
	dlq, err := create(context.Background(), "dlq")
	if err != nil {
		s.Close()
		return nil, err
	}
	ferryConsume := func(full bool) Consumer {
		return func(ctx context.Context, src Source, tr *Tracker) error {
			loop, err := br.NewConsumer(ctx, src.Name, consumer.WithConcurrency(2*Concurrency),
				consumer.WithMaxInFlight(2*Concurrency*10), consumer.WithLogger(quiet))
			if err != nil {
				return err
			}
			h, err := ferryHandler(br, dlq, full, tr)
			if err != nil {
				return err
			}
			return runFerry(ctx, loop, h, tr)
		}
	}
	// The raw loop: Concurrency goroutines, each ReceiveMessage (ten, long
	// polling), handle each, DeleteMessageBatch, again.
	rawConsume := func(ctx context.Context, src Source, tr *Tracker) error {
		u := url(src.Name)
		return parallelLoops(ctx, Concurrency, func(ctx context.Context) error {
			entries := make([]types.DeleteMessageBatchRequestEntry, 0, 10)
			for {
				select {
				case <-tr.Done():
					return nil
				default:
				}
				out, err := counted.ReceiveMessage(ctx, &awssqs.ReceiveMessageInput{
					QueueUrl: aws.String(u), MaxNumberOfMessages: 10, WaitTimeSeconds: 1,
					MessageSystemAttributeNames: []types.MessageSystemAttributeName{types.MessageSystemAttributeNameAll},
					MessageAttributeNames:       []string{"All"},
				})
				if err != nil {
					if ctx.Err() != nil {
						return nil
					}
					return err
				}
				if len(out.Messages) == 0 {
					continue
				}
				entries = entries[:0]
				for i, m := range out.Messages {
					tr.Mark([]byte(aws.ToString(m.Body)))
					entries = append(entries, types.DeleteMessageBatchRequestEntry{Id: aws.String(strconv.Itoa(i)), ReceiptHandle: m.ReceiptHandle})
				}
				if _, err := counted.DeleteMessageBatch(ctx, &awssqs.DeleteMessageBatchInput{QueueUrl: aws.String(u), Entries: entries}); err != nil {
					if ctx.Err() != nil {
						return nil
					}
					return err
				}
			}
		}, tr)
	}
	publish := func(impl Impl) Publisher {
		return func(ctx context.Context, n int) (func(context.Context) error, func(), error) {
			q, err := create(ctx, "publish")
			if err != nil {
				return nil, nil, err
			}
			if impl == Raw {
				u := url(q)
				return func(ctx context.Context) error {
					return parallel(ctx, Concurrency, n, 10, func(ctx context.Context, lo, hi int) error {
						return send(ctx, counted, u, lo, hi)
					})
				}, func() { drop(q) }, nil
			}
			// A first Publish looks the queue's URL up: not timed.
			if err := br.Publish(ctx, q, consumer.Message{Body: Body(0)}); err != nil {
				return nil, nil, err
			}
			return func(ctx context.Context) error {
				return parallel(ctx, Concurrency, n, 10, func(ctx context.Context, lo, hi int) error {
					return br.Publish(ctx, q, ferryMessages(lo, hi)...)
				})
			}, func() { drop(q) }, nil
		}
	}
	calls := ct.n.Load
	s.Variants = []Variant{
		{Op: ConsumeNoop, Impl: Ferry, Consume: ferryConsume(false), Calls: calls},
		{Op: ConsumeNoop, Impl: Raw, Consume: rawConsume, Calls: calls},
		{Op: ConsumeFull, Impl: Ferry, Consume: ferryConsume(true), Calls: calls},
		{Op: Publish, Impl: Ferry, Publish: publish(Ferry), Calls: calls},
		{Op: Publish, Impl: Raw, Publish: publish(Raw), Calls: calls},
	}
	s.Notes = append(s.Notes,
		"sqs: Watermill is not measured: its SQS adapter (github.com/ThreeDotsLabs/watermill-aws) could not be fetched from the Go module proxy this was built with (403, not served), so there is no Ferry/Watermill ratio and no Watermill calls/msg for SQS.",
		"sqs: calls/msg counts HTTP requests through a counting http.RoundTripper on the SDK client (each API call, and each SDK retry, once).",
		"sqs: the raw loop is 8 goroutines each ReceiveMessage (10, long polling 1 s) then DeleteMessageBatch; Ferry runs 8 receivers, concurrency 16, 160 in flight. Publish is 8 goroutines of SendMessageBatch (raw) or Publish (Ferry) of 10 messages.")
	return s, nil
}
