package bench

import (
	"context"
	"fmt"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/ferrytest"
	"github.com/ferrymq/ferry/memory"
)

// MemorySuite compares Ferry's in-process broker with Watermill's
// GoChannel. The "raw" loop is the memory broker's driver alone (fetch a
// batch, ack it) in Concurrency goroutines: there is no other client.
// Watermill's GoChannel is persistent, filled before its subscriber starts,
// which then replays the whole topic.
func MemorySuite() (*Suite, error) {
	br, err := memory.New()
	if err != nil {
		return nil, err
	}
	var seq atomic.Int64
	name := func(p string) string { return fmt.Sprintf("%s-%d", p, seq.Add(1)) }
	// Watermill's fills need their GoChannel: the fill leaves it here for
	// the Watermill consumer that takes the source.
	gochans := map[string]*gochannel.GoChannel{}
	newGo := func() *gochannel.GoChannel {
		return gochannel.NewGoChannel(gochannel.Config{Persistent: true, OutputChannelBuffer: 256}, watermill.NopLogger{})
	}
	s := &Suite{Broker: ferrytest.Memory, Close: func() { br.Close() }}
	s.Fill = func(ctx context.Context, n int) (Source, error) {
		q := name("bench")
		// Fill both: the memory broker's queue and a GoChannel topic of
		// the same name, so that each variant finds its messages.
		for lo := 0; lo < n; lo += 256 {
			if err := br.Publish(ctx, q, ferryMessages(lo, min(lo+256, n))...); err != nil {
				return Source{}, err
			}
		}
		g := newGo()
		for lo := 0; lo < n; lo += 256 {
			if err := g.Publish(q, wmMessages(lo, min(lo+256, n))...); err != nil {
				return Source{}, err
			}
		}
		gochans[q] = g
		return Source{Name: q, N: n}, nil
	}
	drop := func(src Source) *gochannel.GoChannel {
		g := gochans[src.Name]
		delete(gochans, src.Name)
		return g
	}
	ferryConsume := func(full bool) Consumer {
		return func(ctx context.Context, src Source, tr *Tracker) error {
			if g := drop(src); g != nil {
				_ = g.Close()
			}
			loop, err := br.NewConsumer(ctx, src.Name, consumer.WithConcurrency(Concurrency), consumer.WithLogger(quiet))
			if err != nil {
				return err
			}
			h, err := ferryHandler(br, src.Name+"-dlq", full, tr)
			if err != nil {
				return err
			}
			return runFerry(ctx, loop, h, tr)
		}
	}
	wmConsume := func(full bool) Consumer {
		return func(ctx context.Context, src Source, tr *Tracker) error {
			g := drop(src)
			defer g.Close()
			return watermillRouter(ctx, g, src.Name, g, src.Name+"-dlq", full, tr)
		}
	}
	rawConsume := func(ctx context.Context, src Source, tr *Tracker) error {
		if g := drop(src); g != nil {
			_ = g.Close()
		}
		return parallelLoops(ctx, Concurrency, func(ctx context.Context) error {
			d, err := br.Driver(ctx, src.Name, driver.Config{})
			if err != nil {
				return err
			}
			defer d.Close()
			var ms []driver.Message
			var ss []driver.Settlement
			for {
				select {
				case <-tr.Done():
					return nil
				default:
				}
				ms, err = d.Fetch(ctx, ms[:0], 32)
				if err != nil {
					if ctx.Err() != nil {
						return nil
					}
					return err
				}
				ss = ss[:0]
				for _, m := range ms {
					tr.Mark(m.Body)
					ss = append(ss, driver.Settlement{Handle: m.Handle, Action: driver.Ack})
				}
				if err := d.Settle(ctx, ss); err != nil {
					return err
				}
			}
		}, tr)
	}
	s.Variants = []Variant{
		{Op: ConsumeNoop, Impl: Ferry, Consume: ferryConsume(false)},
		{Op: ConsumeNoop, Impl: Raw, Consume: rawConsume},
		{Op: ConsumeNoop, Impl: Watermill, Consume: wmConsume(false)},
		{Op: ConsumeFull, Impl: Ferry, Consume: ferryConsume(true)},
		{Op: ConsumeFull, Impl: Watermill, Consume: wmConsume(true)},
		{Op: Publish, Impl: Ferry, Publish: func(ctx context.Context, n int) (func(context.Context) error, func(), error) {
			q := name("pub")
			return func(ctx context.Context) error {
				return parallel(ctx, Concurrency, n, 100, func(ctx context.Context, lo, hi int) error {
					return br.Publish(ctx, q, ferryMessages(lo, hi)...)
				})
			}, func() {}, nil
		}},
		{Op: Publish, Impl: Watermill, Publish: func(ctx context.Context, n int) (func(context.Context) error, func(), error) {
			g := newGo()
			q := name("pub")
			return func(ctx context.Context) error {
				return parallel(ctx, Concurrency, n, 100, func(ctx context.Context, lo, hi int) error {
					return g.Publish(q, wmMessages(lo, hi)...)
				})
			}, func() { g.Close() }, nil
		}},
	}
	s.Variants = append(s.Variants,
		Variant{Op: Backlog, Impl: Ferry, Hold: func(ctx context.Context, n int) (func(), error) {
			q := name("backlog")
			for lo := 0; lo < n; lo += 256 {
				if err := br.Publish(ctx, q, ferryMessages(lo, min(lo+256, n))...); err != nil {
					return nil, err
				}
			}
			// Draining it is the release: the queue stays in the broker.
			return func() { drainMemory(br, q, n) }, nil
		}},
		Variant{Op: Backlog, Impl: Watermill, Hold: func(ctx context.Context, n int) (func(), error) {
			g := newGo()
			q := name("backlog")
			for lo := 0; lo < n; lo += 256 {
				if err := g.Publish(q, wmMessages(lo, min(lo+256, n))...); err != nil {
					return nil, err
				}
			}
			return func() { g.Close() }, nil
		}},
	)
	s.Notes = append(s.Notes, "memory: the backlog rows hold 1M messages (or -backlog) of 100 bytes unconsumed, in the memory broker and in a persistent GoChannel, and report the live heap they add after a GC.", "memory: the raw loop is Ferry's memory driver alone (Fetch 32, Settle) in 8 goroutines; there is no raw publish (the broker has no other client).",
		"memory: Watermill's GoChannel delivers to one handler at a time per subscriber (it waits for each ack), so its handler runs one message at a time; Ferry's runs 8.")
	return s, nil
}

