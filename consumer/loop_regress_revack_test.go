package consumer

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
)

type slowSettle struct {
	*scriptLog
	gate     chan struct{}
	once     sync.Once
	mu       sync.Mutex
	revDone  chan struct{}
	lateAcks []any
}

func (s *slowSettle) Settle(ctx context.Context, b []driver.Settlement) error {
	s.once.Do(func() { <-s.gate }) // the first Settle is slow (a broker round trip)
	s.mu.Lock()
	if s.revDone != nil {
		select {
		case <-s.revDone:
			for _, st := range b {
				if st.Handle == "A" {
					s.lateAcks = append(s.lateAcks, st.Handle)
				}
			}
		default:
		}
	}
	s.mu.Unlock()
	return s.scriptLog.Settle(ctx, b)
}

// A revocation's Done waits until the outcomes decided before it (an ack of
// the revoked lane waiting behind a slow Settle) have reached the driver:
// a Kafka rebalance callback that commits what finished must see them, and
// no ack may reach the driver for a lane the consumer no longer owns.
func TestRevocationDoneWaitsForDecidedAcks(t *testing.T) {
	drv := &slowSettle{scriptLog: newScriptLog(false), gate: make(chan struct{})}
	drv.push(driver.Message{ID: "X", Lane: "1", Attempt: 1, Handle: "X"})
	l, err := New(drv, WithConcurrency(2))
	if err != nil {
		t.Fatal(err)
	}
	stop := runLoop(t, l, HandlerFunc(func(ctx context.Context, m *Message) error { return nil }))
	eventually(t, "X acked (settle in progress)", func() bool { return l.Stats().Acked == 1 })
	time.Sleep(20 * time.Millisecond) // the settler is now stuck in the first Settle
	drv.push(driver.Message{ID: "A", Lane: "0", Attempt: 1, Handle: "A"})
	eventually(t, "A's handler succeeded", func() bool { return l.Stats().Acked == 2 })
	done := make(chan struct{})
	drv.mu.Lock()
	drv.revDone = done
	drv.mu.Unlock()
	drv.revCh <- driver.Revocation{Lanes: []string{"0"}, Done: done}
	select {
	case <-done:
		t.Fatal("Done closed while the ack of A, decided before the revocation, had not reached the driver")
	case <-time.After(100 * time.Millisecond):
	}
	close(drv.gate) // the slow Settle completes; A's ack goes out, then Done closes
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("Done never closed")
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if acts := drv.outcomes()["A"]; len(acts) != 1 || acts[0] != driver.Ack {
		t.Errorf("A settled %v, want one ack before Done", acts)
	}
	if len(drv.lateAcks) > 0 {
		t.Errorf("Ack of %v reached the driver after the revocation of its lane was declared done", drv.lateAcks)
	}
}
