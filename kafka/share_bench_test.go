package kafka_test

import (
	"context"
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

// BenchmarkShareWorkQueue is the work queue a consumer group cannot scale:
// one partition, a handler of 5 ms, 1,000 records. It handles them once
// with one consumer group member (partition order, the only order a group
// member of one partition has) and once with ten share group members of
// one handler each, checks that every record was handled exactly once in
// both, and reports the speed-up; and, for scale, the same ten members as
// raw franz-go share group clients. The members join and take warm-up
// records first (a share group's assignment reaches a member with its
// heartbeat, every 5 s): the time is from the publish of the 1,000 to the
// last one handled.
//
//	go test -run '^$' -bench BenchmarkShareWorkQueue -benchtime 1x ./kafka/
func BenchmarkShareWorkQueue(b *testing.B) {
	const records, members = 1000, 10
	classic := benchBroker(b)
	share, err := kafka.New(testenv.RequireKafka(b), kafka.WithLogger(quiet), kafka.WithGroupProtocol(kafka.Share))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = share.Close() })
	run := func(br *kafka.Broker, n int, opts ...consumer.Option) time.Duration {
		topic := newTopic(b, classic, "bench-workq", 1)
		group := testenv.UniqueName(b, "workq")
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var mu sync.Mutex
		seen := make(map[string]int, records)
		warm := make([]bool, n)
		handled := 0
		var wg sync.WaitGroup
		for i := range n {
			l, err := br.NewConsumer(b.Context(), topic, append([]consumer.Option{consumer.WithName(group), consumer.WithLogger(quiet)}, opts...)...)
			if err != nil {
				b.Fatal(err)
			}
			wg.Go(func() {
				err := l.Run(ctx, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
					time.Sleep(5 * time.Millisecond)
					mu.Lock()
					defer mu.Unlock()
					if len(m.Body) > 0 && m.Body[0] == 'w' {
						warm[i] = true
						return nil
					}
					seen[string(m.Body)]++
					if handled++; handled == records {
						cancel()
					}
					return nil
				}))
				if err != nil {
					b.Error(err)
				}
			})
		}
		// Warm-up records, a few at a time, until every member took one.
		for all := false; !all; {
			if err := br.Publish(ctx, topic, consumer.Message{Body: []byte("w")}); err != nil {
				b.Fatal(err)
			}
			time.Sleep(20 * time.Millisecond)
			mu.Lock()
			all = !slices.Contains(warm, false)
			mu.Unlock()
		}
		msgs := make([]consumer.Message, records)
		for i := range msgs {
			msgs[i] = consumer.Message{Body: []byte(strconv.Itoa(i))}
		}
		start := time.Now()
		if err := br.Publish(ctx, topic, msgs...); err != nil {
			b.Fatal(err)
		}
		wg.Wait()
		took := time.Since(start)
		for i := range records {
			if k := seen[strconv.Itoa(i)]; k != 1 {
				b.Fatalf("record %d handled %d times, want once", i, k)
			}
		}
		return took
	}
	// raw is the same work on ten franz-go share group clients: poll one
	// record, handle it, accept it (the next poll carries the
	// acknowledgement), poll again.
	raw := func() time.Duration {
		topic := newTopic(b, classic, "bench-workq-raw", 1)
		group := testenv.UniqueName(b, "workq-raw")
		setGroupConfig(b, group, map[string]string{"share.auto.offset.reset": "earliest"})
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var warm, handled atomic.Int32
		var wg sync.WaitGroup
		for range members {
			cl, err := kgo.NewClient(kgo.SeedBrokers(testenv.KafkaBrokers()...), kgo.ConsumeTopics(topic),
				kgo.ShareGroup(group), kgo.ShareMaxRecords(1), kgo.ShareMaxRecordsStrict())
			if err != nil {
				b.Fatal(err)
			}
			defer cl.Close()
			wg.Go(func() {
				warmed := false
				for ctx.Err() == nil {
					cl.PollRecords(ctx, 1).EachRecord(func(r *kgo.Record) {
						time.Sleep(5 * time.Millisecond)
						r.Ack(kgo.AckAccept)
						if string(r.Value) == "w" {
							if !warmed {
								warmed = true
								warm.Add(1)
							}
						} else if handled.Add(1) == records {
							cancel()
						}
					})
				}
			})
		}
		for warm.Load() < members {
			if err := classic.Publish(ctx, topic, consumer.Message{Body: []byte("w")}); err != nil {
				b.Fatal(err)
			}
			time.Sleep(20 * time.Millisecond)
		}
		msgs := make([]consumer.Message, records)
		for i := range msgs {
			msgs[i] = consumer.Message{Body: []byte(strconv.Itoa(i))}
		}
		start := time.Now()
		if err := classic.Publish(ctx, topic, msgs...); err != nil {
			b.Fatal(err)
		}
		wg.Wait()
		return time.Since(start)
	}
	b.ResetTimer()
	for range b.N {
		one := run(classic, 1, consumer.WithConcurrency(1))
		ten := run(share, members, consumer.WithConcurrency(1), consumer.WithMaxInFlight(1))
		tenRaw := raw()
		b.ReportMetric(records/one.Seconds(), "group-msgs/s")
		b.ReportMetric(records/ten.Seconds(), "share-msgs/s")
		b.ReportMetric(records/tenRaw.Seconds(), "raw-share-msgs/s")
		b.ReportMetric(one.Seconds()/ten.Seconds(), "speedup")
		b.ReportMetric(tenRaw.Seconds()/ten.Seconds(), "share/raw-share")
	}
}

