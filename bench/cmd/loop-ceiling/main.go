// Command loop-ceiling measures Ferry's delivery loop over a driver that
// costs nothing: its messages are built before the timer starts, Fetch
// copies them out, and Settle does nothing. No broker, no client and no
// decoding share the machine with it, so at the same settings no broker's
// Ferry consumer runs faster here: a bound for the consume ratios of
// bench-compare. The settings are the Kafka comparison's: 8 workers, 20,000
// in flight, fetches of 5,000, 6 lanes (partitions) and 1,000 keys, ordered
// by key. The full stack is bench-compare's: Standard and the idempotency
// claim in the in-memory store.
//
// With fewer in flight (-inflight 5000) the loop runs faster here, as what
// it holds fits the caches better; over Kafka that gain did not show.
//
//	cd bench && go run ./cmd/loop-ceiling -n 1000000 -runs 5
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/memory"
)

// freeDriver hands out messages built beforehand and settles nothing.
type freeDriver struct {
	mu   sync.Mutex
	msgs []driver.Message
	next int
}

func (d *freeDriver) Fetch(ctx context.Context, dst []driver.Message, max int) ([]driver.Message, error) {
	d.mu.Lock()
	n := min(max, len(d.msgs)-d.next)
	dst = append(dst, d.msgs[d.next:d.next+n]...)
	d.next += n
	d.mu.Unlock()
	if n == 0 {
		<-ctx.Done()
		return dst, ctx.Err()
	}
	return dst, nil
}

func (d *freeDriver) Settle(context.Context, []driver.Settlement) error { return nil }
func (d *freeDriver) Capabilities() driver.Capabilities                 { return driver.Capabilities{} }
func (d *freeDriver) Close() error                                      { return nil }

func main() {
	n := flag.Int("n", 1_000_000, "messages a run")
	inflight := flag.Int("inflight", 20_000, "the loop's bound in flight (WithMaxInFlight); fetches take at most half of it, up to 5,000")
	runs := flag.Int("runs", 5, "runs of each handler, interleaved")
	flag.Parse()
	body := make([]byte, 100)
	rates := map[bool][]float64{}
	for range *runs {
		for _, full := range []bool{false, true} {
			d := &freeDriver{msgs: make([]driver.Message, *n)}
			for i := range d.msgs {
				lane := strconv.Itoa(i % 6)
				d.msgs[i] = driver.Message{ID: "t/" + lane + "/" + strconv.Itoa(i), Key: "key-" + strconv.Itoa(i%1000), Body: body,
					Headers: map[string]string{"h": "v"}, Lane: lane, Source: "t", Offset: int64(i), Deliveries: 1, Handle: i}
			}
			rate, err := run(d, *n, *inflight, full)
			if err != nil {
				log.Fatal(err)
			}
			rates[full] = append(rates[full], rate)
		}
	}
	for _, full := range []bool{false, true} {
		r := rates[full]
		slices.Sort(r)
		name := "no-op handler"
		if full {
			name = "full stack"
		}
		fmt.Printf("%-15s median %8.0f msgs/s (min %.0f, max %.0f, %d runs of %d)\n", name, r[len(r)/2], r[0], r[len(r)-1], len(r), *n)
	}
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// run consumes the driver's n messages and returns the rate, timed from
// Run's start until the handler has seen the last one.
func run(d *freeDriver, n, inflight int, full bool) (float64, error) {
	loop, err := consumer.New(d, consumer.WithConcurrency(8), consumer.WithMaxInFlight(inflight), consumer.WithFetchBatch(max(min(5_000, inflight/2), 1)),
		consumer.WithLogger(quiet))
	if err != nil {
		return 0, err
	}
	var seen atomic.Int64
	done := make(chan struct{})
	var h consumer.Handler = consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		if seen.Add(1) == int64(n) {
			close(done)
		}
		return nil
	})
	if full {
		dlq, err := memory.New()
		if err != nil {
			return 0, err
		}
		defer dlq.Close()
		stack, err := consumer.Standard(dlq, "dlq")
		if err != nil {
			return 0, err
		}
		dedup, err := idempotency.New(idempotency.NewMemoryStore(), "ceiling", idempotency.WithLogger(quiet))
		if err != nil {
			return 0, err
		}
		h = consumer.Chain(h, stack.Wrap, dedup.Wrap)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	start := time.Now()
	go func() { errc <- loop.Run(ctx, h) }()
	select {
	case <-done:
	case err := <-errc:
		cancel()
		return 0, fmt.Errorf("the loop returned before the last message (Run: %v)", err)
	}
	rate := float64(n) / time.Since(start).Seconds()
	cancel()
	return rate, <-errc
}
