package sqs_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	ferrysqs "github.com/ferrymq/ferry/sqs"
)

// benchParallel is the parallelism of both sides: the raw loops'
// goroutines, the receives the Ferry consumer keeps open at most
// (WithMaxReceivers), and the batches the Ferry publisher sends at once.
// The Ferry consumer's bound in flight leaves room for its receives and
// for as many messages again waiting for their DeleteMessageBatch (the raw
// loop's messages leave its count when their delete is made too).
const (
	benchParallel    = 8
	benchConcurrency = 16
	benchMaxInFlight = 2 * benchParallel * 10
)

// benchVisibility is the queues' visibility timeout. Short, so that a
// receive whose answer is lost (here the SDK retries a receive whose
// connection was closed under it, on either side, now and then) delays its
// ten messages by seconds, not a minute, and the rates measure the loops.
const benchVisibility = 5 * time.Second

var benchBody = []byte(`{"order":"o-123456","customer":"c-98765","amount":4200,"currency":"EUR","lines":3}`)

// rawRates holds the raw loops' rates of this run, for the ratios the Ferry
// benchmarks report (run them in one go test -bench invocation).
var rawRates sync.Map

func reportRate(b *testing.B, kind string, n int, elapsed time.Duration, after, before map[string]int) {
	rate := float64(n) / elapsed.Seconds()
	b.ReportMetric(rate, "msgs/s")
	b.ReportMetric(float64(totalCalls(after, before))/float64(n), "calls/msg")
	// Each kind of call apart, to see which a loop makes more of.
	for op, unit := range map[string]string{"ReceiveMessage": "receives/msg", "DeleteMessageBatch": "deletes/msg", "ChangeMessageVisibilityBatch": "changes/msg"} {
		if k := after[op] - before[op]; k > 0 {
			b.ReportMetric(float64(k)/float64(n), unit)
		}
	}
	b.ReportMetric(0, "ns/op")
	if strings.Contains(b.Name(), "/raw") {
		rawRates.Store(kind, rate)
		return
	}
	if raw, ok := rawRates.Load(kind); ok {
		b.ReportMetric(rate/raw.(float64), "x-raw")
	}
}

