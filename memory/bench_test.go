package memory_test

import (
	"context"
	"io"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/memory"
)

// prepublish puts n messages with a 64-byte body on the queue, in batches.
func prepublish(b *testing.B, br *memory.Broker, queue string, n int) {
	b.Helper()
	batch := make([]consumer.Message, 0, 256)
	body := make([]byte, 64)
	for n > 0 {
		batch = batch[:0]
		for i := 0; i < min(n, cap(batch)); i++ {
			batch = append(batch, consumer.Message{Body: body})
		}
		if err := br.Publish(context.Background(), queue, batch...); err != nil {
			b.Fatal(err)
		}
		n -= len(batch)
	}
}

// BenchmarkConsume measures the whole path fetch → handler → ack through a
// consumer.Loop at concurrency 8 with a handler that does nothing.
func BenchmarkConsume(b *testing.B) {
	br, err := memory.New()
	if err != nil {
		b.Fatal(err)
	}
	defer br.Close()
	prepublish(b, br, "bench", b.N)
	loop, err := br.NewConsumer(b.Context(), "bench",
		consumer.WithConcurrency(8),
		consumer.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var handled atomic.Int64
	n := int64(b.N)
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		if handled.Add(1) == n {
			cancel()
		}
		return nil
	})

	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	if err := loop.Run(ctx, h); err != nil {
		b.Fatal(err)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	if st := br.Stats("bench"); st.Acked != n {
		b.Fatalf("acked %d of %d", st.Acked, n)
	}
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
}

// BenchmarkConsumeFullStack is BenchmarkConsume with the handler wrapped as
// a service team wraps it: the Standard stack (dead letter, retry, breaker,
// timeout, recover) around idempotency over the in-memory store. It consumes
// the same messages as BenchmarkConsume; each is claimed and completed under
// its broker message id (idempotency's key when no EventIDHeader is set).
// Its msgs/s against BenchmarkConsume's is the cost of the safety.
func BenchmarkConsumeFullStack(b *testing.B) {
	br, err := memory.New()
	if err != nil {
		b.Fatal(err)
	}
	defer br.Close()
	prepublish(b, br, "bench", b.N)
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	loop, err := br.NewConsumer(b.Context(), "bench", consumer.WithConcurrency(8), consumer.WithLogger(quiet))
	if err != nil {
		b.Fatal(err)
	}
	stack, err := consumer.Standard(br, "bench-dlq", consumer.StandardDeadLetter(consumer.DeadLetterLogger(quiet)))
	if err != nil {
		b.Fatal(err)
	}
	dedup, err := idempotency.New(idempotency.NewMemoryStore(), "billing", idempotency.WithLogger(quiet))
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var handled atomic.Int64
	n := int64(b.N)
	h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		if handled.Add(1) == n {
			cancel()
		}
		return nil
	}), stack.Wrap, dedup.Wrap)

	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	if err := loop.Run(ctx, h); err != nil {
		b.Fatal(err)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	if st := br.Stats("bench"); st.Acked != n {
		b.Fatalf("acked %d of %d", st.Acked, n)
	}
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
}

// BenchmarkFetchAck measures the broker alone: fetch a batch of 32, ack it,
// as the loop does.
func BenchmarkFetchAck(b *testing.B) {
	br, err := memory.New()
	if err != nil {
		b.Fatal(err)
	}
	defer br.Close()
	prepublish(b, br, "bench", b.N)
	d, err := br.Driver(b.Context(), "bench", driver.Config{})
	if err != nil {
		b.Fatal(err)
	}
	defer d.Close()
	ctx := context.Background()
	var ms []driver.Message
	var ss []driver.Settlement
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	for done := 0; done < b.N; {
		ms, err = d.Fetch(ctx, ms[:0], min(32, b.N-done))
		if err != nil {
			b.Fatal(err)
		}
		ss = ss[:0]
		for _, m := range ms {
			ss = append(ss, driver.Settlement{Handle: m.Handle, Action: driver.Ack})
		}
		if err := d.Settle(ctx, ss); err != nil {
			b.Fatal(err)
		}
		done += len(ms)
	}
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "msgs/s")
}

// BenchmarkPublish measures Publish in batches of 32 messages of 64 bytes.
func BenchmarkPublish(b *testing.B) {
	br, err := memory.New()
	if err != nil {
		b.Fatal(err)
	}
	defer br.Close()
	batch := make([]consumer.Message, 32)
	for i := range batch {
		batch[i] = consumer.Message{Body: make([]byte, 64)}
	}
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	for done := 0; done < b.N; done += len(batch) {
		if err := br.Publish(ctx, "bench", batch[:min(len(batch), b.N-done)]...); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "msgs/s")
}
