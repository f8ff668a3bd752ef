package kafka

import (
	"context"
	"io"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
)

// driverBenchRecords is how many records BenchmarkDriverFetchSettle
// moves: FERRY_KAFKA_DRIVER_BENCH_RECORDS, default 300,000.
func driverBenchRecords(b *testing.B) int {
	if v := os.Getenv("FERRY_KAFKA_DRIVER_BENCH_RECORDS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n <= 0 {
			b.Fatalf("FERRY_KAFKA_DRIVER_BENCH_RECORDS=%q", v)
		}
		return n
	}
	return 300_000
}

// usage is what the process used so far: objects and bytes allocated,
// CPU time, and wall time.
type usage struct {
	objects, bytes uint64
	cpu, wall      time.Duration
}

// readUsage is usage now. ReadMemStats stops the world, once at each end of a
// read: it costs nothing per record.
func readUsage() usage {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return usage{objects: ms.Mallocs, bytes: ms.TotalAlloc, cpu: cpuTime(), wall: time.Duration(time.Now().UnixNano())}
}

func (u usage) since(before usage) usage {
	return usage{u.objects - before.objects, u.bytes - before.bytes, u.cpu - before.cpu, u.wall - before.wall}
}

func (u *usage) add(v usage) {
	u.objects += v.objects
	u.bytes += v.bytes
	u.cpu += v.cpu
	u.wall += v.wall
}

// BenchmarkDriverFetchSettle measures the driver alone, without the
// delivery loop: it reads a topic (6 partitions, n records of 100 bytes
// over 1000 keys, no headers, as BenchmarkConsume's) to the end twice in
// each round, each time as a fresh group member, once with franz-go alone
// (PollRecords of 5,000, nothing else) and once through the driver (Fetch
// of 5,000, then Settle acking every record in the order fetched, as the
// loop does for no-op handlers; commits on their timer). It reports what
// the driver adds per record beyond franz-go's own: allocations
// (driver-allocs/record) and bytes (driver-B/record), from the process's
// allocation counters around each read, and CPU time
// (driver-cpu-ns/record), with franz-go's own and both rates. Allocations
// and bytes are near-deterministic; CPU time less so, and the rates not at
// all on a shared machine.
//
//	go test -run '^$' -bench BenchmarkDriverFetchSettle -benchtime 3x ./kafka/
func BenchmarkDriverFetchSettle(b *testing.B) {
	seeds := testenv.RequireKafka(b)
	n := driverBenchRecords(b)
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	br, err := New(seeds, WithLogger(quiet))
	if err != nil {
		b.Fatal(err)
	}
	defer br.Close()
	ctx := context.Background()
	topic := testenv.UniqueName(b, "bench-driver")
	if err := br.CreateTopic(ctx, topic, TopicConfig{Partitions: 6}); err != nil {
		b.Fatal(err)
	}
	defer func() { _ = br.DeleteTopic(context.Background(), topic) }()
	produceBench(b, seeds, topic, n)

	var raw, drv usage
	b.ResetTimer()
	for range b.N {
		raw.add(readRaw(b, seeds, topic, n))
		drv.add(readDriver(b, br, topic, n))
	}
	b.StopTimer()
	records := float64(n) * float64(b.N)
	b.ReportMetric(float64(raw.objects)/records, "raw-allocs/record")
	b.ReportMetric(float64(raw.bytes)/records, "raw-B/record")
	b.ReportMetric((float64(drv.objects)-float64(raw.objects))/records, "driver-allocs/record")
	b.ReportMetric((float64(drv.bytes)-float64(raw.bytes))/records, "driver-B/record")
	b.ReportMetric(float64(raw.cpu.Nanoseconds())/records, "raw-cpu-ns/record")
	b.ReportMetric(float64((drv.cpu-raw.cpu).Nanoseconds())/records, "driver-cpu-ns/record")
	b.ReportMetric(records/raw.wall.Seconds(), "raw-msgs/s")
	b.ReportMetric(records/drv.wall.Seconds(), "driver-msgs/s")
}

// produceBench writes n records of 100 bytes over 1000 keys to topic.
func produceBench(b *testing.B, seeds []string, topic string, n int) {
	b.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(seeds...), kgo.DefaultProduceTopic(topic),
		kgo.RequiredAcks(kgo.AllISRAcks()), kgo.MaxBufferedRecords(100_000))
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	body := make([]byte, 100)
	keys := make([][]byte, 1000)
	for i := range keys {
		keys[i] = []byte("key-" + strconv.Itoa(i))
	}
	var failed atomic.Value
	for i := range n {
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
}

