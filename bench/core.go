// Package bench compares Ferry with the raw broker clients and with
// Watermill on the same brokers and the same messages, in one run.
//
// Each broker has a Suite: a way to fill a fresh queue (or topic) with n
// numbered messages, and consumers and publishers of three kinds (Ferry,
// the raw client, Watermill). A consumer is timed from its start until it
// has handled every one of the n messages at least once; a Tracker counts
// the distinct sequence numbers it saw, so a variant that loses a message
// never finishes and fails the run instead of reporting a rate.
//
// The variants of a broker run interleaved, round after round, so drift in
// the broker's speed (or a neighbour on a shared machine) hits them alike.
// cmd/bench-compare runs the whole matrix and writes BENCHMARKS.md and the
// chart; the short test in this package runs it small and checks counts.
package bench

import (
	"context"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ferrymq/ferry/bench/internal/usage"
	"github.com/ferrymq/ferry/ferrytest"
)

// Impl is who does the work: Ferry, the broker's raw client, or Watermill.
type Impl string

// The implementations compared.
const (
	Ferry     Impl = "ferry"
	Raw       Impl = "raw"
	Watermill Impl = "watermill"
)

// Op is what a variant measures.
type Op string

// The operations measured.
const (
	ConsumeNoop Op = "consume (no-op handler)"
	ConsumeFull Op = "consume (full stack)"
	Publish     Op = "publish"
	ByPartition Op = "5 ms handler, 1 partition, 100 keys: partition order"
	ByKey       Op = "5 ms handler, 1 partition, 100 keys: key order"
	Backlog     Op = "heap under a backlog"
)

// BacklogRecords is how many messages the backlog variants hold.
var BacklogRecords = 1_000_000

// BodySize is the size of every message body.
const BodySize = 100

// Body returns message seq's body: its number in ten digits, padded to
// BodySize with text (SQS accepts only text).
func Body(seq int) []byte {
	b := make([]byte, BodySize)
	copy(b, fmt.Sprintf("%010d", seq))
	for i := 10; i < len(b); i++ {
		b[i] = 'x'
	}
	return b
}

// Seq reads the sequence number from a body made by Body.
func Seq(body []byte) (int, bool) {
	if len(body) < 10 {
		return 0, false
	}
	n, err := strconv.Atoi(string(body[:10]))
	return n, err == nil
}

// WatermillUUIDHeader is the header Watermill's marshalers read a
// message's UUID from; the fills set it so that Watermill's Deduplicator
// keys on the message, as Ferry's idempotency keys on the message id.
const WatermillUUIDHeader = "_watermill_message_uuid"

// UUID is message seq's id in every broker's fill.
func UUID(seq int) string { return "m-" + strconv.Itoa(seq) }

// Tracker counts the distinct messages a variant handled.
type Tracker struct {
	n        int
	seen     []atomic.Bool
	distinct atomic.Int64
	total    atomic.Int64
	bad      atomic.Int64
	done     chan struct{}
	doneAt   time.Time // when the last message was handled, set before done closes
}

// NewTracker tracks messages 0..n-1.
func NewTracker(n int) *Tracker {
	return &Tracker{n: n, seen: make([]atomic.Bool, n), done: make(chan struct{})}
}

// Mark records that the message with this body was handled.
func (t *Tracker) Mark(body []byte) {
	t.total.Add(1)
	seq, ok := Seq(body)
	if !ok || seq < 0 || seq >= t.n {
		t.bad.Add(1)
		return
	}
	if t.seen[seq].CompareAndSwap(false, true) {
		if t.distinct.Add(1) == int64(t.n) {
			t.doneAt = time.Now()
			close(t.done)
		}
	}
}

// Done is closed once every message was handled.
func (t *Tracker) Done() <-chan struct{} { return t.done }

// Distinct is how many of the n messages were handled.
func (t *Tracker) Distinct() int { return int(t.distinct.Load()) }

