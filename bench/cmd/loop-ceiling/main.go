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
// Each run, and the summary, gives besides the rate this process's CPU
// time per message (user and system, the garbage collector's included),
// its heap allocations and bytes per message, and the share of the
// machine's cores that other processes took while it ran. No broker runs
// here, so that share is other load on the machine: a run with a large one
// was slowed by it. -cpuprofile and -memprofile profile the timed parts
// only.
//
//	cd bench && go run ./cmd/loop-ceiling -n 1000000 -runs 5
//	cd bench && go run ./cmd/loop-ceiling -runs 3 -cpuprofile cpu.pprof && go tool pprof -tagfocus handler=full cpu.pprof
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"math"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ferrymq/ferry/bench/internal/usage"
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
	cpuprofile := flag.String("cpuprofile", "", "write a CPU profile of every run's timed part, and of nothing else, to this file; its samples are labelled handler=no-op or handler=full (go tool pprof -tagfocus handler=full FILE)")
	memprofile := flag.String("memprofile", "", "write an allocation profile of every run's timed part to this file, labelled as -cpuprofile's; it runs a GC before and after each timed part")
	flag.Parse()
	if *n <= 0 || *runs <= 0 || *inflight <= 0 {
		log.Fatalf("-n, -runs and -inflight must be positive (got %d, %d, %d)", *n, *runs, *inflight)
	}
	prof := &profiler{cpuPath: *cpuprofile, memPath: *memprofile}
	body := make([]byte, 100)
	results := map[bool][]result{}
	for r := range *runs {
		for _, full := range []bool{false, true} {
			d := &freeDriver{msgs: make([]driver.Message, *n)}
			for i := range d.msgs {
				lane := strconv.Itoa(i % 6)
				d.msgs[i] = driver.Message{ID: "t/" + lane + "/" + strconv.Itoa(i), Key: "key-" + strconv.Itoa(i%1000), Body: body,
					Headers: map[string]string{"h": "v"}, Lane: lane, Source: "t", Offset: int64(i), Deliveries: 1, Handle: i}
			}
			res, err := run(d, *n, *inflight, full, prof)
			if err != nil {
				log.Fatal(err)
			}
			fmt.Printf("run %d %-13s %8.0f msgs/s, CPU %s µs/msg, %.1f allocs/msg, %.0f B/msg; others took %s of the %d cores%s\n",
				r+1, handlerName(full), res.rate, fmtMicros(res.span.CPUPerMsg(*n)), float64(res.span.Mallocs)/float64(*n),
				float64(res.span.Bytes)/float64(*n), fmtShare(res.span.OthersShare()), res.span.Cores, fmtSteal(res.span))
			results[full] = append(results[full], res)
		}
	}
	if err := prof.write(); err != nil {
		log.Fatal(err)
	}
	fmt.Println()
	fmt.Printf("%-15s %-32s %-22s %-10s %-8s %s\n", "", "msgs/s median (min-max)", "CPU µs/msg (min-max)", "allocs/msg", "B/msg", "others' share of the cores (min-max)")
	for _, full := range []bool{false, true} {
		var rates, cpu, others, allocs, bytes []float64
		for _, res := range results[full] {
			rates = append(rates, res.rate)
			cpu = append(cpu, res.span.CPUPerMsg(*n))
			others = append(others, res.span.OthersShare())
			allocs = append(allocs, float64(res.span.Mallocs)/float64(*n))
			bytes = append(bytes, float64(res.span.Bytes)/float64(*n))
		}
		rm, rlo, rhi := spread(rates)
		cm, clo, chi := spread(cpu)
		om, olo, ohi := spread(others)
		am, _, _ := spread(allocs)
		bm, _, _ := spread(bytes)
		fmt.Printf("%-15s %-32s %-22s %-10.1f %-8.0f %s\n", handlerName(full),
			fmt.Sprintf("%.0f (%.0f-%.0f)", rm, rlo, rhi),
			fmt.Sprintf("%s (%s-%s)", fmtMicros(cm), fmtMicros(clo), fmtMicros(chi)),
			am, bm, fmt.Sprintf("%s (%s-%s)", fmtShare(om), fmtShare(olo), fmtShare(ohi)))
	}
	fmt.Printf("(%d runs of %d messages each. CPU is this process's, user and system; others' share is the CPU every other\n"+
		"process on the machine took during the timed part, over all its cores: no broker runs here, so it is other load)\n", *runs, *n)
}

// result is one run's rate and what its timed part cost.
type result struct {
	rate float64
	span usage.Span
}

func handlerName(full bool) string {
	if full {
		return "full stack"
	}
	return "no-op handler"
}

// spread is the median, the least and the greatest of xs, NaNs left out
// (NaN if all are).
func spread(xs []float64) (med, lo, hi float64) {
	var s []float64
	for _, x := range xs {
		if !math.IsNaN(x) {
			s = append(s, x)
		}
	}
	if len(s) == 0 {
		return math.NaN(), math.NaN(), math.NaN()
	}
	slices.Sort(s)
	med = s[len(s)/2]
	if len(s)%2 == 0 {
		med = (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return med, s[0], s[len(s)-1]
}

func fmtMicros(v float64) string {
	if math.IsNaN(v) {
		return "-"
	}
	return fmt.Sprintf("%.2f", v)
}

func fmtShare(v float64) string {
	if math.IsNaN(v) {
		return "-"
	}
	return fmt.Sprintf("%.0f%%", 100*v)
}

// fmtSteal names the hypervisor's steal when it took a visible share.
func fmtSteal(s usage.Span) string {
	if share := usage.Share(s.Steal, s.Wall, s.Cores); share >= 0.005 {
		return fmt.Sprintf(" (and the hypervisor stole %.0f%%)", 100*share)
	}
	return ""
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// run consumes the driver's n messages and returns the rate, timed from
// Run's start until the handler has seen the last one, and what that
// timed part cost.
func run(d *freeDriver, n, inflight int, full bool, prof *profiler) (result, error) {
	loop, err := consumer.New(d, consumer.WithConcurrency(8), consumer.WithMaxInFlight(inflight), consumer.WithFetchBatch(max(min(5_000, inflight/2), 1)),
		consumer.WithLogger(quiet))
	if err != nil {
		return result{}, err
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
			return result{}, err
		}
		defer dlq.Close()
		stack, err := consumer.Standard(dlq, "dlq")
		if err != nil {
			return result{}, err
		}
		dedup, err := idempotency.New(idempotency.NewMemoryStore(), "ceiling", idempotency.WithLogger(quiet))
		if err != nil {
			return result{}, err
		}
		h = consumer.Chain(h, stack.Wrap, dedup.Wrap)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	if err := prof.start(); err != nil {
		cancel()
		return result{}, err
	}
	meter := usage.Start()
	start := time.Now()
	go func() { errc <- loop.Run(ctx, h) }()
	select {
	case <-done:
	case err := <-errc:
		cancel()
		return result{}, fmt.Errorf("the loop returned before the last message (Run: %v)", err)
	}
	res := result{rate: float64(n) / time.Since(start).Seconds(), span: meter.Stop()}
	tag := "no-op"
	if full {
		tag = "full"
	}
	if err := prof.stop(tag); err != nil {
		cancel()
		<-errc
		return result{}, err
	}
	cancel()
	return res, <-errc
}
