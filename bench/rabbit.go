package bench

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/ferrytest"
	"github.com/ferrymq/ferry/rabbit"
)

// RabbitPrefetch is the raw consumer's prefetch, Ferry's MaxInFlight and
// Watermill's prefetch.
const RabbitPrefetch = 256

// rabbitWindow is the unconfirmed publishes in flight, raw and Ferry.
const rabbitWindow = 512

// quorum is the declare arguments of every benchmark queue (CreateSource
// makes a quorum queue too), given to Watermill.
var quorum = amqp.Table{"x-queue-type": "quorum"}

// RabbitSuite compares Ferry's RabbitMQ consumer and publisher with raw
// amqp091-go and with watermill-amqp, on durable quorum queues.
func RabbitSuite(url, run string) (*Suite, error) {
	br, err := rabbit.Dial(url, rabbit.WithLogger(quiet), rabbit.WithConfirmWindow(rabbitWindow))
	if err != nil {
		return nil, err
	}
	conn, err := amqp.DialConfig(url, amqp.Config{Dial: amqp.DefaultDial(5 * time.Second)})
	if err != nil {
		br.Close()
		return nil, err
	}
	var seq atomic.Int64
	var mu sync.Mutex
	var queues []string
	name := func(p string) string { return fmt.Sprintf("ferry-bench-%s-%s-%d", run, p, seq.Add(1)) }
	// declare makes q through the Admin contract: a durable quorum queue,
	// as the quorum arguments Watermill is given declare it.
	declare := func(ctx context.Context, q string) error {
		ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		if err := br.CreateSource(ctx, q, consumer.SourceConfig{}); err != nil {
			return err
		}
		mu.Lock()
		queues = append(queues, q)
		mu.Unlock()
		return nil
	}
	s := &Suite{Broker: ferrytest.RabbitMQ}
	s.Close = func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		mu.Lock()
		for _, q := range queues {
			_ = br.DeleteSource(ctx, q)
		}
		mu.Unlock()
		conn.CloseDeadline(time.Now().Add(time.Second))
		br.Close()
	}
	// rawPublish publishes messages lo..hi-1 to queue on a channel of its
	// own: confirm mode, deferred confirmations, at most rabbitWindow
	// unconfirmed, persistent, mandatory, with a message id, as Ferry
	// publishes.
	rawPublish := func(q string, lo, hi int) error {
		ch, err := conn.Channel()
		if err != nil {
			return err
		}
		defer ch.Close()
		if err := ch.Confirm(false); err != nil {
			return err
		}
		returns := ch.NotifyReturn(make(chan amqp.Return, 1))
		go func() {
			for range returns {
			}
		}()
		ring := make([]*amqp.DeferredConfirmation, 0, rabbitWindow)
		now := time.Now()
		for i := lo; i < hi; i++ {
			if len(ring) == rabbitWindow {
				if !ring[0].Wait() {
					return fmt.Errorf("nacked")
				}
				ring = ring[1:]
			}
			dc, err := ch.PublishWithDeferredConfirm("", q, true, false, amqp.Publishing{
				DeliveryMode: amqp.Persistent, MessageId: UUID(i), Timestamp: now, Body: Body(i),
				Headers: amqp.Table{WatermillUUIDHeader: UUID(i)}})
			if err != nil {
				return err
			}
			ring = append(ring, dc)
		}
		for _, dc := range ring {
			if !dc.Wait() {
				return fmt.Errorf("nacked")
			}
		}
		return nil
	}
	s.Fill = func(ctx context.Context, n int) (Source, error) {
		q := name("consume")
		if err := declare(ctx, q); err != nil {
			return Source{}, err
		}
		return Source{Name: q, N: n}, rawPublish(q, 0, n)
	}
	dlq := name("dlq")
	if err := declare(context.Background(), dlq); err != nil {
		s.Close()
		return nil, err
	}
	wmConfig := func() wmamqp.Config {
		c := wmamqp.NewDurableQueueConfig(url)
		c.Queue.Arguments = quorum
		c.Consume.Qos.PrefetchCount = RabbitPrefetch
		c.Publish.ConfirmDelivery = true // as Ferry and the raw publisher
		return c
	}
	ferryConsume := func(full bool) Consumer {
		return func(ctx context.Context, src Source, tr *Tracker) error {
			loop, err := br.NewConsumer(ctx, src.Name, consumer.WithConcurrency(Concurrency),
				consumer.WithMaxInFlight(RabbitPrefetch), consumer.WithLogger(quiet))
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
	// The raw loop: one channel, prefetch RabbitPrefetch, Concurrency
	// goroutines taking deliveries, handling and acking each.
	rawConsume := func(ctx context.Context, src Source, tr *Tracker) error {
		ch, err := conn.Channel()
		if err != nil {
			return err
		}
		defer ch.Close()
		if err := ch.Qos(RabbitPrefetch, 0, false); err != nil {
			return err
		}
		ds, err := ch.ConsumeWithContext(ctx, src.Name, "", false, false, false, false, nil)
		if err != nil {
			return err
		}
		return parallelLoops(ctx, Concurrency, func(ctx context.Context) error {
			for {
				select {
				case <-tr.Done():
					return nil
				case <-ctx.Done():
					return nil
				case d, ok := <-ds:
					if !ok {
						return fmt.Errorf("deliveries closed")
					}
					tr.Mark(d.Body)
					if err := d.Ack(false); err != nil {
						return err
					}
				}
			}
		}, tr)
	}
	wmConsume := func(full bool) Consumer {
		return func(ctx context.Context, src Source, tr *Tracker) error {
			sub, err := wmamqp.NewSubscriber(wmConfig(), watermill.NopLogger{})
			if err != nil {
				return err
			}
			defer sub.Close()
			var pub message.Publisher = noPublisher{}
			if full {
				p, err := wmamqp.NewPublisher(wmConfig(), watermill.NopLogger{})
				if err != nil {
					return err
				}
				defer p.Close()
				pub = p
			}
			return watermillRouter(ctx, sub, src.Name, pub, dlq, full, tr)
		}
	}
	publish := func(impl Impl) Publisher {
		return func(ctx context.Context, n int) (func(context.Context) error, func(), error) {
			q := name("publish")
			if err := declare(ctx, q); err != nil {
				return nil, nil, err
			}
			switch impl {
			case Raw:
				return func(context.Context) error { return rawPublish(q, 0, n) }, func() {}, nil
			case Ferry:
				if err := br.Publish(ctx, q, consumer.Message{Body: Body(0)}); err != nil {
					return nil, nil, err
				}
				// Calls of 1000 from 2 goroutines sharing the Broker's
				// window (one alone idles the window at each call's end).
				return func(ctx context.Context) error {
					return parallel(ctx, 2, n, 1000, func(ctx context.Context, lo, hi int) error {
						return br.Publish(ctx, q, ferryMessages(lo, hi)...)
					})
				}, func() {}, nil
			default:
				p, err := wmamqp.NewPublisher(wmConfig(), watermill.NopLogger{})
				if err != nil {
					return nil, nil, err
				}
				if err := p.Publish(q, message.NewMessage("warm-up", Body(0))); err != nil {
					p.Close()
					return nil, nil, err
				}
				return func(ctx context.Context) error {
					return parallel(ctx, PublishParallel, n, 100, func(ctx context.Context, lo, hi int) error {
						return p.Publish(q, wmMessages(lo, hi)...)
					})
				}, func() { p.Close() }, nil
			}
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
	}
	s.Notes = append(s.Notes,
		"rabbitmq: every queue is a durable quorum queue; messages are persistent and published with confirms by all three.",
		"rabbitmq: the raw loop is one channel with prefetch 256 and 8 goroutines acking each delivery; Ferry runs concurrency 8 with 256 in flight; watermill-amqp gets prefetch 256 but handles one message at a time per subscription (it waits for each ack).",
		"rabbitmq: publish is raw amqp091 with deferred confirms and a window of 512 on one channel, Ferry's Publish in calls of 1000 from 2 goroutines (window 512), and watermill-amqp's Publisher (confirm delivery on) from 8 goroutines in calls of 100.")
	return s, nil
}