// Finished is when the last message was handled (zero before).
func (t *Tracker) Finished() time.Time {
	select {
	case <-t.done:
		return t.doneAt
	default:
		return time.Time{}
	}
}

// Wait blocks until every message was handled, or fails when ctx ends or
// the consumer's errc (buffered, one value) yields first. A value it takes
// from errc it puts back, for the caller to collect.
func (t *Tracker) Wait(ctx context.Context, errc chan error) error {
	select {
	case <-t.done:
		return nil
	case err := <-errc:
		errc <- err
		select {
		case <-t.done:
			return nil
		default:
		}
		if err == nil {
			err = fmt.Errorf("consumer stopped")
		}
		return fmt.Errorf("%w after %d of %d messages", err, t.Distinct(), t.n)
	case <-ctx.Done():
		return fmt.Errorf("%w: handled %d of %d messages", ctx.Err(), t.Distinct(), t.n)
	}
}

// Consumer consumes the n messages of src until tr has seen them all. It
// returns once they were all handled (Wait), having stopped what it started.
type Consumer func(ctx context.Context, src Source, tr *Tracker) error

// Publisher prepares to publish n numbered messages to a fresh
// destination (creating it, connecting, warming up: not timed) and returns
// the timed run and what releases what it prepared.
type Publisher func(ctx context.Context, n int) (run func(context.Context) error, done func(), err error)

// Source is a queue or topic filled with n messages by a Suite.
type Source struct {
	Name string // queue or topic
	N    int
}

// Variant is one thing measured.
type Variant struct {
	Op      Op
	Impl    Impl
	Consume Consumer  // for consume ops
	Publish Publisher // for publish ops
	// Fill, when set, fills this variant's source instead of the suite's
	// Fill (with its own count).
	Fill func(ctx context.Context) (Source, error)
	// Hold, for the Backlog op, fills a fresh queue with n messages and
	// returns what releases it; the heap it leaves is measured.
	Hold func(ctx context.Context, n int) (release func(), err error)
	// Calls, when set, counts the broker API calls made so far (SQS).
	Calls func() int64
}

// Only keeps the variants that one of filters picks. A filter is words
// joined by "+", and picks a variant whose operation or implementation
// contains each of them: "publish" picks every publish, "publish+raw" only
// the raw client's.
func Only(vs []Variant, filters []string) []Variant {
	picks := func(v Variant, filter string) bool {
		for _, w := range strings.Split(filter, "+") {
			if w = strings.TrimSpace(w); w == "" || !strings.Contains(string(v.Op), w) && !strings.Contains(string(v.Impl), w) {
				return false
			}
		}
		return true
	}
	var out []Variant
	for _, v := range vs {
		for _, f := range filters {
			if picks(v, f) {
				out = append(out, v)
				break
			}
		}
	}
	return out
}

// Suite is one broker's variants.
type Suite struct {
	Broker ferrytest.Kind
	// Fill creates a fresh queue or topic holding n numbered messages.
	Fill func(ctx context.Context, n int) (Source, error)
	// Variants in the order of the first round (later rounds rotate it).
	Variants []Variant
	// Notes say what the suite could not measure and why.
	Notes []string
	// Close releases the suite's clients.
	Close func()
}

// Sample is one timed run of one variant.
type Sample struct {
	Broker  ferrytest.Kind
	Op      Op
	Impl    Impl
	Round   int
	N       int
	Elapsed time.Duration
	// Calls is broker API calls made (-1 when not counted).
	Calls int64
	// Mallocs is heap allocations in the whole process during the run.
	Mallocs uint64
	// Usage is what the timed part cost: this process's CPU time, its
	// allocations and their bytes, and the CPU the other processes took
	// on the machine's cores meanwhile (the broker's among them: the
	// brokers share the cores). Nil for the Backlog op, and in samples
	// saved before it was measured.
	Usage *usage.Span `json:",omitempty"`
	// Consumed is the distinct messages handled (consume ops).
	Consumed int
	// HeapBytes is the live heap a backlog of N messages added (Backlog).
	HeapBytes int64
}

