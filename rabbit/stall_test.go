package rabbit_test

import (
	"context"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/rabbit"
)

// freezer is a TCP proxy to the broker that can stop passing the client's
// bytes on (a stalled network): the connections stay open, nothing the
// client sends reaches the broker.
type freezer struct {
	ln     net.Listener
	to     string
	mu     sync.Mutex
	frozen bool
	thaw   *sync.Cond
	conns  []net.Conn
	wg     sync.WaitGroup
}

func newFreezer(t *testing.T, to string) *freezer {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	p := &freezer{ln: ln, to: to}
	p.thaw = sync.NewCond(&p.mu)
	p.wg.Go(p.accept)
	t.Cleanup(p.close)
	return p
}

func (p *freezer) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		up, err := net.Dial("tcp", p.to)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, up)
		p.mu.Unlock()
		p.wg.Go(func() { p.pipe(up, c, true); up.Close(); c.Close() })
		p.wg.Go(func() { p.pipe(c, up, false); up.Close(); c.Close() })
	}
}

// pipe copies src to dst; the client's side waits while frozen.
func (p *freezer) pipe(dst, src net.Conn, fromClient bool) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && fromClient {
			p.mu.Lock()
			for p.frozen {
				p.thaw.Wait()
			}
			p.mu.Unlock()
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *freezer) freeze(on bool) {
	p.mu.Lock()
	p.frozen = on
	p.thaw.Broadcast()
	p.mu.Unlock()
}

func (p *freezer) close() {
	p.ln.Close()
	p.mu.Lock()
	p.frozen = false
	p.thaw.Broadcast()
	for _, c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

// TestAtMostOnceAckConfirmedBeforeSettleReturns: an at-most-once ack
// (Settlement.BeforeRun) is reported done only once the broker has
// processed it. AMQP confirms no basic.ack: without a round trip on the
// channel after it, Settle returned nil while the ack sat in a socket
// buffer, and the loop ran a handler whose message the broker would
// redeliver.
func TestAtMostOnceAckConfirmedBeforeSettleReturns(t *testing.T) {
	name := testenv.UniqueName(t, "amo-ack")
	deleteLater(t, []string{name}, nil)
	p := newFreezer(t, brokerAddr(t))
	b, err := rabbit.Dial(proxiedFreezerURL(t, p), rabbit.WithLogger(testLogger(t)),
		rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: name, Classic: true}}}))
	must(t, err)
	t.Cleanup(func() { b.Close() })
	must(t, b.Publish(testenv.Context(t, 5*time.Second), name,
		consumer.Message{Body: []byte("one")}, consumer.Message{Body: []byte("two")}))
	d, err := openDriver(t, b, name, driver.Config{})
	must(t, err)
	t.Cleanup(func() { d.Close() })
	var ms []driver.Message
	for len(ms) < 2 {
		ms, err = d.Fetch(testenv.Context(t, 10*time.Second), ms, 2)
		must(t, err)
	}

	// Acked with the broker answering: confirmed.
	must(t, d.Settle(testenv.Context(t, 5*time.Second), []driver.Settlement{{Handle: ms[0].Handle, Action: driver.Ack, BeforeRun: true}}))

	// Acked while nothing reaches the broker: not confirmed, so it fails.
	p.freeze(true)
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	err = d.Settle(ctx, []driver.Settlement{{Handle: ms[1].Handle, Action: driver.Ack, BeforeRun: true}})
	p.freeze(false)
	if err == nil {
		t.Fatal("an at-most-once ack the broker never saw was reported done")
	}
	t.Logf("Settle: %v", err)
}

func proxiedFreezerURL(t *testing.T, p *freezer) string {
	return strings.Replace(amqpURL(t), "@"+brokerAddr(t), "@"+p.ln.Addr().String(), 1)
}

// TestLagReturnsWithinItsContextWhenTheBrokerStalls: Lag's passive declare
// is bounded by its context. The channel's methods take none: before, Lag
// waited on a stalled connection until the heartbeat timeout killed it.
func TestLagReturnsWithinItsContextWhenTheBrokerStalls(t *testing.T) {
	name := testenv.UniqueName(t, "lag-stall")
	deleteLater(t, []string{name}, nil)
	p := newFreezer(t, brokerAddr(t))
	b, err := rabbit.Dial(proxiedFreezerURL(t, p), rabbit.WithLogger(testLogger(t)),
		rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: name, Classic: true}}}))
	must(t, err)
	t.Cleanup(func() { b.Close() })
	d, err := openDriver(t, b, name, driver.Config{})
	must(t, err)
	t.Cleanup(func() { d.Close() })
	_, err = d.Lag(testenv.Context(t, 5*time.Second)) // opens the consuming connection
	must(t, err)

	p.freeze(true)
	defer p.freeze(false)
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = d.Lag(ctx)
	if took := time.Since(start); took > 1500*time.Millisecond {
		t.Errorf("Lag with a 500ms context returned after %s", took.Round(10*time.Millisecond))
	}
	if err == nil {
		t.Error("Lag on a stalled connection succeeded")
	}
}
