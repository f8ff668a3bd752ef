package bench

import (
	"context"
	"io"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/sony/gobreaker"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// Concurrency is the handler parallelism Ferry's consumers and the raw
// loops use where the client lets it be chosen.
const Concurrency = 8

// ferryHandler is the handler of a Ferry consume variant: it marks the
// message in tr, wrapped, for the full stack, in consumer.Standard (dead
// letter, retry, breaker, timeout, recover) around idempotency over the
// in-memory store, as a service team wraps it.
func ferryHandler(pub consumer.Publisher, dlq string, full bool, tr *Tracker) (consumer.Handler, error) {
	h := consumer.Handler(consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
		tr.Mark(m.Body)
		return nil
	}))
	if !full {
		return h, nil
	}
	stack, err := consumer.Standard(pub, dlq, consumer.StandardDeadLetter(consumer.DeadLetterLogger(quiet)))
	if err != nil {
		return nil, err
	}
	dedup, err := idempotency.New(idempotency.NewMemoryStore(), "bench", idempotency.WithLogger(quiet))
	if err != nil {
		return nil, err
	}
	return consumer.Chain(h, stack.Wrap, dedup.Wrap), nil
}

// runFerry runs loop with h until tr has seen every message, then stops it.
func runFerry(ctx context.Context, loop *consumer.Loop, h consumer.Handler, tr *Tracker) error {
	rctx, cancel := context.WithCancel(ctx)
	errc := make(chan error, 1)
	go func() { errc <- loop.Run(rctx, h) }()
	err := tr.Wait(ctx, errc)
	cancel()
	if err != nil {
		<-errc
		return err
	}
	return <-errc
}

// watermillRouter runs sub's topic through a Watermill router whose
// handler marks messages in tr; full adds the middleware that matches
// Ferry's stack: PoisonQueue (to dlqTopic on pub), Retry, CircuitBreaker,
// Timeout, Recoverer and the Deduplicator over its in-memory repository,
// keyed on the message UUID. It returns once tr has seen every message,
// having closed the router.
func watermillRouter(ctx context.Context, sub message.Subscriber, topic string, pub message.Publisher, dlqTopic string, full bool, tr *Tracker) error {
	logger := watermill.NopLogger{}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	if full {
		poison, err := middleware.PoisonQueue(pub, dlqTopic)
		if err != nil {
			return err
		}
		repo, err := middleware.NewMapExpiringKeyRepository(time.Hour)
		if err != nil {
			return err
		}
		dedup := &middleware.Deduplicator{
			KeyFactory: func(m *message.Message) (string, error) { return m.UUID, nil },
			Repository: repo,
		}
		r.AddMiddleware(
			poison,
			middleware.Retry{MaxRetries: 3, InitialInterval: 100 * time.Millisecond, MaxInterval: 5 * time.Second, Multiplier: 2, Logger: logger}.Middleware,
			middleware.NewCircuitBreaker(gobreaker.Settings{Name: "bench"}).Middleware,
			middleware.Timeout(30*time.Second),
			middleware.Recoverer,
			dedup.Middleware,
		)
	}
	r.AddConsumerHandler("bench", topic, sub, func(m *message.Message) error {
		tr.Mark(m.Payload)
		return nil
	})
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- r.Run(rctx) }()
	err = tr.Wait(ctx, errc)
	cancel()
	_ = r.Close()
	if err != nil {
		return err
	}
	return <-errc
}

// wmMessages returns Watermill messages lo..hi-1 with their UUIDs.
func wmMessages(lo, hi int) []*message.Message {
	out := make([]*message.Message, 0, hi-lo)
	for i := lo; i < hi; i++ {
		out = append(out, message.NewMessage(UUID(i), Body(i)))
	}
	return out
}

// ferryMessages returns Ferry messages lo..hi-1.
func ferryMessages(lo, hi int) []consumer.Message {
	out := make([]consumer.Message, 0, hi-lo)
	for i := lo; i < hi; i++ {
		out = append(out, consumer.Message{ID: UUID(i), Key: "key-" + itoa(i%1000), Body: Body(i)})
	}
	return out
}

func itoa(i int) string {
	if i == 0 {
		return "0"
	}
	var b [20]byte
	p := len(b)
	for i > 0 {
		p--
		b[p] = byte('0' + i%10)
		i /= 10
	}
	return string(b[p:])
}