// Rate is messages per second.
func (s Sample) Rate() float64 { return float64(s.N) / s.Elapsed.Seconds() }

// CPUPerMsg is this process's CPU time a message in the timed part, in
// microseconds (NaN when not measured).
func (s Sample) CPUPerMsg() float64 {
	if s.Usage == nil {
		return math.NaN()
	}
	return s.Usage.CPUPerMsg(s.N)
}

// BytesPerMsg is the heap bytes the process allocated a message in the
// timed part (NaN when not measured).
func (s Sample) BytesPerMsg() float64 {
	if s.Usage == nil || s.N <= 0 {
		return math.NaN()
	}
	return float64(s.Usage.Bytes) / float64(s.N)
}

// OthersShare is the share of the machine's cores (0 to 1) that other
// processes, the broker among them, took during the timed part (NaN when
// not measured).
func (s Sample) OthersShare() float64 {
	if s.Usage == nil {
		return math.NaN()
	}
	return s.Usage.OthersShare()
}

// ProfileDir is where, when set, a CPU profile of each variant's timed
// part is written, named broker_op_impl_round.pprof.
var ProfileDir string

func profileName(smp Sample) string {
	r := strings.NewReplacer(" ", "-", "(", "", ")", "", ",", "", ":", "")
	return filepath.Join(ProfileDir, fmt.Sprintf("%s_%s_%s_%d.pprof", smp.Broker, r.Replace(string(smp.Op)), smp.Impl, smp.Round))
}

// profiled runs f under a CPU profile written to path (when not empty).
func profiled(path string, f func() error) error {
	if path == "" {
		return f()
	}
	fh, err := os.Create(path)
	if err != nil {
		return err
	}
	defer fh.Close()
	if err := pprof.StartCPUProfile(fh); err != nil {
		return err
	}
	defer pprof.StopCPUProfile()
	return f()
}

// measure runs f timed, counting API calls and what the run cost (CPU,
// allocations, the other processes' CPU). With tr set (a consume), the
// time is until tr saw the last message: the consumer's shutdown is not
// timed, nor are the CPU, allocations and calls spent after.
func measure(v Variant, tr *Tracker, f func() error) (time.Duration, usage.Span, int64, error) {
	calls := int64(-1)
	var c0 int64
	if v.Calls != nil {
		c0 = v.Calls()
	}
	runtime.GC()
	meter := usage.Start()
	start := time.Now()
	var snap, stop chan struct{}
	var c1 int64
	var span usage.Span
	if tr != nil {
		stop = make(chan struct{})
		// Read the counters as soon as the last message is handled.
		snap = make(chan struct{})
		go func() {
			defer close(snap)
			select {
			case <-tr.Done():
			case <-stop:
				return
			}
			span = meter.Stop()
			if v.Calls != nil {
				c1 = v.Calls()
			}
		}()
	}
	err := f()
	elapsed := time.Since(start)
	if tr != nil && !tr.Finished().IsZero() {
		<-snap
		elapsed = tr.Finished().Sub(start)
	} else {
		if stop != nil {
			close(stop)
			<-snap
		}
		span = meter.Stop()
		if v.Calls != nil {
			c1 = v.Calls()
		}
	}
	if v.Calls != nil {
		calls = c1 - c0
	}
	return elapsed, span, calls, err
}

