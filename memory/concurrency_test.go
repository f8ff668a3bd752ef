package memory_test

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/memory"
)

// Publishers and fetchers running at once, on standard and FIFO queues: every
// message is delivered exactly once (no lease runs out), and a FIFO group's
// messages arrive in publish order with never two of a group in flight.
func TestConcurrentPublishersAndFetchers(t *testing.T) {
	for _, fifo := range []bool{false, true} {
		t.Run(fmt.Sprintf("fifo=%v", fifo), func(t *testing.T) {
			const publishers, perPublisher, fetchers = 4, 500, 3
			const total = publishers * perPublisher
			b := newBroker(t)
			createQueue(t, b, "q", memory.QueueConfig{FIFO: fifo})

			ctx, cancel := context.WithTimeout(context.Background(), patience)
			defer cancel()
			var (
				mu       sync.Mutex
				seen     = map[string]int{}
				lastSeq  = map[string]int{} // per group (= publisher)
				inFlight = map[string]bool{}
				problems []string
			)
			var wg sync.WaitGroup
			for p := range publishers {
				wg.Go(func() {
					for i := range perPublisher {
						m := consumer.Message{
							ID:      fmt.Sprintf("p%d-%d", p, i),
							Key:     fmt.Sprintf("p%d", p),
							Body:    []byte{byte(i)},
							Headers: map[string]string{"seq": fmt.Sprint(i)},
						}
						if err := b.Publish(ctx, "q", m); err != nil {
							t.Error(err)
							return
						}
					}
				})
			}
			for range fetchers {
				d := newDriver(t, b, "q")
				wg.Go(func() {
					var ms []driver.Message
					for {
						var err error
						ms, err = d.Fetch(ctx, ms[:0], 16)
						if err != nil {
							return // ctx ended: all done, or the test failed
						}
						mu.Lock()
						for _, m := range ms {
							seen[m.ID]++
							if fifo {
								if inFlight[m.Lane] {
									problems = append(problems, "two in flight in group "+m.Lane)
								}
								inFlight[m.Lane] = true
								var seq int
								fmt.Sscan(m.Headers["seq"], &seq)
								if last, ok := lastSeq[m.Lane]; ok && seq != last+1 {
									problems = append(problems, fmt.Sprintf("group %s: %d after %d", m.Lane, seq, last))
								}
								lastSeq[m.Lane] = seq
							}
						}
						mu.Unlock()
						ss := make([]driver.Settlement, 0, len(ms))
						mu.Lock()
						for _, m := range ms {
							inFlight[m.Lane] = false
							ss = append(ss, ack(m))
						}
						mu.Unlock()
						if err := d.Settle(ctx, ss); err != nil {
							t.Error(err)
						}
						if b.Stats("q").Acked == total {
							cancel()
						}
					}
				})
			}
			wg.Wait()

			if st := b.Stats("q"); st != (memory.QueueStats{Acked: total}) {
				t.Fatalf("Stats = %+v, want all %d acked", st, total)
			}
			if len(seen) != total {
				t.Fatalf("delivered %d distinct messages, want %d", len(seen), total)
			}
			for id, n := range seen {
				if n != 1 {
					t.Errorf("%s delivered %d times", id, n)
				}
			}
			for _, p := range problems[:min(len(problems), 5)] {
				t.Error(p)
			}
		})
	}
}