// benchPublish fills a queue with n messages through the raw client, ten a
// call, benchParallel calls at once.
func benchPublish(b *testing.B, c *awssqs.Client, url string, n int) {
	b.Helper()
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, benchParallel)
	for range benchParallel {
		wg.Add(1)
		go func() {
			defer wg.Done()
			entries := make([]types.SendMessageBatchRequestEntry, 0, 10)
			for {
				first := int(next.Add(10)) - 10
				if first >= n {
					return
				}
				entries = entries[:0]
				for i := first; i < min(first+10, n); i++ {
					entries = append(entries, types.SendMessageBatchRequestEntry{
						Id: aws.String(strconv.Itoa(i - first)), MessageBody: aws.String(string(benchBody)),
						MessageAttributes: map[string]types.MessageAttributeValue{"seq": {DataType: aws.String("String"), StringValue: aws.String(strconv.Itoa(i))}},
					})
				}
				out, err := c.SendMessageBatch(context.Background(), &awssqs.SendMessageBatchInput{QueueUrl: aws.String(url), Entries: entries})
				if err == nil && len(out.Failed) > 0 {
					err = fmt.Errorf("%d entries failed", len(out.Failed))
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		b.Fatal(err)
	}
}

// BenchmarkConsume consumes b.N messages (run it with -benchtime=100000x
// for the 100k) from a queue filled beforehand: a raw loop of
// ReceiveMessage (ten, long polling) and DeleteMessageBatch in
// benchParallel goroutines, then a Ferry consumer with a handler that does
// nothing, then one with the Standard stack around it. Each reports
// msgs/s, API calls per message and, for Ferry, x-raw: its rate over the
// raw loop's in the same run.
func BenchmarkConsume(b *testing.B) {
	b.Run("raw", func(b *testing.B) {
		var cs calls
		c := newClient(b, &cs)
		_, url := createQueue(b, c, "bench-raw", queueConfig{visibility: benchVisibility})
		benchPublish(b, newClient(b, nil), url, b.N)
		before := cs.snapshot()
		b.ResetTimer()
		start := time.Now()
		var done atomic.Int64
		var wg sync.WaitGroup
		for range benchParallel {
			wg.Add(1)
			go func() {
				defer wg.Done()
				entries := make([]types.DeleteMessageBatchRequestEntry, 0, 10)
				for done.Load() < int64(b.N) {
					out, err := c.ReceiveMessage(context.Background(), &awssqs.ReceiveMessageInput{
						QueueUrl: aws.String(url), MaxNumberOfMessages: 10, WaitTimeSeconds: 1,
						MessageSystemAttributeNames: []types.MessageSystemAttributeName{types.MessageSystemAttributeNameAll},
						MessageAttributeNames:       []string{"All"},
					})
					if err != nil {
						b.Error(err)
						return
					}
					if len(out.Messages) == 0 {
						continue
					}
					entries = entries[:0]
					for i, m := range out.Messages {
						entries = append(entries, types.DeleteMessageBatchRequestEntry{Id: aws.String(strconv.Itoa(i)), ReceiptHandle: m.ReceiptHandle})
					}
					if _, err := c.DeleteMessageBatch(context.Background(), &awssqs.DeleteMessageBatchInput{QueueUrl: aws.String(url), Entries: entries}); err != nil {
						b.Error(err)
						return
					}
					done.Add(int64(len(out.Messages)))
				}
			}()
		}
		wg.Wait()
		elapsed := time.Since(start)
		b.StopTimer()
		reportRate(b, "consume", b.N, elapsed, cs.snapshot(), before)
	})
	for _, kind := range []string{"noop", "standard"} {
		b.Run(kind, func(b *testing.B) {
			var cs calls
			c := newClient(b, &cs)
			br := newBroker(b, c, ferrysqs.WithMaxReceivers(benchParallel))
			name, url := createQueue(b, c, "bench-"+kind, queueConfig{visibility: benchVisibility})
			dlq, _ := createQueue(b, c, "bench-dlq", queueConfig{})
			benchPublish(b, newClient(b, nil), url, b.N)
			l, err := br.NewConsumer(context.Background(), name, consumer.WithConcurrency(benchConcurrency),
				consumer.WithMaxInFlight(benchMaxInFlight), consumer.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
			if err != nil {
				b.Fatal(err)
			}
			var h consumer.Handler = consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
			if kind == "standard" {
				stack, err := consumer.Standard(br, dlq)
				if err != nil {
					b.Fatal(err)
				}
				h = stack.Wrap(h)
			}
			before := cs.snapshot()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			b.ResetTimer()
			start := time.Now()
			done := make(chan error, 1)
			go func() { done <- l.Run(ctx, h) }()
			for l.Stats().Acked < int64(b.N) {
				time.Sleep(time.Millisecond)
			}
			elapsed := time.Since(start)
			b.StopTimer()
			after := cs.snapshot()
			cancel()
			if err := <-done; err != nil {
				b.Fatal(err)
			}
			if s := l.Stats(); s.Failed != 0 || s.Returned != 0 {
				b.Fatalf("stats %+v", s)
			}
			reportRate(b, "consume", b.N, elapsed, after, before)
		})
	}
}

// BenchmarkPublish publishes b.N messages (-benchtime=100000x for 100k):
// raw SendMessageBatch calls of ten in benchParallel goroutines, then
// Broker.Publish of ten messages in as many goroutines, then Publish calls
// of a thousand messages, each sending benchParallel batches at once.
func BenchmarkPublish(b *testing.B) {
	msg := func(i int) consumer.Message {
		return consumer.Message{Body: benchBody, Headers: map[string]string{"seq": strconv.Itoa(i)}}
	}
	b.Run("raw", func(b *testing.B) {
		var cs calls
		c := newClient(b, &cs)
		_, url := createQueue(b, c, "bench-pub-raw", queueConfig{})
		before := cs.snapshot()
		b.ResetTimer()
		start := time.Now()
		benchPublish(b, c, url, b.N)
		elapsed := time.Since(start)
		b.StopTimer()
		reportRate(b, "publish", b.N, elapsed, cs.snapshot(), before)
	})
	for _, per := range []int{10, 1000} {
		b.Run(fmt.Sprint("ferry-", per), func(b *testing.B) {
			var cs calls
			c := newClient(b, &cs)
			br := newBroker(b, c)
			name, _ := createQueue(b, c, "bench-pub", queueConfig{})
			if err := br.Publish(context.Background(), name, msg(-1)); err != nil { // looks the queue up
				b.Fatal(err)
			}
			parallel := benchParallel
			if per > 10 {
				parallel = 1 // Publish itself sends benchParallel batches at once
			}
			before := cs.snapshot()
			b.ResetTimer()
			start := time.Now()
			benchFerryPublish(b, br, name, b.N, per, parallel, msg)
			elapsed := time.Since(start)
			b.StopTimer()
			reportRate(b, "publish", b.N, elapsed, cs.snapshot(), before)
		})
	}
}

// benchFerryPublish publishes n messages, msg(0) to msg(n-1), to the queue
// name through br: Publish calls of per messages from parallel goroutines.
func benchFerryPublish(b *testing.B, br *ferrysqs.Broker, name string, n, per, parallel int, msg func(int) consumer.Message) {
	b.Helper()
	var next atomic.Int64
	var wg sync.WaitGroup
	for range parallel {
		wg.Add(1)
		go func() {
			defer wg.Done()
			msgs := make([]consumer.Message, 0, per)
			for {
				first := int(next.Add(int64(per))) - per
				if first >= n {
					return
				}
				msgs = msgs[:0]
				for i := first; i < min(first+per, n); i++ {
					msgs = append(msgs, msg(i))
				}
				if err := br.Publish(context.Background(), name, msgs...); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if b.Failed() {
		b.FailNow()
	}
}

func totalCalls(after, before map[string]int) int {
	n := 0
	for op, k := range after {
		switch op {
		case "ReceiveMessage", "DeleteMessageBatch", "ChangeMessageVisibilityBatch", "SendMessageBatch":
			n += k - before[op]
		}
	}
	return n
}

// fifoSeq numbers the messages the FIFO benchmarks send, for their
// deduplication ids: unique within SQS's five minutes on a queue that
// serves several runs.
var fifoSeq atomic.Int64

// benchPublishGroup fills a FIFO queue with n messages of one message
// group, ten a call, in order.
func benchPublishGroup(b *testing.B, c *awssqs.Client, url string, n int) {
	b.Helper()
	entries := make([]types.SendMessageBatchRequestEntry, 0, 10)
	for first := 0; first < n; first += 10 {
		entries = entries[:0]
		for i := first; i < min(first+10, n); i++ {
			seq := strconv.FormatInt(fifoSeq.Add(1), 10)
			entries = append(entries, types.SendMessageBatchRequestEntry{
				Id: aws.String(strconv.Itoa(i - first)), MessageBody: aws.String(string(benchBody)),
				MessageGroupId: aws.String("the-group"), MessageDeduplicationId: aws.String(seq),
			})
		}
		out, err := c.SendMessageBatch(context.Background(), &awssqs.SendMessageBatchInput{QueueUrl: aws.String(url), Entries: entries})
		if err == nil && len(out.Failed) > 0 {
			err = fmt.Errorf("%d entries failed: %s", len(out.Failed), aws.ToString(out.Failed[0].Message))
		}
		if err != nil {
			b.Fatal(err)
		}
	}
}

// benchQuiet waits until the queue at url holds n visible messages and
// none in flight: a run does not inherit a receive of the run before it
// (a consumer's long poll cut as it stopped takes the next messages for a
// few seconds; see Stopping in the package documentation).
func benchQuiet(b *testing.B, c *awssqs.Client, url string, n int) {
	b.Helper()
	testenv.WaitFor(b, 30*time.Second, "the queue to be quiet", func() bool {
		visible, inflight, _ := depth(b, c, url)
		return visible == n && inflight == 0
	})
}

// benchRounds is how many turns the raw loop and Ferry take in
// BenchmarkFIFOOneGroup: turns, so that the drift of a shared broker's
// speed over a run (as large as the difference measured) falls on both.
const benchRounds = 6

// BenchmarkFIFOOneGroup consumes b.N messages of one message group from a
// FIFO queue filled beforehand (-benchtime=3000x or more), by turns, on
// the same queue in the same run: a raw loop of one receiver
// (ReceiveMessage of ten, then DeleteMessageBatch of what it got, one
// after the other: the fastest one group can go, since SQS hands out none
// of a group's messages while others of it are in flight), then a Ferry
// consumer with a handler that does nothing, benchRounds times, each
// consuming b.N/benchRounds. It reports Ferry's msgs/s and calls per
// message, the raw loop's (raw-msgs/s, raw-calls/msg), both over all
// rounds, and x-raw: the median over the rounds of Ferry's rate over the
// raw loop's in the same round (issue 32 D7: Ferry held a receive's
// messages until every concurrent receive had answered, about 18 msgs/s
// on one group).
func BenchmarkFIFOOneGroup(b *testing.B) {
	c := newClient(b, nil)
	_, url := createQueue(b, c, "bench-fifo", queueConfig{fifo: true, visibility: 30 * time.Second})
	var rawCalls, ferryCalls calls
	rc := newClient(b, &rawCalls)
	br := newBroker(b, newClient(b, &ferryCalls))
	per := max(b.N/benchRounds, 1)
	var rawTook, ferryTook time.Duration
	var rawN, ferryN int
	var ratios []float64
	b.ResetTimer()
	for range benchRounds {
		b.StopTimer()
		benchPublishGroup(b, c, url, per)
		benchQuiet(b, c, url, per)
		b.StartTimer()
		start := time.Now()
		entries := make([]types.DeleteMessageBatchRequestEntry, 0, 10)
		for done := 0; done < per; {
			out, err := rc.ReceiveMessage(context.Background(), &awssqs.ReceiveMessageInput{
				QueueUrl: aws.String(url), MaxNumberOfMessages: 10, WaitTimeSeconds: 1,
				MessageSystemAttributeNames: []types.MessageSystemAttributeName{types.MessageSystemAttributeNameAll},
				MessageAttributeNames:       []string{"All"},
			})
			if err != nil {
				b.Fatal(err)
			}
			if len(out.Messages) == 0 {
				continue
			}
			entries = entries[:0]
			for i, m := range out.Messages {
				entries = append(entries, types.DeleteMessageBatchRequestEntry{Id: aws.String(strconv.Itoa(i)), ReceiptHandle: m.ReceiptHandle})
			}
			if _, err := rc.DeleteMessageBatch(context.Background(), &awssqs.DeleteMessageBatchInput{QueueUrl: aws.String(url), Entries: entries}); err != nil {
				b.Fatal(err)
			}
			done += len(out.Messages)
		}
		rawRound := time.Since(start)
		rawTook += rawRound
		rawN += per

		b.StopTimer()
		benchPublishGroup(b, c, url, per)
		benchQuiet(b, c, url, per)
		l, err := br.NewConsumer(context.Background(), url, consumer.WithLogger(slog.New(slog.DiscardHandler)))
		if err != nil {
			b.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		b.StartTimer()
		start = time.Now()
		done := make(chan error, 1)
		go func() {
			done <- l.Run(ctx, consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }))
		}()
		for l.Stats().Acked < int64(per) {
			time.Sleep(time.Millisecond)
		}
		ferryRound := time.Since(start)
		ferryTook += ferryRound
		ferryN += per
		ratios = append(ratios, rawRound.Seconds()/ferryRound.Seconds())
		b.StopTimer()
		cancel()
		if err := <-done; err != nil {
			b.Fatal(err)
		}
		if s := l.Stats(); s.Failed != 0 || s.Returned != 0 {
			b.Fatalf("stats %+v", s)
		}
		b.StartTimer()
	}
	b.StopTimer()
	rawRate, ferryRate := float64(rawN)/rawTook.Seconds(), float64(ferryN)/ferryTook.Seconds()
	b.ReportMetric(ferryRate, "msgs/s")
	b.ReportMetric(rawRate, "raw-msgs/s")
	slices.Sort(ratios)
	b.ReportMetric(ratios[len(ratios)/2], "x-raw")
	b.ReportMetric(float64(totalCalls(ferryCalls.snapshot(), nil))/float64(ferryN), "calls/msg")
	b.ReportMetric(float64(totalCalls(rawCalls.snapshot(), nil))/float64(rawN), "raw-calls/msg")
	b.ReportMetric(0, "ns/op")
}

// largeBody is a message of a little under 512 KiB: two of them and their
// "seq" attribute fit in one SendMessageBatch (MaxBatchSize, 1 MiB), three
// do not, so a batch is cut by bytes long before its ten entries.
var largeBody = []byte(strings.Repeat("x", 512<<10-64))

// BenchmarkPublishLarge publishes b.N messages of largeBody
// (-benchtime=600x or more) by turns, on one queue in one run: a raw loop
// of SendMessageBatch in benchParallel goroutines, each call packed as SQS
// allows (up to ten entries and MaxBatchSize bytes as SQS counts them: so
// two a call), then Broker.Publish of ten messages in as many goroutines,
// which splits them the same way, benchRounds times. It reports Ferry's
// msgs/s, the raw loop's, SendMessageBatch calls a message of each, and
// x-raw: the median over the rounds of Ferry's rate over the raw loop's in
// the same round (issue 31: at least 0.9).
func BenchmarkPublishLarge(b *testing.B) {
	var rawCalls, ferryCalls calls
	rc := newClient(b, &rawCalls)
	br := newBroker(b, newClient(b, &ferryCalls))
	name, url := createQueue(b, rc, "bench-pub-large", queueConfig{})
	msg := func(i int) consumer.Message {
		return consumer.Message{Body: largeBody, Headers: map[string]string{"seq": strconv.Itoa(i)}}
	}
	if err := br.Publish(context.Background(), name, msg(-1)); err != nil { // looks the queue up, and checks that it takes such messages
		b.Fatal(err)
	}
	per := max(b.N/benchRounds, 2*benchParallel)
	var rawTook, ferryTook time.Duration
	var n int
	var ratios []float64
	b.ResetTimer()
	for range benchRounds {
		start := time.Now()
		benchPublishBySize(b, rc, url, per)
		rawRound := time.Since(start)

		start = time.Now()
		benchFerryPublish(b, br, name, per, 10, benchParallel, msg)
		ferryRound := time.Since(start)
		rawTook, ferryTook, n = rawTook+rawRound, ferryTook+ferryRound, n+per
		ratios = append(ratios, rawRound.Seconds()/ferryRound.Seconds())

		b.StopTimer()
		// Empty the queue between rounds, so that ElasticMQ's memory does
		// not grow by 300 MiB a round.
		if _, err := rc.PurgeQueue(context.Background(), &awssqs.PurgeQueueInput{QueueUrl: aws.String(url)}); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	b.StopTimer()
	b.ReportMetric(float64(n)/ferryTook.Seconds(), "msgs/s")
	b.ReportMetric(float64(n)/rawTook.Seconds(), "raw-msgs/s")
	slices.Sort(ratios)
	b.ReportMetric(ratios[len(ratios)/2], "x-raw")
	b.ReportMetric(float64(ferryCalls.get("SendMessageBatch")-1)/float64(n), "calls/msg")
	b.ReportMetric(float64(rawCalls.get("SendMessageBatch"))/float64(n), "raw-calls/msg")
	b.ReportMetric(0, "ns/op")
}

// benchPublishBySize sends n messages of largeBody to url through the raw
// client in benchParallel goroutines, each SendMessageBatch as full as
// SQS's limits allow: at most ten entries and MaxBatchSize bytes, counted
// as SQS counts them (the body, and each attribute's name, type and value).
func benchPublishBySize(b *testing.B, c *awssqs.Client, url string, n int) {
	b.Helper()
	const attr, typ = "seq", "String"
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, benchParallel)
	for range benchParallel {
		wg.Add(1)
		go func() {
			defer wg.Done()
			entries := make([]types.SendMessageBatchRequestEntry, 0, 10)
			size := 0
			flush := func() error {
				if len(entries) == 0 {
					return nil
				}
				out, err := c.SendMessageBatch(context.Background(), &awssqs.SendMessageBatchInput{QueueUrl: aws.String(url), Entries: entries})
				if err == nil && len(out.Failed) > 0 {
					err = fmt.Errorf("%d entries failed: %s", len(out.Failed), aws.ToString(out.Failed[0].Message))
				}
				entries, size = entries[:0], 0
				return err
			}
			for {
				i := int(next.Add(1)) - 1
				if i >= n {
					if err := flush(); err != nil {
						errs <- err
					}
					return
				}
				seq := strconv.Itoa(i)
				s := len(largeBody) + len(attr) + len(typ) + len(seq)
				if len(entries) == 10 || size+s > ferrysqs.MaxBatchSize {
					if err := flush(); err != nil {
						errs <- err
						return
					}
				}
				entries = append(entries, types.SendMessageBatchRequestEntry{
					Id: aws.String(strconv.Itoa(len(entries))), MessageBody: aws.String(string(largeBody)),
					MessageAttributes: map[string]types.MessageAttributeValue{attr: {DataType: aws.String(typ), StringValue: aws.String(seq)}},
				})
				size += s
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		b.Fatal(err)
	}
}