// drainMemory acks the n messages of queue q, freeing them.
func drainMemory(br *memory.Broker, q string, n int) {
	d, err := br.Driver(context.Background(), q, driver.Config{})
	if err != nil {
		return
	}
	defer d.Close()
	ctx := context.Background()
	var ms []driver.Message
	var ss []driver.Settlement
	for done := 0; done < n; {
		ms, err = d.Fetch(ctx, ms[:0], 256)
		if err != nil {
			return
		}
		ss = ss[:0]
		for _, m := range ms {
			ss = append(ss, driver.Settlement{Handle: m.Handle, Action: driver.Ack})
		}
		if err := d.Settle(ctx, ss); err != nil {
			return
		}
		done += len(ms)
	}
}

// parallelLoops runs f in p goroutines until tr has seen every message,
// then stops them; an error of one fails the run.
func parallelLoops(ctx context.Context, p int, f func(ctx context.Context) error, tr *Tracker) error {
	lctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, p)
	for range p {
		go func() { errc <- f(lctx) }()
	}
	var err error
	running := p
	select {
	case <-tr.Done():
	case err = <-errc:
		running--
		if err == nil {
			err = fmt.Errorf("a loop stopped")
		}
		select {
		case <-tr.Done():
			err = nil
		default:
			err = fmt.Errorf("%w after %d of %d messages", err, tr.Distinct(), tr.n)
		}
	case <-ctx.Done():
		err = fmt.Errorf("%w: handled %d of %d messages", ctx.Err(), tr.Distinct(), tr.n)
	}
	cancel()
	for range running {
		<-errc
	}
	return err
}
