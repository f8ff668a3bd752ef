package outbox_test

import (
	"context"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/memory"
	"github.com/ferrymq/ferry/outbox"
)

// counting is the memory broker with a count of what it took and a signal
// per publish call.
type counting struct {
	*memory.Broker
	n       atomic.Int64
	arrived chan time.Time
}

func (c *counting) Publish(ctx context.Context, dest string, msgs ...consumer.Message) error {
	if err := c.Broker.Publish(ctx, dest, msgs...); err != nil {
		return err
	}
	c.n.Add(int64(len(msgs)))
	select {
	case c.arrived <- time.Now():
	default:
	}
	return nil
}

func benchBackends(b *testing.B) []string { return []string{"sqlite", "postgres"} }

func openBench(b *testing.B, name string) *backend {
	be := &backend{name: name}
	return be.open(b)
}

func runBenchRelay(b *testing.B, st outbox.Store, pub consumer.Publisher, opts ...outbox.Option) func() {
	r, err := outbox.NewRelay(st, pub, opts...)
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	return func() {
		cancel()
		<-done
	}
}

// BenchmarkRelayThroughput measures how many committed events per second one
// relay publishes to the memory broker, with one event per Publish call and
// with batches of 100. The events are written before the clock starts.
func BenchmarkRelayThroughput(b *testing.B) {
	for _, db := range benchBackends(b) {
		for _, batch := range []int{1, 100} {
			b.Run(db+"/batch="+strconv.Itoa(batch), func(b *testing.B) {
				be := openBench(b, db)
				ctx := context.Background()
				for done := 0; done < b.N; {
					n := min(b.N-done, 500)
					evs := make([]outbox.Event, n)
					for i := range evs {
						evs[i] = outbox.Event{Destination: queue, Key: "k" + strconv.Itoa((done+i)%100), Body: []byte(`{"n":1}`)}
					}
					if err := be.add(ctx, evs...); err != nil {
						b.Fatal(err)
					}
					done += n
				}
				br, err := memory.New()
				if err != nil {
					b.Fatal(err)
				}
				defer br.Close()
				pub := &counting{Broker: br, arrived: make(chan time.Time, 1)}
				b.ReportAllocs()
				b.ResetTimer()
				start := time.Now()
				stop := runBenchRelay(b, be.store(b, ""), pub, outbox.WithBatchSize(batch))
				for pub.n.Load() < int64(b.N) {
					<-pub.arrived
				}
				elapsed := time.Since(start)
				b.StopTimer()
				stop()
				b.ReportMetric(float64(b.N)/elapsed.Seconds(), "rows/s")
			})
		}
	}
}

// BenchmarkRelayLatency measures the time from a commit returning to the
// event's publish returning, one event at a time (a light load): woken by
// the commit (PostgreSQL LISTEN/NOTIFY, SQLite's in-process wake) and by
// polling only (every 100ms). Events are written one at a time, at random
// moments up to 100ms apart.
func BenchmarkRelayLatency(b *testing.B) {
	for _, db := range benchBackends(b) {
		for _, mode := range []string{"notify", "poll"} {
			b.Run(db+"/"+mode, func(b *testing.B) {
				be := openBench(b, db)
				ctx := context.Background()
				br, err := memory.New()
				if err != nil {
					b.Fatal(err)
				}
				defer br.Close()
				pub := &counting{Broker: br, arrived: make(chan time.Time, 1)}
				opts := []outbox.Option{outbox.WithPollInterval(100 * time.Millisecond)}
				if mode == "poll" {
					opts = append(opts, outbox.WithListen(false))
				}
				stop := runBenchRelay(b, be.store(b, ""), pub, opts...)
				defer stop()
				// Wait until the relay holds its lanes.
				if err := be.add(ctx, outbox.Event{Destination: queue, Key: "warm-up"}); err != nil {
					b.Fatal(err)
				}
				<-pub.arrived
				lat := make([]time.Duration, 0, b.N)
				b.ReportAllocs()
				b.ResetTimer()
				for i := range b.N {
					// Events come at random moments, not in step with the
					// relay's poll.
					time.Sleep(rand.N(100 * time.Millisecond))
					if err := be.add(ctx, outbox.Event{Destination: queue, Key: "k" + strconv.Itoa(i%100), Body: []byte(`{"n":1}`)}); err != nil {
						b.Fatal(err)
					}
					committed := time.Now()
					at := <-pub.arrived
					lat = append(lat, max(at.Sub(committed), 0))
				}
				b.StopTimer()
				slices.Sort(lat)
				pct := func(p float64) float64 {
					return float64(lat[min(len(lat)-1, int(p*float64(len(lat))))].Microseconds()) / 1000
				}
				b.ReportMetric(pct(0.50), "p50-ms")
				b.ReportMetric(pct(0.99), "p99-ms")
			})
		}
	}
}

