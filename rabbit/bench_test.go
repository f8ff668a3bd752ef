package rabbit_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/rabbit"
)

// The benchmarks compare Ferry with raw amqp091 on the same broker, in the
// same run, on one quorum queue per run. Use -benchtime=200000x for 200k
// messages; the ratios are reported as metrics (ferry/raw).

const (
	benchPrefetch = 256 // consume: the raw consumer's prefetch and Ferry's MaxInFlight (and 4 times it)
	benchWindow   = 512 // publish: unconfirmed messages in flight, both
	benchBody     = 64
)

var benchLogger = slog.New(slog.NewTextHandler(io.Discard, nil))

func benchQueue(b *testing.B) (string, *rabbit.Broker) {
	name := testenv.UniqueName(b, "bench")
	deleteLater(b, []string{name, name + ".dlq"}, nil)
	br, err := rabbit.Dial(amqpURL(b), rabbit.WithLogger(benchLogger), rabbit.WithConfirmWindow(benchWindow),
		rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{
			{Name: name, DeadLetterExchange: ""}, {Name: name + ".dlq", DeadLetterExchange: ""}}}))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { br.Close() })
	return name, br
}

// rawConn is a plain amqp091 connection.
func rawConn(b *testing.B) *amqp.Connection {
	conn, err := amqp.DialConfig(amqpURL(b), amqp.Config{Dial: amqp.DefaultDial(5 * time.Second)})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { conn.CloseDeadline(time.Now().Add(time.Second)) })
	return conn
}

// rawPublish publishes n messages to queue with raw amqp091: confirm mode,
// deferred confirmations, at most window unconfirmed, persistent, mandatory,
// with a message id, as Ferry publishes.
func rawPublish(b *testing.B, conn *amqp.Connection, queue string, n int) {
	ch, err := conn.Channel()
	if err != nil {
		b.Fatal(err)
	}
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		b.Fatal(err)
	}
	returns := ch.NotifyReturn(make(chan amqp.Return, 1))
	go func() {
		for range returns {
		}
	}()
	body := make([]byte, benchBody)
	ring := make([]*amqp.DeferredConfirmation, 0, benchWindow)
	now := time.Now()
	for i := range n {
		if len(ring) == benchWindow {
			if !ring[0].Wait() {
				b.Fatal("nacked")
			}
			ring = ring[1:]
		}
		dc, err := ch.PublishWithDeferredConfirm("", queue, true, false, amqp.Publishing{
			DeliveryMode: amqp.Persistent, MessageId: "raw-" + itoa(i), Timestamp: now, Body: body})
		if err != nil {
			b.Fatal(err)
		}
		ring = append(ring, dc)
	}
	for _, dc := range ring {
		if !dc.Wait() {
			b.Fatal("nacked")
		}
	}
}

func itoa(i int) string {
	var buf [20]byte
	p := len(buf)
	for {
		p--
		buf[p] = byte('0' + i%10)
		if i /= 10; i == 0 {
			break
		}
	}
	return string(buf[p:])
}

// ferryPublish publishes n messages through Broker.Publish, calls of 1000
// messages from 2 goroutines sharing the Broker's window (one alone would
// idle the window at the end of each call).
func ferryPublish(b *testing.B, br *rabbit.Broker, queue string, n int) {
	const perCall, workers = 1000, 2
	body := make([]byte, benchBody)
	var next atomic.Int64
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			batch := make([]consumer.Message, 0, perCall)
			for {
				start := int(next.Add(perCall)) - perCall
				if start >= n {
					return
				}
				batch = batch[:0]
				for i := start; i < min(start+perCall, n); i++ {
					batch = append(batch, consumer.Message{Body: body})
				}
				if err := br.Publish(context.Background(), queue, batch...); err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
}

// rawConsume consumes n messages with raw amqp091: prefetch benchPrefetch,
// manual acks, one ack per message.
func rawConsume(b *testing.B, conn *amqp.Connection, queue string, n, prefetch int) {
	ch, err := conn.Channel()
	if err != nil {
		b.Fatal(err)
	}
	defer ch.Close()
	if err := ch.Qos(prefetch, 0, false); err != nil {
		b.Fatal(err)
	}
	ds, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		b.Fatal(err)
	}
	for range n {
		d := <-ds
		if err := d.Ack(false); err != nil {
			b.Fatal(err)
		}
	}
}

