package kafka_test

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
)

// benchRecords is how many records the consume and publish benchmarks
// move: FERRY_KAFKA_BENCH_RECORDS, default 1,000,000.
func benchRecords(b *testing.B) int {
	if v := os.Getenv("FERRY_KAFKA_BENCH_RECORDS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n <= 0 {
			b.Fatalf("FERRY_KAFKA_BENCH_RECORDS=%q", v)
		}
		return n
	}
	return 1_000_000
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func benchBroker(b *testing.B) *kafka.Broker {
	b.Helper()
	br, err := kafka.New(testenv.RequireKafka(b), kafka.WithLogger(quiet))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = br.Close() })
	return br
}

// rawProducer is a plain franz-go producer with the same durability as
// Publish (acks from all in-sync replicas, idempotent), warmed up on topic
// (its metadata loaded, its producer id assigned) so that timing starts
// with records, not with connecting.
func rawProducer(b *testing.B, topic string) *kgo.Client {
	b.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(testenv.KafkaBrokers()...), kgo.DefaultProduceTopic(topic),
		kgo.RequiredAcks(kgo.AllISRAcks()), kgo.MaxBufferedRecords(100_000))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(cl.Close)
	if err := cl.ProduceSync(context.Background(), &kgo.Record{Key: []byte("warm-up")}).FirstErr(); err != nil {
		b.Fatal(err)
	}
	return cl
}

// rawProduce sends n records of 100 bytes, keyed over 1000 keys, with
// franz-go's async produce and one flush, and returns how long it took.
func rawProduce(b *testing.B, cl *kgo.Client, n int) time.Duration {
	b.Helper()
	body := make([]byte, 100)
	keys := make([][]byte, 1000)
	for i := range keys {
		keys[i] = []byte("key-" + strconv.Itoa(i))
	}
	var failed atomic.Value
	start := time.Now()
	for i := 0; i < n; i++ {
		cl.Produce(context.Background(), &kgo.Record{Key: keys[i%len(keys)], Value: body}, func(_ *kgo.Record, err error) {
			if err != nil {
				failed.Store(err)
			}
		})
	}
	if err := cl.Flush(context.Background()); err != nil {
		b.Fatal(err)
	}
	if err, _ := failed.Load().(error); err != nil {
		b.Fatal(err)
	}
	return time.Since(start)
}

// rawConsume reads topic to the end as a fresh group member with franz-go
// alone: PollRecords, process (nothing), commit what was polled, again.
func rawConsume(b *testing.B, topic string, n int) time.Duration {
	b.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(testenv.KafkaBrokers()...), kgo.ConsumeTopics(topic),
		kgo.ConsumerGroup(testenv.UniqueName(b, "raw")), kgo.DisableAutoCommit(),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	ctx := context.Background()
	start := time.Now()
	got := 0
	for got < n {
		fs := cl.PollRecords(ctx, 10_000)
		if err := fs.Err0(); err != nil {
			b.Fatal(err)
		}
		recs := fs.Records()
		got += len(recs)
		if err := cl.CommitRecords(ctx, recs...); err != nil {
			b.Fatal(err)
		}
	}
	return time.Since(start)
}

// ferryConsume reads topic to the end as a fresh Ferry consumer running h.
func ferryConsume(b *testing.B, br *kafka.Broker, topic string, n int, o consumer.Ordering, wrap func(consumer.Handler) consumer.Handler) time.Duration {
	b.Helper()
	loop, err := br.NewConsumer(b.Context(), topic, consumer.WithName(testenv.UniqueName(b, "ferry")),
		consumer.WithConcurrency(8), consumer.WithMaxInFlight(20_000), consumer.WithFetchBatch(5_000),
		consumer.WithOrdering(o), consumer.WithLogger(quiet))
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var handled atomic.Int64
	var h consumer.Handler = consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		if handled.Add(1) == int64(n) {
			cancel()
		}
		return nil
	})
	if wrap != nil {
		h = wrap(h)
	}
	start := time.Now()
	if err := loop.Run(ctx, h); err != nil {
		b.Fatal(err)
	}
	return time.Since(start)
}