// BenchmarkBacklog measures one Store.Backlog call, which the relay's
// metrics make at every collection, with 1,000, 20,000 and 200,000 events
// waiting: the cost must not grow with the backlog (counting stops at
// outbox.BacklogCountLimit, and the oldest event is found by id).
func BenchmarkBacklog(b *testing.B) {
	for _, db := range benchBackends(b) {
		for _, n := range []int{1_000, 20_000, 200_000} {
			b.Run(db+"/events="+strconv.Itoa(n), func(b *testing.B) {
				be := openBench(b, db)
				ctx := context.Background()
				for done := 0; done < n; {
					k := min(n-done, 5000)
					evs := make([]outbox.Event, k)
					for i := range evs {
						evs[i] = outbox.Event{Destination: queue, Key: "k" + strconv.Itoa(i%100)}
					}
					if err := be.add(ctx, evs...); err != nil {
						b.Fatal(err)
					}
					done += k
				}
				st := be.store(b, "")
				b.ReportAllocs()
				b.ResetTimer()
				for b.Loop() {
					if _, err := st.Backlog(ctx); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// BenchmarkWriterAdd measures Add: one transaction a round with 100 events
// of 10 keys, none held (NotBefore zero), committed. On PostgreSQL each
// event's insert looks for a held event of its key (see
// pgoutbox's insert); this shows what that costs.
func BenchmarkWriterAdd(b *testing.B) {
	for _, db := range benchBackends(b) {
		b.Run(db, func(b *testing.B) {
			be := openBench(b, db)
			ctx := context.Background()
			evs := make([]outbox.Event, 100)
			for i := range evs {
				evs[i] = outbox.Event{Destination: queue, Key: "k" + strconv.Itoa(i%10), Body: []byte("order")}
			}
			b.ReportAllocs()
			for b.Loop() {
				for i := range evs {
					evs[i].ID = "" // a new id each round
				}
				if err := be.add(ctx, evs...); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(evs)), "ns/event")
		})
	}
}

// BenchmarkStoreFetch measures one read of a relay that holds every lane,
// one event at a time, from an outbox of 5,000 events: the cost of the
// statement itself (its planning included), which a relay with a batch
// size of 1 pays per event.
func BenchmarkStoreFetch(b *testing.B) {
	for _, db := range benchBackends(b) {
		b.Run(db, func(b *testing.B) {
			be := openBench(b, db)
			ctx := context.Background()
			evs := make([]outbox.Event, 5000)
			for i := range evs {
				evs[i] = outbox.Event{Destination: queue, Key: "k" + strconv.Itoa(i%100)}
			}
			if err := be.add(ctx, evs...); err != nil {
				b.Fatal(err)
			}
			st := be.store(b, "")
			lanes := make([]int, 64)
			for i := range lanes {
				lanes[i] = i
			}
			for b.Loop() {
				if _, err := st.Fetch(ctx, lanes, 1); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
