package bench

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/ferrytest"
	"github.com/ferrymq/ferry/kafka"
)

// KafkaPartitions is the partitions of every benchmark topic (but the
// key-order one's).
const KafkaPartitions = 6

// KeyRecords is how many records the key-order comparison handles.
var KeyRecords = 1000

// KafkaSuite compares Ferry's Kafka consumer and publisher with franz-go
// alone and with watermill-kafka (Sarama) on topics of KafkaPartitions
// partitions. Each consume variant reads a fresh topic filled with the same
// numbered records (keyed over 1000 keys) as a fresh consumer group.
func KafkaSuite(seeds []string, run string) (*Suite, error) {
	br, err := kafka.New(seeds, kafka.WithLogger(quiet))
	if err != nil {
		return nil, err
	}
	producer, err := kgo.NewClient(kgo.SeedBrokers(seeds...), kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.MaxBufferedRecords(100_000), kgo.ProducerLinger(5*time.Millisecond),
		kgo.MetadataMinAge(100*time.Millisecond)) // each fill is to a new topic
	if err != nil {
		br.Close()
		return nil, err
	}
	var seq atomic.Int64
	var mu sync.Mutex
	var topics []string
	name := func(p string) string { return fmt.Sprintf("ferry-bench-%s-%s-%d", run, p, seq.Add(1)) }
	// create makes a topic through the Admin contract, which waits until
	// every partition has a leader: a client that looks the topic up
	// earlier caches it half-made and waits for its next metadata refresh
	// (seconds) before producing to the rest. Its replication factor is the
	// cluster's default (1 on the single-node integration broker).
	create := func(ctx context.Context, p string, partitions int) (string, error) {
		t := name(p)
		ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		if err := br.CreateSource(ctx, t, consumer.SourceConfig{Partitions: partitions}); err != nil {
			return "", fmt.Errorf("create topic %s: %w", t, err)
		}
		mu.Lock()
		topics = append(topics, t)
		mu.Unlock()
		return t, nil
	}
	s := &Suite{Broker: ferrytest.Kafka}
	s.Close = func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		mu.Lock()
		for _, t := range topics {
			_ = br.DeleteSource(ctx, t)
		}
		mu.Unlock()
		producer.Close()
		br.Close()
	}
	fill := func(ctx context.Context, topic string, n int, key func(int) string) error {
		var failed atomic.Value
		for i := range n {
			producer.Produce(ctx, &kgo.Record{Topic: topic, Key: []byte(key(i)), Value: Body(i),
				Headers: []kgo.RecordHeader{{Key: WatermillUUIDHeader, Value: []byte(UUID(i))}}},
				func(_ *kgo.Record, err error) {
					if err != nil {
						failed.Store(err)
					}
				})
		}
		if err := producer.Flush(ctx); err != nil {
			return err
		}
		if err, _ := failed.Load().(error); err != nil {
			return err
		}
		return nil
	}
	s.Fill = func(ctx context.Context, n int) (Source, error) {
		t, err := create(ctx, "consume", KafkaPartitions)
		if err != nil {
			return Source{}, err
		}
		return Source{Name: t, N: n}, fill(ctx, t, n, func(i int) string { return "key-" + strconv.Itoa(i%1000) })
	}
	dlq, err := create(context.Background(), "dlq", 1)
	if err != nil {
		s.Close()
		return nil, err
	}

	ferryConsume := func(full bool) Consumer {
		return func(ctx context.Context, src Source, tr *Tracker) error {
			loop, err := br.NewConsumer(ctx, src.Name, consumer.WithName(name("ferry")),
				consumer.WithConcurrency(Concurrency), consumer.WithMaxInFlight(20_000), consumer.WithFetchBatch(5_000),
				consumer.WithLogger(quiet))
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
	// The raw loop: PollRecords, handle each record, commit what was
	// polled (synchronously), again, as one group member.
	rawConsume := func(ctx context.Context, src Source, tr *Tracker) error {
		cl, err := kgo.NewClient(kgo.SeedBrokers(seeds...), kgo.ConsumeTopics(src.Name),
			kgo.ConsumerGroup(name("raw")), kgo.DisableAutoCommit(),
			kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
		if err != nil {
			return err
		}
		defer cl.Close()
		for {
			select {
			case <-tr.Done():
				return nil
			default:
			}
			fs := cl.PollRecords(ctx, 10_000)
			if err := fs.Err0(); err != nil {
				return fmt.Errorf("%w: handled %d of %d", err, tr.Distinct(), src.N)
			}
			recs := fs.Records()
			for _, r := range recs {
				tr.Mark(r.Value)
			}
			if err := cl.CommitRecords(ctx, recs...); err != nil {
				return err
			}
		}
	}
	saramaVersion := sarama.V2_8_0_0
	wmPublisher := func() (*wmkafka.Publisher, error) {
		cfg := wmkafka.DefaultSaramaSyncPublisherConfig()
		cfg.Version = saramaVersion
		cfg.Producer.RequiredAcks = sarama.WaitForAll // as Ferry and the raw producer
		return wmkafka.NewPublisher(wmkafka.PublisherConfig{Brokers: seeds, Marshaler: wmkafka.DefaultMarshaler{}, OverwriteSaramaConfig: cfg}, watermill.NopLogger{})
	}
	wmConsume := func(full bool) Consumer {
		return func(ctx context.Context, src Source, tr *Tracker) error {
			cfg := wmkafka.DefaultSaramaSubscriberConfig()
			cfg.Version = saramaVersion
			cfg.Consumer.Offsets.Initial = sarama.OffsetOldest
			sub, err := wmkafka.NewSubscriber(wmkafka.SubscriberConfig{Brokers: seeds, Unmarshaler: wmkafka.DefaultMarshaler{},
				ConsumerGroup: name("watermill"), OverwriteSaramaConfig: cfg}, watermill.NopLogger{})
			if err != nil {
				return err
			}
			defer sub.Close()
			var pub message.Publisher = noPublisher{}
			if full {
				p, err := wmPublisher()
				if err != nil {
					return err
				}
				defer p.Close()
				pub = p
			}
			return watermillRouter(ctx, sub, src.Name, pub, dlq, full, tr)
		}
	}
	// warm writes a record to every partition of topic through the fill
	// producer (which refreshes metadata fast). A partition's leader in
	// the metadata may not lead yet on the broker; a publisher whose first
	// record there is refused waits for its next metadata refresh (5 s),
	// which showed as 6 s publish rounds. A warmed partition has led once.
	warm := func(ctx context.Context, topic string) error {
		seen := map[int32]bool{}
		for i := 0; len(seen) < KafkaPartitions; i++ {
			if i == 1000 {
				return fmt.Errorf("warm %s: no record reached %d of its partitions", topic, KafkaPartitions-len(seen))
			}
			r := &kgo.Record{Topic: topic, Key: []byte("warm-" + strconv.Itoa(i))}
			if err := producer.ProduceSync(ctx, r).FirstErr(); err != nil {
				return fmt.Errorf("warm %s: %w", topic, err)
			}
			seen[r.Partition] = true
		}
		return nil
	}
	publish := func(impl Impl) Publisher {
		return func(ctx context.Context, n int) (func(context.Context) error, func(), error) {
			t, err := create(ctx, "publish", KafkaPartitions)
			if err == nil {
				err = warm(ctx, t)
			}
			if err != nil {
				return nil, nil, err
			}
			switch impl {
			case Ferry:
				if err := br.Publish(ctx, t, consumer.Message{Key: "warm-up", Body: Body(0)}); err != nil {
					return nil, nil, err
				}
				return func(ctx context.Context) error {
					return parallel(ctx, PublishParallel, n, 100, func(ctx context.Context, lo, hi int) error {
						return br.Publish(ctx, t, ferryMessages(lo, hi)...)
					})
				}, func() {}, nil
			case Raw:
				// A producer of its own, as a service has, warmed up on t.
				cl, err := kgo.NewClient(kgo.SeedBrokers(seeds...), kgo.RequiredAcks(kgo.AllISRAcks()), kgo.DefaultProduceTopic(t))
				if err != nil {
					return nil, nil, err
				}
				if err := cl.ProduceSync(ctx, &kgo.Record{Key: []byte("warm-up"), Value: Body(0)}).FirstErr(); err != nil {
					cl.Close()
					return nil, nil, err
				}
				return func(ctx context.Context) error {
					return parallel(ctx, PublishParallel, n, 100, func(ctx context.Context, lo, hi int) error {
						recs := make([]*kgo.Record, 0, hi-lo)
						for i := lo; i < hi; i++ {
							// The records Ferry sends: its message id travels in a header.
							recs = append(recs, &kgo.Record{Key: []byte("key-" + strconv.Itoa(i%1000)), Value: Body(i),
								Headers: []kgo.RecordHeader{{Key: kafka.HeaderMessageID, Value: []byte(UUID(i))}}})
						}
						return cl.ProduceSync(ctx, recs...).FirstErr()
					})
				}, cl.Close, nil
			default:
				p, err := wmPublisher()
				if err != nil {
					return nil, nil, err
				}
				if err := p.Publish(t, message.NewMessage("warm-up", Body(0))); err != nil {
					p.Close()
					return nil, nil, err
				}
				return func(ctx context.Context) error {
					return parallel(ctx, PublishParallel, n, 100, func(ctx context.Context, lo, hi int) error {
						return p.Publish(t, wmMessages(lo, hi)...)
					})
				}, func() { p.Close() }, nil
			}
		}
	}
	// Key order against partition order: KeyRecords records of 100 keys on
	// one partition, a 5 ms handler, concurrency 64.
	keyFill := func(ctx context.Context) (Source, error) {
		t, err := create(ctx, "keys", 1)
		if err != nil {
			return Source{}, err
		}
		return Source{Name: t, N: KeyRecords}, fill(ctx, t, KeyRecords, func(i int) string { return "key-" + strconv.Itoa(i%100) })
	}
	ordered := func(o consumer.Ordering) Consumer {
		return func(ctx context.Context, src Source, tr *Tracker) error {
			loop, err := br.NewConsumer(ctx, src.Name, consumer.WithName(name("keys")),
				consumer.WithConcurrency(64), consumer.WithOrdering(o), consumer.WithLogger(quiet))
			if err != nil {
				return err
			}
			h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
				time.Sleep(5 * time.Millisecond)
				tr.Mark(m.Body)
				return nil
			})
			return runFerry(ctx, loop, h, tr)
		}
	}
	s.Variants = []Variant{
		{Op: ConsumeNoop, Impl: Ferry, Consume: ferryConsume(false)},
		{Op: ConsumeNoop, Impl: Raw, Consume: rawConsume},
		{Op: ConsumeNoop, Impl: Watermill, Consume: wmConsume(false)},
		{Op: ConsumeFull, Impl: Ferry, Consume: ferryConsume(true)},
		{Op: ConsumeFull, Impl: Watermill, Consume: wmConsume(true)},
		{Op: Publish, Impl: Ferry, Publish: publish(Ferry)},
		{Op: Publish, Impl: Raw, Publish: publish(Raw)},
		{Op: Publish, Impl: Watermill, Publish: publish(Watermill)},
		{Op: ByPartition, Impl: Ferry, Consume: ordered(consumer.OrderByLane), Fill: keyFill},
		{Op: ByKey, Impl: Ferry, Consume: ordered(consumer.OrderByKey), Fill: keyFill},
	}
	s.Notes = append(s.Notes,
		"kafka: the raw loop is one franz-go group member: PollRecords, handle, CommitRecords (synchronous), again.",
		"kafka: watermill-kafka (Sarama) handles one message at a time per partition, waiting for its ack, so its parallelism is the partition count (6).",
		"kafka: publish is 8 goroutines each sending calls of 100 records and waiting for their acks (acks=all for all three; Sarama's producer is not idempotent, franz-go's and Ferry's are). The raw client's call is ProduceSync, and its records are Ferry's: key, value and the message id header.",
		fmt.Sprintf("kafka: the key-order rows handle %d records of 100 keys on one partition with a 5 ms handler at concurrency 64, Ferry only.", KeyRecords))
	return s, nil
}

// PublishParallel is how many goroutines publish at once.
const PublishParallel = 8

// noPublisher is the Watermill publisher of a no-op run (nothing is
// published).
type noPublisher struct{}

func (noPublisher) Publish(string, ...*message.Message) error { return nil }
func (noPublisher) Close() error                              { return nil }