// BenchmarkConsume reads the same topic (6 partitions, n records of 100
// bytes) four times in one run, each as a fresh group: raw franz-go, Ferry
// with a no-op handler in partition order (the default), Ferry with the
// Standard stack around it, and Ferry with no ordering at all (the loop's
// own bound). It reports the rates and the ratios to raw franz-go. Run it
// once:
//
//	go test -run '^$' -bench BenchmarkConsume -benchtime 1x ./kafka/
func BenchmarkConsume(b *testing.B) {
	n := benchRecords(b)
	br := benchBroker(b)
	topic := newTopic(b, br, "bench-consume", 6)
	dlq := newTopic(b, br, "bench-consume-dlq", 1)
	rawProduce(b, rawProducer(b, topic), n)
	n++ // the warm-up record
	stack, err := consumer.Standard(br, dlq)
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for range b.N {
		raw := rawConsume(b, topic, n)
		noop := ferryConsume(b, br, topic, n, consumer.OrderByLane, nil)
		std := ferryConsume(b, br, topic, n, consumer.OrderByLane, stack.Wrap)
		unordered := ferryConsume(b, br, topic, n, consumer.Unordered, nil)
		rate := func(d time.Duration) float64 { return float64(n) / d.Seconds() }
		b.ReportMetric(rate(raw), "raw-msgs/s")
		b.ReportMetric(rate(noop), "ferry-msgs/s")
		b.ReportMetric(rate(std), "standard-msgs/s")
		b.ReportMetric(raw.Seconds()/noop.Seconds(), "ferry/raw")
		b.ReportMetric(raw.Seconds()/std.Seconds(), "standard/raw")
		b.ReportMetric(raw.Seconds()/unordered.Seconds(), "unordered/raw")
	}
}

// publishers is how many goroutines call Publish at once in BenchmarkPublish.
const publishers = 256

// BenchmarkPublish publishes n records of 100 bytes (1000 keys) to a topic
// of 6 partitions twice in one run: raw franz-go async produce and one
// flush, and Ferry's Publish in calls of 100 records from 256 goroutines
// (each call waits for its acks, so calls overlap as a service's requests
// would). It reports both rates and the ratio.
//
//	go test -run '^$' -bench BenchmarkPublish -benchtime 1x ./kafka/
func BenchmarkPublish(b *testing.B) {
	n := benchRecords(b)
	br := benchBroker(b)
	b.ResetTimer()
	for range b.N {
		rawCl := rawProducer(b, newTopic(b, br, "bench-raw-pub", 6))
		topic := newTopic(b, br, "bench-pub", 6)
		if err := br.Publish(context.Background(), topic, consumer.Message{Key: "warm-up"}); err != nil {
			b.Fatal(err)
		}
		raw := rawProduce(b, rawCl, n)
		body := make([]byte, 100)
		var next atomic.Int64
		var wg sync.WaitGroup
		var failed atomic.Value
		start := time.Now()
		for range publishers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				msgs := make([]consumer.Message, 100)
				for {
					lo := int(next.Add(100)) - 100
					if lo >= n {
						return
					}
					msgs = msgs[:min(100, n-lo)]
					for i := range msgs {
						msgs[i] = consumer.Message{Key: "key-" + strconv.Itoa((lo+i)%1000), Body: body}
					}
					if err := br.Publish(context.Background(), topic, msgs...); err != nil {
						failed.Store(err)
						return
					}
				}
			}()
		}
		wg.Wait()
		ferry := time.Since(start)
		if err, _ := failed.Load().(error); err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(float64(n)/raw.Seconds(), "raw-msgs/s")
		b.ReportMetric(float64(n)/ferry.Seconds(), "ferry-msgs/s")
		b.ReportMetric(raw.Seconds()/ferry.Seconds(), "ferry/raw")
	}
}