// BenchmarkShareConsume reads the same topic (one partition, n records of
// 100 bytes: FERRY_KAFKA_SHARE_BENCH_RECORDS, default 200,000) twice in one
// run, each as a fresh share group: raw franz-go (poll at most the same
// number of records, accept them all, flush the acknowledgements, poll
// again) and a Ferry share consumer with a no-op handler and the same
// in-flight bound. It reports the rates and the ratio.
//
//	go test -run '^$' -bench BenchmarkShareConsume -benchtime 1x ./kafka/
func BenchmarkShareConsume(b *testing.B) {
	n := 200_000
	if v := os.Getenv("FERRY_KAFKA_SHARE_BENCH_RECORDS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n <= 0 {
			b.Fatalf("FERRY_KAFKA_SHARE_BENCH_RECORDS=%q", v)
		}
	}
	const inFlight = 2000
	br := benchBroker(b)
	share, err := kafka.New(testenv.RequireKafka(b), kafka.WithLogger(quiet), kafka.WithGroupProtocol(kafka.Share))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = share.Close() })
	topic := newTopic(b, br, "bench-share", 1)
	rawProduce(b, rawProducer(b, topic), n)
	n++ // the warm-up record
	raw := func() time.Duration {
		group := testenv.UniqueName(b, "raw-share")
		setGroupConfig(b, group, map[string]string{"share.auto.offset.reset": "earliest"})
		cl, err := kgo.NewClient(kgo.SeedBrokers(testenv.KafkaBrokers()...), kgo.ConsumeTopics(topic),
			kgo.ShareGroup(group), kgo.ShareMaxRecords(inFlight), kgo.ShareMaxRecordsStrict())
		if err != nil {
			b.Fatal(err)
		}
		defer cl.Close()
		ctx := context.Background()
		start := time.Now()
		for got := 0; got < n; {
			fs := cl.PollRecords(ctx, inFlight)
			if err := fs.Err0(); err != nil {
				b.Fatal(err)
			}
			fs.EachRecord(func(r *kgo.Record) { r.Ack(kgo.AckAccept); got++ })
			if err := cl.FlushAcks(ctx); err != nil {
				b.Fatal(err)
			}
		}
		return time.Since(start)
	}
	ferry := func() time.Duration {
		l, err := share.NewConsumer(b.Context(), topic, consumer.WithName(testenv.UniqueName(b, "ferry-share")),
			consumer.WithConcurrency(8), consumer.WithMaxInFlight(inFlight), consumer.WithFetchBatch(inFlight), consumer.WithLogger(quiet))
		if err != nil {
			b.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var handled atomic.Int64
		start := time.Now()
		err = l.Run(ctx, consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
			if handled.Add(1) == int64(n) {
				cancel()
			}
			return nil
		}))
		if err != nil {
			b.Fatal(err)
		}
		return time.Since(start)
	}
	b.ResetTimer()
	for range b.N {
		r, f := raw(), ferry()
		b.ReportMetric(float64(n)/r.Seconds(), "raw-msgs/s")
		b.ReportMetric(float64(n)/f.Seconds(), "ferry-msgs/s")
		b.ReportMetric(r.Seconds()/f.Seconds(), "ferry/raw")
	}
}
