package rabbit_test

import (
	"context"
	"io"
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

// blackhole is a TCP proxy to the broker that can turn into a black hole:
// it drops every proxied connection and accepts new ones without ever
// answering (a partitioned network, a host that died without a RST).
type blackhole struct {
	ln    net.Listener
	to    string
	mu    sync.Mutex
	hole  bool
	shut  bool // refuse: accept and close at once (a broker restarting)
	seen  int  // connections accepted
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
}

func newBlackhole(t *testing.T, to string) *blackhole {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	p := &blackhole{ln: ln, to: to, conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

func (p *blackhole) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.conns == nil {
		c.Close()
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *blackhole) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		if !p.track(c) {
			continue
		}
		p.mu.Lock()
		hole, shut := p.hole, p.shut
		p.seen++
		p.mu.Unlock()
		if shut {
			c.Close()
			continue
		}
		if hole {
			p.wg.Go(func() { _, _ = io.Copy(io.Discard, c) })
			continue
		}
		up, err := net.Dial("tcp", p.to)
		if err != nil || !p.track(up) {
			c.Close()
			continue
		}
		p.wg.Go(func() { _, _ = io.Copy(up, c); up.Close(); c.Close() })
		p.wg.Go(func() { _, _ = io.Copy(c, up); up.Close(); c.Close() })
	}
}

// cut drops every connection and swallows new ones.
func (p *blackhole) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.hole = true
	for c := range p.conns {
		c.Close()
	}
}

// refuse drops every connection and closes new ones at once.
func (p *blackhole) refuse() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.shut = true
	for c := range p.conns {
		c.Close()
	}
}

func (p *blackhole) accepted() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.seen
}

func (p *blackhole) close() {
	p.ln.Close()
	p.mu.Lock()
	for c := range p.conns {
		c.Close()
	}
	p.conns = nil
	p.mu.Unlock()
	p.wg.Wait()
}

// proxiedURL returns the broker's URL with its host and port replaced by
// the proxy's.
func proxiedURL(t *testing.T, p *blackhole) string {
	u := amqpURL(t)
	i := strings.Index(u, "@")
	j := strings.Index(u[i:], "/")
	return u[:i+1] + p.ln.Addr().String() + u[i+j:]
}

func brokerAddr(t *testing.T) string {
	u := amqpURL(t)
	i := strings.Index(u, "@")
	j := strings.Index(u[i:], "/")
	return u[i+1 : i+j]
}

// TestPublishReturnsWithinItsContextWhileBrokerUnreachable: while
// the broker cannot be reached (packets dropped), Publish overruns its
// context by up to the whole dial timeout.
//
// broker.go:447-467: connMgr.get checks ctx only before dialing, then
// amqp.DialConfig (which takes no context) blocks for DialTimeout (TCP and
// the AMQP handshake); publish.go:299 (publisher.channel, publish.go:140)
// calls it on Publish's own goroutine. A caller that gave Publish 500ms
// (a request path, an outbox relay tick) waits the whole DialTimeout, here
// 4s (10s by default), and every other Publish waits as long behind
// connMgr.mu and publisher.mu.
func TestPublishReturnsWithinItsContextWhileBrokerUnreachable(t *testing.T) {
	name := testenv.UniqueName(t, "rv-hole-pub")
	deleteLater(t, []string{name}, nil)
	p := newBlackhole(t, brokerAddr(t))
	b, err := rabbit.Dial(proxiedURL(t, p), rabbit.WithLogger(testLogger(t)), rabbit.WithDialTimeout(4*time.Second),
		rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: name, Classic: true}}}))
	must(t, err)
	t.Cleanup(func() { b.Close() })
	must(t, b.Publish(testenv.Context(t, 5*time.Second), name, consumer.Message{Body: []byte("before")}))

	p.cut()
	time.Sleep(300 * time.Millisecond) // the library sees the connection end

	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	start := time.Now()
	err = b.Publish(ctx, name, consumer.Message{Body: []byte("during")})
	took := time.Since(start)
	if err == nil {
		t.Fatal("Publish through a black hole succeeded")
	}
	if took > 1500*time.Millisecond {
		t.Errorf("Publish with a 500ms context returned after %s (%v)", took.Round(10*time.Millisecond), err)
	}
}