// BenchmarkKeyParallelism handles records of 100 keys on one partition
// with a 5 ms handler at concurrency 64, once in partition order
// (OrderByLane) and once per key (OrderByKey), checks that each key's
// records completed in order in both, and reports the speed-up.
//
//	go test -run '^$' -bench BenchmarkKeyParallelism -benchtime 1x ./kafka/
func BenchmarkKeyParallelism(b *testing.B) {
	const records, keys = 2000, 100
	br := benchBroker(b)
	topic := newTopic(b, br, "bench-keys", 1)
	var msgs []consumer.Message
	for i := 0; i < records; i++ {
		msgs = append(msgs, consumer.Message{Key: "key-" + strconv.Itoa(i%keys), Body: []byte(strconv.Itoa(i))})
	}
	if err := br.Publish(context.Background(), topic, msgs...); err != nil {
		b.Fatal(err)
	}
	run := func(o consumer.Ordering) time.Duration {
		loop, err := br.NewConsumer(b.Context(), topic, consumer.WithName(testenv.UniqueName(b, "keys")),
			consumer.WithConcurrency(64), consumer.WithOrdering(o), consumer.WithLogger(quiet))
		if err != nil {
			b.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var mu sync.Mutex
		last := map[string]int{}
		var outOfOrder []string
		done := 0
		start := time.Now()
		err = loop.Run(ctx, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			time.Sleep(5 * time.Millisecond)
			seq, _ := strconv.Atoi(string(m.Body))
			mu.Lock()
			defer mu.Unlock()
			if prev, ok := last[m.Key]; ok && seq < prev {
				outOfOrder = append(outOfOrder, fmt.Sprintf("%s: %d after %d", m.Key, seq, prev))
			}
			last[m.Key] = seq
			if done++; done == records {
				cancel()
			}
			return nil
		}))
		took := time.Since(start)
		if err != nil {
			b.Fatal(err)
		}
		if len(outOfOrder) > 0 {
			b.Fatalf("%s: %d records completed before an earlier one of their key: %v", o, len(outOfOrder), outOfOrder[:min(5, len(outOfOrder))])
		}
		return took
	}
	b.ResetTimer()
	for range b.N {
		lane := run(consumer.OrderByLane)
		key := run(consumer.OrderByKey)
		b.ReportMetric(float64(records)/lane.Seconds(), "by-partition-msgs/s")
		b.ReportMetric(float64(records)/key.Seconds(), "by-key-msgs/s")
		b.ReportMetric(lane.Seconds()/key.Seconds(), "speedup")
	}
}

// BenchmarkPoisonLatency publishes 3,000 records at 300 a second over 1,000
// keys, one of them a poison record whose handler returns a plain error
// (a bug, not consumer.Permanent), and consumes them through
// consumer.Standard with its defaults, ordered by key. It reports the good
// records' latency from publish to handled (p50 and p99) and how often the
// breaker opened: a poison message is no outage, so the breaker must stay
// closed and the good records' p99 under a second. Ordered by key, the
// poison holds back only its own key while it spends its retries; ordered by
// partition (the default) it holds its whole partition, by design, and a
// sixth of the records wait for it (p99 about 28 s here).
func BenchmarkPoisonLatency(b *testing.B) {
	const n, rate, keys = 3000, 300, 1000
	br := benchBroker(b)
	for i := 0; i < b.N; i++ {
		topic, dlq := newTopic(b, br, "bench-poison", 6), newTopic(b, br, "bench-poison-dlq", 1)
		stack, err := consumer.Standard(br, dlq, consumer.StandardDeadLetter(consumer.DeadLetterLogger(quiet)))
		if err != nil {
			b.Fatal(err)
		}
		c, err := br.NewConsumer(b.Context(), topic, consumer.WithName(testenv.UniqueName(b, "bench-poison")),
			consumer.WithOrdering(consumer.OrderByKey), consumer.WithConcurrency(32), consumer.WithLogger(quiet))
		if err != nil {
			b.Fatal(err)
		}
		var mu sync.Mutex
		var latencies []time.Duration
		sent := make([]time.Time, n)
		ctx, cancel := context.WithCancel(context.Background())
		runDone := make(chan error, 1)
		go func() {
			runDone <- c.Run(ctx, stack.Wrap(consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
				idx, _ := strconv.Atoi(m.Header("bench-index"))
				if idx == n/3 {
					return fmt.Errorf("bench: a bug in the handler for record %d", idx)
				}
				mu.Lock()
				latencies = append(latencies, time.Since(sent[idx]))
				mu.Unlock()
				return nil
			})))
		}()
		tick := time.NewTicker(time.Second / rate)
		for j := 0; j < n; j++ {
			<-tick.C
			mu.Lock()
			sent[j] = time.Now()
			mu.Unlock()
			m := consumer.Message{Key: "key-" + strconv.Itoa(j%keys), Headers: map[string]string{"bench-index": strconv.Itoa(j)}}
			if err := br.Publish(context.Background(), topic, m); err != nil {
				b.Fatal(err)
			}
		}
		tick.Stop()
		deadline := time.Now().Add(2 * time.Minute)
		for {
			mu.Lock()
			got := len(latencies)
			mu.Unlock()
			if got == n-1 {
				break
			}
			if time.Now().After(deadline) {
				b.Fatalf("%d of %d good records handled after 2 minutes (breaker opened %d times)", got, n-1, stack.Breaker.Opened())
			}
			time.Sleep(10 * time.Millisecond)
		}
		cancel()
		if err := <-runDone; err != nil {
			b.Fatal(err)
		}
		slices.Sort(latencies)
		b.ReportMetric(float64(latencies[len(latencies)/2].Microseconds())/1000, "p50-ms")
		b.ReportMetric(float64(latencies[len(latencies)*99/100].Microseconds())/1000, "p99-ms")
		b.ReportMetric(float64(stack.Breaker.Opened()), "breaker-openings")
	}
}

