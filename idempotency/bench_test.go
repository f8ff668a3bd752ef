package idempotency_test

import (
	"context"
	"strconv"
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
	mw, err := idempotency.New(idempotency.NewMemoryStore(), "bench")
	if err != nil {
		b.Fatal(err)
	}
	h := mw(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }))
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