// ferryConsume consumes n messages through a consumer.Loop with
// MaxInFlight benchPrefetch, concurrency 8, running h (wrapped in the
// Standard stack when standard is set).
func ferryConsume(b *testing.B, br *rabbit.Broker, queue string, n, prefetch int, standard bool) {
	c, err := br.NewConsumer(b.Context(), queue, consumer.WithConcurrency(8), consumer.WithMaxInFlight(prefetch), consumer.WithLogger(benchLogger))
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
	if standard {
		st, err := consumer.Standard(br, queue+".dlq")
		if err != nil {
			b.Fatal(err)
		}
		h = st.Wrap(h)
	}
	if err := c.Run(ctx, h); err != nil {
		b.Fatal(err)
	}
	if got := handled.Load(); got < int64(n) {
		b.Fatalf("handled %d of %d", got, n)
	}
}

// BenchmarkPublishConfirmed publishes b.N messages with raw amqp091 and
// b.N with Ferry, on the same broker in the same run, in four interleaved
// rounds each (so that drift in the broker's speed hits both alike), and
// reports both rates and their ratio.
func BenchmarkPublishConfirmed(b *testing.B) {
	queue, br := benchQueue(b)
	conn := rawConn(b)
	// Warm up both paths (connections, channels, the queue).
	rawPublish(b, conn, queue, 1000)
	ferryPublish(b, br, queue, 1000)
	b.ResetTimer()
	var rawT, ferryT time.Duration
	rounds := min(8, b.N)
	for r := range rounds {
		n := b.N/rounds + b.N%rounds*btoi(r == 0)
		start := time.Now()
		rawPublish(b, conn, queue, n)
		rawT += time.Since(start)
		start = time.Now()
		ferryPublish(b, br, queue, n)
		ferryT += time.Since(start)
	}
	b.StopTimer()
	raw, ferry := float64(b.N)/rawT.Seconds(), float64(b.N)/ferryT.Seconds()
	b.ReportMetric(raw, "raw-msgs/s")
	b.ReportMetric(ferry, "ferry-msgs/s")
	b.ReportMetric(ferry/raw, "ferry/raw")
}

func btoi(v bool) int {
	if v {
		return 1
	}
	return 0
}

// BenchmarkConsume consumes b.N messages with raw amqp091, b.N with Ferry's
// loop and a no-op handler, and b.N with Ferry's loop and the Standard
// stack, on the same queue in the same run: four rounds, each publishing a
// quarter of the messages before each consumer takes them (publishing is
// not timed), so that drift in the broker's speed hits all three alike. It
// reports the three rates and the ratios to raw.
func BenchmarkConsume(b *testing.B) {
	for _, prefetch := range []int{benchPrefetch, 4 * benchPrefetch} {
		b.Run(fmt.Sprintf("prefetch=%d", prefetch), func(b *testing.B) { benchConsume(b, prefetch) })
	}
}

func benchConsume(b *testing.B, prefetch int) {
	queue, br := benchQueue(b)
	conn := rawConn(b)
	b.ResetTimer()
	b.StopTimer()
	var rawT, noopT, stdT time.Duration
	rounds := min(4, b.N)
	timed := func(n int, d *time.Duration, f func(n int)) {
		rawPublish(b, conn, queue, n)
		start := time.Now()
		f(n)
		*d += time.Since(start)
	}
	for r := range rounds {
		n := b.N/rounds + b.N%rounds*btoi(r == 0)
		timed(n, &rawT, func(n int) { rawConsume(b, conn, queue, n, prefetch) })
		timed(n, &noopT, func(n int) { ferryConsume(b, br, queue, n, prefetch, false) })
		timed(n, &stdT, func(n int) { ferryConsume(b, br, queue, n, prefetch, true) })
	}
	raw, noop, std := float64(b.N)/rawT.Seconds(), float64(b.N)/noopT.Seconds(), float64(b.N)/stdT.Seconds()
	b.ReportMetric(raw, "raw-msgs/s")
	b.ReportMetric(noop, "noop-msgs/s")
	b.ReportMetric(std, "standard-msgs/s")
	b.ReportMetric(noop/raw, "noop/raw")
	b.ReportMetric(std/raw, "standard/raw")
}