// BenchmarkRetryTopicsThroughput measures what retry topics are for: a
// partition's throughput while 1% of its records fail. One partition of
// 3,000 records, a handler that works 1 ms a record in partition order,
// and retry topics: once with no failures, and once with every hundredth
// record failing on the topic (each goes to a retry tier and succeeds
// there, while the partition goes on). Each run is a fresh consumer with
// retry topics of its own, timed from its first record until the topic's
// last is done (acknowledged, whether handled or sent to a tier); the two
// take turns for five rounds, and it reports the round with the median
// ratio of the failing run's throughput to the clean one's (goal >= 0.9).
//
//	go test -run '^$' -bench BenchmarkRetryTopicsThroughput -benchtime 1x ./kafka/
func BenchmarkRetryTopicsThroughput(b *testing.B) {
	const records, rounds = 3000, 5
	br := benchBroker(b)
	topic := newTopic(b, br, "bench-retry", 1)
	msgs := make([]consumer.Message, records)
	for i := range msgs {
		msgs[i] = consumer.Message{Key: "key-" + strconv.Itoa(i%100), Body: []byte(strconv.Itoa(i))}
	}
	if err := br.Publish(context.Background(), topic, msgs...); err != nil {
		b.Fatal(err)
	}
	run := func(failing bool) time.Duration {
		id := testenv.UniqueName(b, "retry")
		rc, err := br.NewRetryingConsumer(b.Context(), topic, kafka.RetryTopics{
			Delays:          []time.Duration{100 * time.Millisecond},
			DeadLetterTopic: id + ".dlq",
			GiveUpOrder:     true,
			TopicName:       func(string, int) string { return id + ".retry" },
		}, consumer.WithName(id), consumer.WithLogger(quiet))
		if err != nil {
			b.Fatal(err)
		}
		defer func() {
			for _, t := range append(rc.Topics(), id+".dlq") {
				_ = br.DeleteTopic(context.Background(), t)
			}
		}()
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var started atomic.Int64
		done := make(chan error, 1)
		go func() {
			done <- rc.Run(ctx, consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
				started.CompareAndSwap(0, time.Now().UnixNano())
				time.Sleep(time.Millisecond)
				if seq, _ := strconv.Atoi(string(m.Body)); failing && m.Source == topic && seq%100 == 0 {
					return errors.New("fails on the topic")
				}
				return nil
			}))
		}()
		main := rc.Loops()[0]
		for main.Stats().Acked < records {
			select {
			case err := <-done:
				b.Fatalf("Run ended early: %v", err)
			case <-time.After(2 * time.Millisecond):
			}
		}
		took := time.Since(time.Unix(0, started.Load()))
		cancel()
		if err := <-done; err != nil {
			b.Fatal(err)
		}
		return took
	}
	b.ResetTimer()
	for range b.N {
		type round struct{ clean, failing time.Duration }
		var rs []round
		for range rounds {
			rs = append(rs, round{run(false), run(true)})
		}
		ratio := func(r round) float64 { return r.clean.Seconds() / r.failing.Seconds() }
		slices.SortFunc(rs, func(x, y round) int { return cmp.Compare(ratio(x), ratio(y)) })
		for _, r := range rs {
			b.Logf("clean %s, failing %s: %.3f", r.clean.Round(time.Millisecond), r.failing.Round(time.Millisecond), ratio(r))
		}
		med := rs[len(rs)/2]
		b.ReportMetric(float64(records)/med.clean.Seconds(), "clean-msgs/s")
		b.ReportMetric(float64(records)/med.failing.Seconds(), "failing-msgs/s")
		b.ReportMetric(ratio(med), "failing/clean")
	}
}