// TestCloseReturnsWithinASecondWhileRedialing: Broker.Close hangs for
// the whole dial timeout when the consuming connection was lost and the
// driver is dialing a broker that does not answer.
//
// broker.go:438-467: connMgr.get holds m.mu across amqp.DialConfig, which
// the driver's supervisor calls (driver.go:218 -> driver.go:331) with a
// context that Close cancels but that DialConfig never sees. Broker.Close
// waits for the supervisor (driver.go:1029 via broker.go:364) and then for
// m.mu (broker.go:570), so it returns only when the dial times out: 4s
// here, 10s by default, against the package's promise (broker.go:349-350)
// and the "Close returns within a second". A service shutting down
// during a network partition overruns its termination grace.
func TestCloseReturnsWithinASecondWhileRedialing(t *testing.T) {
	name := testenv.UniqueName(t, "rv-hole-close")
	deleteLater(t, []string{name}, nil)
	p := newBlackhole(t, brokerAddr(t))
	b, err := rabbit.Dial(proxiedURL(t, p), rabbit.WithLogger(testLogger(t)), rabbit.WithDialTimeout(4*time.Second),
		rabbit.WithReconnectBackoff(20*time.Millisecond, 50*time.Millisecond),
		rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: name, Classic: true}}}))
	must(t, err)
	t.Cleanup(func() { b.Close() })
	d, err := openDriver(t, b, name, driver.Config{})
	must(t, err)
	fetched := make(chan error, 1)
	go func() {
		_, err := d.Fetch(context.Background(), nil, 1) // starts the supervisor; the queue is empty
		fetched <- err
	}()
	// Let the supervisor open its channel and consume.
	testenv.WaitFor(t, 10*time.Second, "a consumer on the queue", func() bool {
		for _, line := range strings.Split(ctl(t, "list_queues", "name", "consumers"), "\n") {
			if f := strings.Fields(line); len(f) == 2 && f[0] == name && f[1] == "1" {
				return true
			}
		}
		return false
	})

	p.cut()
	time.Sleep(500 * time.Millisecond) // the supervisor is now dialing into the hole

	start := time.Now()
	must(t, b.Close())
	if took := time.Since(start); took > time.Second {
		t.Errorf("Close took %s while the driver redialed", took.Round(10*time.Millisecond))
	}
	select {
	case <-fetched:
	case <-time.After(10 * time.Second):
		t.Error("Fetch did not return after Close")
	}
}

// TestPublishDoesNotRedialPerMessage: while the broker refuses
// connections (restarting, or its listener down), one Publish call of n
// messages dials the broker n times back to back, with no backoff.
//
// publish.go:279-303: a failure to get a channel (publish.go:299-302) is
// recorded for that message and the loop goes on to the next message,
// which calls publisher.channel -> connMgr.get -> amqp.DialConfig again
// (broker.go:438-469: "It does not back off: its callers do" -- this
// caller does not). Every publishing goroutine of every instance thus
// hammers a recovering broker with a dial per message: the reconnect storm
// the "reopened with backoff and jitter" is meant to prevent.
func TestPublishDoesNotRedialPerMessage(t *testing.T) {
	name := testenv.UniqueName(t, "rv-storm")
	deleteLater(t, []string{name}, nil)
	p := newBlackhole(t, brokerAddr(t))
	b, err := rabbit.Dial(proxiedURL(t, p), rabbit.WithLogger(testLogger(t)),
		rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: name, Classic: true}}}))
	must(t, err)
	t.Cleanup(func() { b.Close() })
	must(t, b.Publish(testenv.Context(t, 5*time.Second), name, consumer.Message{Body: []byte("before")}))

	p.refuse()
	time.Sleep(300 * time.Millisecond)
	before := p.accepted()
	msgs := make([]consumer.Message, 200)
	for i := range msgs {
		msgs[i] = consumer.Message{Body: []byte("during")}
	}
	err = b.Publish(testenv.Context(t, 5*time.Second), name, msgs...)
	if err == nil {
		t.Fatal("Publish to a refusing broker succeeded")
	}
	if dials := p.accepted() - before; dials > 5 {
		t.Errorf("one Publish of %d messages dialed the broker %d times, with no backoff", len(msgs), dials)
	}
}
