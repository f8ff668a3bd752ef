package consumer

import (
	"context"
	"testing"
	"time"
)

// These benchmarks measure one layer of the standard stack at a time, on a
// message that succeeds at once, with the delivery's record already in the
// context as the delivery loop gives it: what each layer costs per message
// of its own, without the allocation a record costs outside a loop.

// loopCtx returns a context that carries a record, as a delivery's does.
func loopCtx() context.Context { return &recordCtx{Context: context.Background()} }

func benchLayer(b *testing.B, h Handler) {
	b.Helper()
	ctx := loopCtx()
	m := &Message{ID: "1", Body: []byte("x"), Attempt: 1, Offset: -1}
	b.ReportAllocs()
	for b.Loop() {
		if err := h.Handle(ctx, m); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
}

// BenchmarkTimeout is Timeout around a handler that returns at once
// (returns), asks its context whether it ended (asks-err), or waits on
// Done, which builds the channel and the timer (takes-done).
func BenchmarkTimeout(b *testing.B) {
	for _, c := range []struct {
		name string
		h    HandlerFunc
	}{
		{"returns", func(context.Context, *Message) error { return nil }},
		{"asks-err", func(ctx context.Context, _ *Message) error { return ctx.Err() }},
		{"takes-done", func(ctx context.Context, _ *Message) error {
			select {
			case <-ctx.Done():
				return ctx.Err()
			default:
				return nil
			}
		}},
	} {
		b.Run(c.name, func(b *testing.B) { benchLayer(b, Timeout(30*time.Second)(c.h)) })
	}
}

// BenchmarkBreakerClosed is a closed Breaker around a handler that succeeds:
// gobreaker's two steps and the breaker's own bookkeeping.
func BenchmarkBreakerClosed(b *testing.B) {
	br, err := NewBreaker()
	if err != nil {
		b.Fatal(err)
	}
	benchLayer(b, br.Wrap(HandlerFunc(func(context.Context, *Message) error { return nil })))
}

// BenchmarkRetrySucceeds is Retry around a handler that succeeds on its
// first run.
func BenchmarkRetrySucceeds(b *testing.B) {
	r, err := NewRetry()
	if err != nil {
		b.Fatal(err)
	}
	benchLayer(b, r.Wrap(HandlerFunc(func(context.Context, *Message) error { return nil })))
}

// BenchmarkStackInLoopContext is the whole standard stack around a handler
// that succeeds, with the record in the context as in the loop.
func BenchmarkStackInLoopContext(b *testing.B) {
	st, err := Standard(benchPublisher{}, "dlq")
	if err != nil {
		b.Fatal(err)
	}
	benchLayer(b, st.Wrap(HandlerFunc(func(context.Context, *Message) error { return nil })))
}

type benchPublisher struct{}

func (benchPublisher) Publish(context.Context, string, ...Message) error { return nil }