// readRaw reads topic to the end as a fresh group member with franz-go
// alone, and returns what the process used meanwhile.
func readRaw(b *testing.B, seeds []string, topic string, n int) usage {
	b.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(seeds...), kgo.ConsumeTopics(topic),
		kgo.ConsumerGroup(testenv.UniqueName(b, "raw")), kgo.DisableAutoCommit(),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	ctx := context.Background()
	before := readUsage()
	for got := 0; got < n; {
		fs := cl.PollRecords(ctx, 5000)
		if err := fs.Err0(); err != nil {
			b.Fatal(err)
		}
		got += fs.NumRecords()
	}
	return readUsage().since(before)
}

// readDriver reads topic to the end through a fresh driver, acking every
// record fetched, and returns what the process used meanwhile.
func readDriver(b *testing.B, br *Broker, topic string, n int) usage {
	b.Helper()
	d := startGroupDriver(b, br, topic, testenv.UniqueName(b, "driver"))
	defer d.Close()
	ctx := context.Background()
	if err := d.Connect(ctx); err != nil { // makes the client, as raw's is made before it reads
		b.Fatal(err)
	}
	msgs := make([]driver.Message, 0, 5000)
	acks := make([]driver.Settlement, 0, 5000)
	before := readUsage()
	var err error
	for got := 0; got < n; {
		msgs, err = d.Fetch(ctx, msgs[:0], 5000)
		if err != nil {
			b.Fatal(err)
		}
		acks = acks[:0]
		for i := range msgs {
			acks = append(acks, driver.Settlement{Handle: msgs[i].Handle, Action: driver.Ack})
		}
		if err := d.Settle(ctx, acks); err != nil {
			b.Fatal(err)
		}
		got += len(msgs)
	}
	used := readUsage().since(before)
	clear(msgs[:cap(msgs)])
	return used
}

// BenchmarkDriverMessagesAndSettle is the driver's own work per record
// without a broker or franz-go: records as a poll hands them over (6
// partitions, 100-byte values, keys over 1000, no headers) turned into
// messages 5,000 at a time, as Fetch does, and all acked in one Settle,
// as the loop settles no-op handlers. It reports the driver's cost per
// record: ns/record, cpu-ns/record (the process's CPU time, the
// collector's included), B/record and allocs/record.
//
//	go test -run '^$' -bench BenchmarkDriverMessagesAndSettle -benchmem ./kafka/
func BenchmarkDriverMessagesAndSettle(b *testing.B) {
	const topic, parts, batch = "bench-orders", 6, 5000
	d := unitDriver(topic)
	d.maxAsked = batch
	body := make([]byte, 100)
	recs := make([][]*kgo.Record, parts)
	for id := range int32(parts) {
		d.parts[id] = newPartition(id)
		for i := range batch / parts {
			k := int(id)*batch/parts + i
			recs[id] = append(recs[id], &kgo.Record{Topic: topic, Partition: id, Offset: int64(1_000_000 + i),
				Key: []byte("key-" + strconv.Itoa(k%1000)), Value: body, Timestamp: time.Now()})
		}
	}
	msgs := make([]driver.Message, 0, batch)
	acks := make([]driver.Settlement, 0, batch)
	ctx := context.Background()
	done := 0
	b.ResetTimer()
	before := readUsage()
	for done < b.N {
		msgs = msgs[:0]
		d.mu.Lock()
		for id := range int32(parts) {
			msgs = d.messages(msgs, d.parts[id], recs[id])
		}
		d.mu.Unlock()
		acks = acks[:0]
		for i := range msgs {
			acks = append(acks, driver.Settlement{Handle: msgs[i].Handle, Action: driver.Ack})
		}
		if err := d.Settle(ctx, acks); err != nil {
			b.Fatal(err)
		}
		done += len(msgs)
	}
	used := readUsage().since(before)
	b.StopTimer()
	b.ReportMetric(float64(used.wall.Nanoseconds())/float64(done), "ns/record")
	b.ReportMetric(float64(used.cpu.Nanoseconds())/float64(done), "cpu-ns/record")
	b.ReportMetric(float64(used.bytes)/float64(done), "B/record")
	b.ReportMetric(float64(used.objects)/float64(done), "allocs/record")
}
