package consumer

import (
	"context"
	"io"
	"log/slog"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
)

// benchLogger keeps the loop's INFO lines out of benchmark output.
var benchLogger = slog.New(slog.NewTextHandler(io.Discard, nil))

// genDriver hands out n ready-made deliveries and counts acks; it isolates
// the loop's own cost from any broker's.
type genDriver struct {
	msgs  []driver.Message
	next  int
	acked atomic.Int64
	all   chan struct{}
}

func (g *genDriver) Fetch(ctx context.Context, dst []driver.Message, max int) ([]driver.Message, error) {
	if g.next == len(g.msgs) {
		<-ctx.Done()
		return dst, ctx.Err()
	}
	n := min(max, len(g.msgs)-g.next)
	dst = append(dst, g.msgs[g.next:g.next+n]...)
	g.next += n
	return dst, nil
}

func (g *genDriver) Settle(_ context.Context, b []driver.Settlement) error {
	if g.acked.Add(int64(len(b))) == int64(len(g.msgs)) {
		close(g.all)
	}
	return nil
}

func (g *genDriver) Capabilities() driver.Capabilities { return driver.Capabilities{Redelivers: true} }
func (g *genDriver) Close() error                      { return nil }

// BenchmarkLoopOverhead measures fetch → handler → ack through the loop
// alone, with a no-op handler at concurrency 8.
func BenchmarkLoopOverhead(b *testing.B) {
	g := &genDriver{msgs: make([]driver.Message, b.N), all: make(chan struct{})}
	body := []byte("hello")
	handles := make([]int, b.N)
	for i := range g.msgs {
		g.msgs[i] = driver.Message{ID: "m", Body: body, Deliveries: 1, Handle: &handles[i]}
	}
	benchLoop(b, g, WithConcurrency(8))
}

// BenchmarkLoopKeyed is BenchmarkLoopOverhead at the Kafka comparison's
// settings (bench/cmd/loop-ceiling): 8 workers, 20,000 in flight, fetches
// of 5,000, 6 lanes and 1,000 keys, ordered by key. Its allocs/op and B/op
// are the loop's own per message: the messages are built before the timer.
func BenchmarkLoopKeyed(b *testing.B) {
	g := &genDriver{msgs: make([]driver.Message, b.N), all: make(chan struct{})}
	body := make([]byte, 100)
	lanes := []string{"0", "1", "2", "3", "4", "5"}
	keys := make([]string, 1000)
	for i := range keys {
		keys[i] = "key-" + strconv.Itoa(i)
	}
	for i := range g.msgs {
		g.msgs[i] = driver.Message{ID: "m", Key: keys[i%len(keys)], Body: body, Lane: lanes[i%len(lanes)], Source: "t",
			Offset: int64(i), Deliveries: 1, Handle: i}
	}
	benchLoop(b, g, WithConcurrency(8), WithMaxInFlight(20_000), WithFetchBatch(5_000), WithOrdering(OrderByKey))
}

// benchLoop runs a loop with opts over g's messages and a no-op handler,
// timed until every message is acked, and reports the rate.
func benchLoop(b *testing.B, g *genDriver, opts ...Option) {
	l, err := New(g, append(opts, WithLogger(benchLogger))...)
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	errc := make(chan error, 1)
	go func() { errc <- l.Run(ctx, HandlerFunc(func(context.Context, *Message) error { return nil })) }()
	<-g.all
	elapsed := time.Since(start)
	b.StopTimer()
	cancel()
	if err := <-errc; err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
}
