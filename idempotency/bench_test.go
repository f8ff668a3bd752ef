package idempotency_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
)

// BenchmarkMemoryClaimComplete measures the memory store's cycle.
func BenchmarkMemoryClaimComplete(b *testing.B) {
	s := idempotency.NewMemoryStore()
	ctx := context.Background()
	b.ReportAllocs()
	i := 0
	start := time.Now()
	for b.Loop() {
		key := strconv.Itoa(i)
		i++
		cl, err := s.Claim(ctx, key, time.Minute)
		if err != nil {
			b.Fatal(err)
		}
		if err := s.Complete(ctx, key, cl.Token, time.Hour); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(i)/time.Since(start).Seconds(), "cycles/s")
}

// BenchmarkMiddlewareDuplicate measures acking a duplicate of a completed key
// (the memory store): the cost of a redelivery that does no work.
func BenchmarkMiddlewareDuplicate(b *testing.B) {
	dedup, err := idempotency.New(idempotency.NewMemoryStore(), "bench")
	if err != nil {
		b.Fatal(err)
	}
	h := dedup.Wrap(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }))
	m := &consumer.Message{ID: "m", Headers: map[string]string{idempotency.EventIDHeader: "ev"}}
	ctx := context.Background()
	if err := h.Handle(ctx, m); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	n := 0
	start := time.Now()
	for b.Loop() {
		if err := h.Handle(ctx, m); err != nil {
			b.Fatal(err)
		}
		n++
	}
	b.ReportMetric(float64(n)/time.Since(start).Seconds(), "msgs/s")
}

// BenchmarkMiddlewareFirstDelivery measures the middleware over the memory
// store on first deliveries (claim, run, complete) from parallel goroutines:
// the work idempotency adds to every new message. Making each message's
// fresh id costs the benchmark itself one allocation per op.
func BenchmarkMiddlewareFirstDelivery(b *testing.B) {
	dedup, err := idempotency.New(idempotency.NewMemoryStore(), "bench")
	if err != nil {
		b.Fatal(err)
	}
	h := dedup.Wrap(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }))
	var seq atomic.Int64
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		ctx := context.Background()
		m := &consumer.Message{ID: "m", Headers: map[string]string{idempotency.EventIDHeader: ""}}
		for pb.Next() {
			m.Headers[idempotency.EventIDHeader] = strconv.FormatInt(seq.Add(1), 36)
			if err := h.Handle(ctx, m); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
}
