package consumer_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/memory"
)

type nopPublisher struct{}

func (nopPublisher) Publish(context.Context, string, ...consumer.Message) error { return nil }

var nopHandler = consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })

// BenchmarkStandardStackOverhead measures what the standard stack adds to one
// successful message, calling the wrapped handler directly: the ns/op and
// allocs/op are the middleware's own cost per message. "no-timeout" leaves
// out the per-message deadline, whose context and timer are most of it.
func BenchmarkStandardStackOverhead(b *testing.B) {
	for _, c := range []struct {
		name string
		opts []consumer.StandardOption
	}{
		{"default", nil},
		{"no-timeout", []consumer.StandardOption{consumer.StandardTimeout(0)}},
	} {
		b.Run(c.name, func(b *testing.B) {
			st, err := consumer.Standard(nopPublisher{}, "dlq", c.opts...)
			if err != nil {
				b.Fatal(err)
			}
			h := st.Wrap(nopHandler)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			m := &consumer.Message{ID: "1", Body: []byte("x"), Attempt: 1, Offset: -1}
			b.ReportAllocs()
			for b.Loop() {
				if err := h.Handle(ctx, m); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
		})
	}
}

// BenchmarkStandardStackOverMemory runs b.N messages through a delivery loop
// over the memory broker, with a bare handler and with the standard stack
// around it, and no failures. The difference between the two is what the
// middleware adds per message in a real loop; allocs/op counts every
// allocation of the process per message, the loop's and the broker's
// included.
func BenchmarkStandardStackOverMemory(b *testing.B) {
	for _, c := range []struct {
		name string
		wrap func(consumer.Handler) consumer.Handler
	}{
		{"bare", func(h consumer.Handler) consumer.Handler { return h }},
		{"standard", func(h consumer.Handler) consumer.Handler {
			st, err := consumer.Standard(nopPublisher{}, "dlq")
			if err != nil {
				b.Fatal(err)
			}
			return st.Wrap(h)
		}},
	} {
		b.Run(c.name, func(b *testing.B) {
			broker, err := memory.New()
			if err != nil {
				b.Fatal(err)
			}
			defer broker.Close()
			msgs := make([]consumer.Message, 0, 1000)
			for i := 0; i < b.N; i++ {
				msgs = append(msgs, consumer.Message{ID: strconv.Itoa(i), Body: []byte("payload")})
				if len(msgs) == cap(msgs) || i == b.N-1 {
					if err := broker.Publish(context.Background(), "bench", msgs...); err != nil {
						b.Fatal(err)
					}
					msgs = msgs[:0]
				}
			}
			loop, err := broker.NewConsumer(b.Context(), "bench", consumer.WithLogger(quiet))
			if err != nil {
				b.Fatal(err)
			}
			var n atomic.Int64
			all := make(chan struct{})
			h := c.wrap(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
				if n.Add(1) == int64(b.N) {
					close(all)
				}
				return nil
			}))
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			b.ReportAllocs()
			b.ResetTimer()
			start := time.Now()
			go func() { done <- loop.Run(ctx, h) }()
			<-all
			elapsed := time.Since(start)
			b.StopTimer()
			cancel()
			if err := <-done; err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
		})
	}
}
