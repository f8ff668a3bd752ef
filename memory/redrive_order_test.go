package memory_test

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/memory"
)

// Leases that run out (never settled), redrive after one receive to a FIFO
// dead-letter queue, several fetchers at once: the dead-letter queue keeps
// each group's order, so a redrive replays it in order.
func TestRedriveKeepsGroupOrderInTheDeadLetterQueue(t *testing.T) {
	for round := 0; round < 30; round++ {
		b := newBroker(t)
		createQueue(t, b, "dlq", memory.QueueConfig{FIFO: true})
		createQueue(t, b, "q", memory.QueueConfig{FIFO: true, VisibilityTimeout: 50 * time.Microsecond, MaxReceiveCount: 1, DeadLetterQueue: "dlq"})
		const groups, per = 4, 200
		for i := 0; i < per; i++ {
			for g := 0; g < groups; g++ {
				publish(t, b, "q", consumer.Message{Key: "g" + strconv.Itoa(g), Body: []byte(strconv.Itoa(i))})
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		var wg sync.WaitGroup
		for w := 0; w < 8; w++ {
			d := newDriver(t, b, "q")
			wg.Add(1)
			go func() {
				defer wg.Done()
				for ctx.Err() == nil {
					if st := b.Stats("q"); st.Visible+st.InFlight+st.Delayed == 0 {
						return
					}
					fctx, fc := context.WithTimeout(ctx, 5*time.Millisecond)
					d.Fetch(fctx, nil, 10)
					fc()
				}
			}()
		}
		wg.Wait()
		cancel()
		last := map[string]int{}
		dl := b.Messages("dlq")
		if len(dl) != groups*per {
			t.Fatalf("dlq has %d", len(dl))
		}
		for _, m := range dl {
			n, _ := strconv.Atoi(string(m.Body))
			if p, ok := last[m.Key]; ok && n <= p {
				t.Fatalf("round %d: DLQ group %s: %d after %d", round, m.Key, n, p)
			}
			last[m.Key] = n
		}
	}
}
