package rabbit_test

import (
	"context"
	"errors"
	"io"
	"net"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/rabbit"
)

// doomedNode is a node address that dies on demand: a TCP listener that
// forwards every connection to the real broker, byte for byte, until Kill
// closes the listener and every connection through it, as a node that
// dies does to its clients. Behind it is the real RabbitMQ, so nothing
// about AMQP is imitated; what it stands for is a second node of the same
// cluster (one broker reached at two addresses keeps its queues whichever
// address a client uses).
type doomedNode struct {
	ln       net.Listener
	mu       sync.Mutex
	conns    []net.Conn
	accepted int
	dead     bool
	hung     bool // accept and never answer
}

func newDoomedNode(t *testing.T, target string) *doomedNode {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	n := &doomedNode{ln: ln}
	t.Cleanup(n.Kill)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			n.mu.Lock()
			if n.hung {
				n.conns = append(n.conns, c) // held open, never answered
				n.mu.Unlock()
				continue
			}
			n.mu.Unlock()
			up, err := net.DialTimeout("tcp", target, 5*time.Second)
			n.mu.Lock()
			if err != nil || n.dead {
				n.mu.Unlock()
				c.Close()
				if up != nil {
					up.Close()
				}
				continue
			}
			n.accepted++
			n.conns = append(n.conns, c, up)
			n.mu.Unlock()
			go func() { _, _ = io.Copy(up, c); up.Close() }()
			go func() { _, _ = io.Copy(c, up); c.Close() }()
		}
	}()
	return n
}

func (n *doomedNode) Addr() string { return n.ln.Addr().String() }

// Accepted is how many client connections it forwarded.
func (n *doomedNode) Accepted() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.accepted
}

// Kill closes the listener and every connection through it.
func (n *doomedNode) Kill() {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.dead = true
	n.ln.Close()
	for _, c := range n.conns {
		c.Close()
	}
}

// Hang closes every connection through the node and leaves it accepting
// new ones that it never answers, as a node whose machine froze or whose
// network drops packets: a dial to it waits out its timeout.
func (n *doomedNode) Hang() {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.hung = true
	for _, c := range n.conns {
		c.Close()
	}
	n.conns = nil
}

// withNodes returns raw, a one-node URL, naming the nodes hosts instead.
func withNodes(t *testing.T, raw string, hosts ...string) string {
	t.Helper()
	u, err := url.Parse(raw)
	must(t, err)
	u.Host = strings.Join(hosts, ",")
	return u.String()
}

// TestClientsMoveToTheNextNodeWhenTheirNodeDies: with two nodes in the URL
// (amqp://USER:PASSWORD@NODE1,NODE2/), a busy consumer and publishers
// connect to the first, and when it dies under them they reconnect to the
// second by themselves: every confirmed message is consumed, with
// duplicates only of the deliveries that were unacked when it died, and the
// reconnection is logged with the node it reached. Without the node list,
// the clients would dial the dead node for ever.
func TestClientsMoveToTheNextNodeWhenTheirNodeDies(t *testing.T) {
	base := amqpURL(t)
	u, err := url.Parse(base)
	must(t, err)
	first := newDoomedNode(t, u.Host)
	nodes := withNodes(t, base, first.Addr(), u.Host)
	busyThroughFaultAt(t, nodes, func(string) {
		if got := first.Accepted(); got != 3 {
			t.Fatalf("the first node forwarded %d connections before it died, want 3: the two Brokers' publishing connections and the consuming one", got)
		}
		first.Kill()
	})
}

// TestReconnectTriesAnotherNodeBeforeTheOneThatFailed: when the node under
// the clients hangs (it still accepts connections, and never answers), the
// clients reconnect to the next node at once, instead of waiting out a dial
// timeout (30 s here) on the node they just lost.
func TestReconnectTriesAnotherNodeBeforeTheOneThatFailed(t *testing.T) {
	base := amqpURL(t)
	u, err := url.Parse(base)
	must(t, err)
	first := newDoomedNode(t, u.Host)
	run := busyThroughFaultAt(t, withNodes(t, base, first.Addr(), u.Host), func(string) {
		if got := first.Accepted(); got != 3 {
			t.Fatalf("the first node forwarded %d connections, want 3", got)
		}
		first.Hang()
	}, rabbit.WithDialTimeout(30*time.Second))
	if run.resumed > 15*time.Second {
		t.Errorf("the clients resumed %v after their node hung: they dialed it again first", run.resumed)
	}
}

// TestDialSkipsADeadNodeAndSaysSo: a first node that refuses connections is
// skipped at once; the Broker connects to the next, works there, and logs
// at WARN which node failed and why. A list whose every node is dead fails
// with ErrUnreachable, saying so.
func TestDialSkipsADeadNodeAndSaysSo(t *testing.T) {
	base := amqpURL(t)
	u, err := url.Parse(base)
	must(t, err)
	dead := newDoomedNode(t, u.Host)
	dead.Kill()

	logger, logs := capture(t)
	name := testenv.UniqueName(t, "skip")
	deleteLater(t, []string{name}, nil)
	b, err := rabbit.Dial(withNodes(t, base, dead.Addr(), u.Host), rabbit.WithLogger(logger),
		rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: name}}}))
	must(t, err)
	t.Cleanup(func() { b.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	must(t, b.Publish(ctx, name, consumer.Message{Body: []byte("x")}))
	if out := logs.String(); !strings.Contains(out, "connected to a later node") || !strings.Contains(out, dead.Addr()) {
		t.Errorf("no WARN names the dead node %s:\n%s", dead.Addr(), out)
	}

	_, err = rabbit.Dial(withNodes(t, base, dead.Addr(), dead.Addr()), rabbit.WithDialTimeout(2*time.Second))
	if !errors.Is(err, consumer.ErrUnreachable) || !strings.Contains(err.Error(), "every node of the 2 failed") {
		t.Errorf("Dial of dead nodes = %v, want ErrUnreachable saying every node failed", err)
	}
}