// Run runs every variant of s rounds times, interleaved, each on n
// messages (key-order variants use their own counts), and returns the
// samples. A consume variant that does not handle all n messages within
// timeout fails the run.
func Run(ctx context.Context, s *Suite, n, rounds int, timeout time.Duration, logf func(string, ...any)) ([]Sample, error) {
	var out []Sample
	for r := range rounds {
		k := len(s.Variants)
		for i := range k {
			v := s.Variants[(i+r)%k]
			smp := Sample{Broker: s.Broker, Op: v.Op, Impl: v.Impl, Round: r + 1, N: n, Calls: -1}
			prof := ""
			if ProfileDir != "" {
				prof = profileName(smp)
			}
			var err error
			switch {
			case v.Consume != nil:
				var src Source
				if v.Fill != nil {
					src, err = v.Fill(ctx)
				} else {
					src, err = s.Fill(ctx, n)
				}
				if err != nil {
					return out, fmt.Errorf("%s: fill: %w", s.Broker, err)
				}
				smp.N = src.N
				tr := NewTracker(src.N)
				cctx, cancel := context.WithTimeout(ctx, timeout)
				var span usage.Span
				smp.Elapsed, span, smp.Calls, err = measure(v, tr, func() error { return profiled(prof, func() error { return v.Consume(cctx, src, tr) }) })
				smp.Mallocs, smp.Usage = span.Mallocs, &span
				cancel()
				smp.Consumed = tr.Distinct()
				if err == nil && smp.Consumed != src.N {
					err = fmt.Errorf("handled %d of %d messages", smp.Consumed, src.N)
				}
			case v.Hold != nil:
				smp.N = BacklogRecords
				var before, after runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&before)
				start := time.Now()
				var release func()
				release, err = v.Hold(ctx, BacklogRecords)
				smp.Elapsed = time.Since(start)
				if err == nil {
					runtime.GC()
					runtime.ReadMemStats(&after)
					smp.HeapBytes = int64(after.HeapAlloc) - int64(before.HeapAlloc)
					release()
					runtime.GC()
				}
			case v.Publish != nil:
				var run func(context.Context) error
				var done func()
				run, done, err = v.Publish(ctx, n)
				if err != nil {
					return out, fmt.Errorf("%s %s %s: prepare: %w", s.Broker, v.Op, v.Impl, err)
				}
				pctx, cancel := context.WithTimeout(ctx, timeout)
				var span usage.Span
				smp.Elapsed, span, smp.Calls, err = measure(v, nil, func() error { return profiled(prof, func() error { return run(pctx) }) })
				smp.Mallocs, smp.Usage = span.Mallocs, &span
				cancel()
				done()
			}
			if err != nil {
				return out, fmt.Errorf("%s %s %s round %d: %w", s.Broker, v.Op, v.Impl, r+1, err)
			}
			if logf != nil && v.Hold != nil {
				logf("%-8s %-48s %-9s round %d: %8.1f MiB heap for %d messages", s.Broker, v.Op, v.Impl, r+1, float64(smp.HeapBytes)/(1<<20), smp.N)
			} else if logf != nil {
				logf("%-8s %-48s %-9s round %d: %8.0f msgs/s (%d in %s), CPU %s µs/msg, others took %s of the cores",
					s.Broker, v.Op, v.Impl, r+1, smp.Rate(), smp.N, smp.Elapsed.Round(time.Millisecond), fmtMicros(smp.CPUPerMsg()), fmtShare(smp.OthersShare()))
			}
			out = append(out, smp)
		}
	}
	return out, nil
}

// parallel runs f in p goroutines over the batches [lo, hi) of n messages
// of size per, and returns the first error.
func parallel(ctx context.Context, p, n, per int, f func(ctx context.Context, lo, hi int) error) error {
	var next atomic.Int64
	errc := make(chan error, p)
	for range p {
		go func() {
			for {
				lo := int(next.Add(int64(per))) - per
				if lo >= n || ctx.Err() != nil {
					errc <- ctx.Err()
					return
				}
				if err := f(ctx, lo, min(lo+per, n)); err != nil {
					errc <- err
					return
				}
			}
		}()
	}
	var first error
	for range p {
		if err := <-errc; err != nil && first == nil {
			first = err
		}
	}
	return first
}
