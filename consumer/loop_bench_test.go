package consumer

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
)

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
	l, err := New(g, WithConcurrency(8))
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
