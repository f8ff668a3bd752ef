package rabbit

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
)

// connMgr owns one connection of the Broker and opens a new one when it is
// lost, declaring the topology on it.
type connMgr struct {
	b    *Broker
	role string

	mu       sync.Mutex
	conn     *amqp.Connection
	gen      uint64
	dead     chan struct{} // closed when conn is lost
	blocked  atomic.Pointer[blockState]
	unblockC chan struct{} // closed when the connection is unblocked; replaced on block
	watchers sync.WaitGroup

	dialing  *dialCall // the dial under way, nil when none
	nextNode int       // the node of Broker.uris a dial tries first
	node     string    // host:port of the node of the last connection
	failures int       // dials failed in a row
	lastErr  error     // of the last failed dial
	nextDial time.Time // no dial before this after a failure (backoff)
}

// dialCall is one dial, which every caller needing the connection waits
// for with its own context.
type dialCall struct {
	done chan struct{}
	conn *amqp.Connection
	err  error
}

type blockState struct{ reason string }

func newConnMgr(b *Broker, role string) *connMgr {
	return &connMgr{b: b, role: role}
}

// get returns the live connection, dialing (and declaring the topology) when
// there is none. The dial runs on its own goroutine, bounded by the dial
// timeout and by Close, and no lock is held meanwhile: every caller waits
// for it (one dial for all) only as long as its own ctx allows. After a
// failed dial the next one waits a backoff shared by all callers.
func (m *connMgr) get(ctx context.Context) (*amqp.Connection, error) {
	m.mu.Lock()
	if m.b.isClosed() {
		m.mu.Unlock()
		return nil, ErrClosed
	}
	if m.conn != nil && !m.conn.IsClosed() {
		conn := m.conn
		m.mu.Unlock()
		return conn, nil
	}
	if err := ctx.Err(); err != nil {
		m.mu.Unlock()
		return nil, err
	}
	dc := m.dialing
	if dc == nil {
		dc = &dialCall{done: make(chan struct{})}
		m.dialing = dc
		wait := time.Until(m.nextDial)
		m.watchers.Go(func() { m.dial(dc, wait) })
	}
	m.mu.Unlock()
	select {
	case <-dc.done:
		return dc.conn, dc.err
	case <-ctx.Done():
		m.mu.Lock()
		last := m.lastErr
		m.mu.Unlock()
		if last != nil {
			// last says what kind of failure it was.
			return nil, fmt.Errorf("rabbit: connect to %s: %w (the last attempt: %w)", m.b.redacted, ctx.Err(), last)
		}
		return nil, fmt.Errorf("rabbit: connect to %s: %w: %w", m.b.redacted, consumer.ErrUnreachable, ctx.Err())
	case <-m.b.closed:
		return nil, ErrClosed
	}
}

// dial waits out the backoff, dials and records the outcome in dc.
func (m *connMgr) dial(dc *dialCall, wait time.Duration) {
	var conn *amqp.Connection
	err := ErrClosed
	if wait <= 0 || m.b.sleep(m.b.life, wait, nil) {
		conn, err = m.connect()
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.dialing = nil
	if err != nil {
		m.failures++
		m.lastErr = err
		m.nextDial = time.Now().Add(m.b.backoff(m.failures - 1))
		dc.err = err
		close(dc.done)
		return
	}
	if m.b.isClosed() {
		_ = conn.CloseDeadline(time.Now().Add(closeWait))
		dc.err = ErrClosed
		close(dc.done)
		return
	}
	m.failures, m.lastErr, m.nextDial = 0, nil, time.Time{}
	m.b.connected.Store(true)
	m.gen++
	m.conn = conn
	m.dead = make(chan struct{})
	m.unblockC = make(chan struct{})
	m.blocked.Store(nil)
	closes := conn.NotifyClose(make(chan *amqp.Error, 1))
	blocks := conn.NotifyBlocked(make(chan amqp.Blocking, 4))
	dead := m.dead
	gen := m.gen
	m.watchers.Go(func() { m.watch(conn, gen, dead, closes, blocks) })
	if gen > 1 {
		m.b.log.Info("rabbit: reconnected", "connection", m.role, "generation", gen, "node", m.node)
	}
	dc.conn = conn
	close(dc.done)
}

// connect opens a connection to one of the Broker's nodes: each in turn,
// from the one after the node of the last connection (so a node that just
// died is tried last), until one connects; a single node is tried once.
// Nodes that failed before one connected are logged at WARN with their
// errors; when none connects, the error says so (see nodesFailed). Only
// dial goroutines call it, one at a time, so nextNode and node need no
// lock.
func (m *connMgr) connect() (*amqp.Connection, error) {
	n := len(m.b.uris)
	var failed []string
	var errs []error
	for i := range n {
		node := (m.nextNode + i) % n
		conn, err := m.connectTo(m.b.uris[node])
		if err == nil {
			m.nextNode = (node + 1) % n
			m.node = nodeAddr(m.b.uris[node])
			if len(failed) > 0 {
				m.b.log.Warn("rabbit: connected to a later node of the list: the nodes before it failed",
					"connection", m.role, "node", m.node, "failed", strings.Join(failed, "; "))
			}
			return conn, nil
		}
		if errors.Is(err, ErrClosed) {
			return nil, err
		}
		failed = append(failed, nodeAddr(m.b.uris[node])+": "+err.Error())
		errs = append(errs, err)
	}
	return nil, nodesFailed(errs, failed)
}

// nodesFailed is the error of a dial whose every node failed, errs in the
// order tried, failed the same as "host:port: error" lines. One node's is
// its error. Of several, the kind the caller acts on must not depend on
// which node came last: a refusal of the user (bad credentials, 403) holds
// on every node of a cluster and is returned as it is, whatever else
// failed; other refusals (a node's certificate, a vhost down on it) are
// the answer only when every node refused; otherwise the cluster is
// unreachable for now, and the first such node's error is returned. Every
// node's reason is in the message.
func nodesFailed(errs []error, failed []string) error {
	if len(errs) == 1 {
		return errs[0]
	}
	pick := -1
	for i, err := range errs {
		if refusesTheUser(err) {
			pick = i
			break
		}
		if pick < 0 && !errors.Is(err, consumer.ErrRefused) {
			pick = i
		}
	}
	if pick < 0 { // every node refused, none the user
		pick = len(errs) - 1
	}
	return fmt.Errorf("%w (every node of the %d failed: %s)", errs[pick], len(errs), strings.Join(failed, "; "))
}

// refusesTheUser reports whether err refuses the user, which every node of
// a cluster does alike: bad credentials, or access refused (403).
func refusesTheUser(err error) bool {
	if errors.Is(err, amqp.ErrCredentials) || errors.Is(err, amqp.ErrSASL) {
		return true
	}
	var ae *amqp.Error
	return errors.As(err, &ae) && ae.Code == amqp.AccessRefused
}

// nodeAddr is a node's host:port, for logs.
func nodeAddr(u amqp.URI) string { return net.JoinHostPort(u.Host, strconv.Itoa(u.Port)) }

// connectTo opens a connection to the node uri and declares the topology
// on it, within the dial timeout and until Close: the TCP connect with the
// context, the TLS and AMQP handshakes and the declarations under a
// deadline that Close brings forward.
func (m *connMgr) connectTo(uri amqp.URI) (*amqp.Connection, error) {
	ctx, cancel := context.WithTimeout(m.b.life, m.b.cfg.dialTimeout)
	defer cancel()
	var mu sync.Mutex
	var netConn net.Conn
	stop := context.AfterFunc(ctx, func() {
		mu.Lock()
		defer mu.Unlock()
		if netConn != nil {
			_ = netConn.SetDeadline(time.Now()) // ends the handshake or a declaration
		}
	})
	cfg := amqp.Config{
		Heartbeat:  m.b.cfg.heartbeat,
		Locale:     "en_US",
		Properties: amqp.Table{"connection_name": m.b.cfg.name + " " + m.role},
		Dial: func(network, addr string) (net.Conn, error) {
			var d net.Dialer
			c, err := d.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			// amqp091 clears the deadline once the AMQP handshake is done.
			deadline, _ := ctx.Deadline()
			if err := c.SetDeadline(deadline); err != nil {
				c.Close()
				return nil, err
			}
			mu.Lock()
			netConn = c
			mu.Unlock()
			if ctx.Err() != nil {
				c.Close()
				return nil, ctx.Err()
			}
			return c, nil
		},
	}
	if uri.Scheme == "amqps" {
		t := m.b.cfg.tls
		if t == nil {
			t = &tls.Config{}
		}
		t = t.Clone()
		if t.ServerName == "" {
			t.ServerName = uri.Host
		}
		cfg.TLSClientConfig = t
	}
	conn, err := amqp.DialConfig(uri.String(), cfg)
	if err != nil {
		if ctx.Err() != nil && m.b.isClosed() {
			return nil, ErrClosed
		}
		kind := classify(err, stageHandshake, m.b.connected.Load())
		return nil, fmt.Errorf("rabbit: connect to %s: %w: %w", m.b.redacted, kind, scrub(err, uri.String()))
	}
	err = m.b.cfg.topology.declare(conn)
	if !stop() {
		// The deadline was brought forward: the connection is unusable.
		err = errors.Join(err, ctx.Err())
	}
	if err != nil {
		_ = conn.CloseDeadline(time.Now().Add(closeWait))
		if m.b.isClosed() {
			return nil, ErrClosed
		}
		return nil, fmt.Errorf("rabbit: declare topology on %s: %w", m.b.redacted, withKind(err, stageDeclare, true))
	}
	return conn, nil
}

// watch drains the connection's notifications until both channels close,
// so the library's reader never waits on us.
func (m *connMgr) watch(conn *amqp.Connection, gen uint64, dead chan struct{}, closes chan *amqp.Error, blocks chan amqp.Blocking) {
	for closes != nil || blocks != nil {
		select {
		case e, ok := <-closes:
			if !ok {
				closes = nil
				m.markDead(dead)
				continue
			}
			if e != nil && !m.b.isClosed() {
				m.b.log.Warn("rabbit: connection lost", "connection", m.role, "generation", gen, "err", e)
			}
		case bl, ok := <-blocks:
			if !ok {
				blocks = nil
				continue
			}
			m.setBlocked(bl)
		}
	}
}

func (m *connMgr) markDead(dead chan struct{}) {
	m.mu.Lock()
	defer m.mu.Unlock()
	select {
	case <-dead:
	default:
		close(dead)
	}
	if m.blocked.Load() != nil {
		m.blocked.Store(nil)
		close(m.unblockC)
		m.unblockC = make(chan struct{})
	}
}

func (m *connMgr) setBlocked(bl amqp.Blocking) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if bl.Active {
		if m.blocked.Load() == nil {
			m.b.log.Warn("rabbit: broker blocked the connection", "connection", m.role, "reason", bl.Reason)
		}
		m.blocked.Store(&blockState{reason: bl.Reason})
		return
	}
	if m.blocked.Load() != nil {
		m.b.log.Info("rabbit: broker unblocked the connection", "connection", m.role)
		m.blocked.Store(nil)
		close(m.unblockC)
		m.unblockC = make(chan struct{})
	}
}

// blockedWait returns the reason the connection is blocked and a channel
// closed when it is unblocked, or "" and nil when it is not blocked.
func (m *connMgr) blockedWait() (string, <-chan struct{}) {
	st := m.blocked.Load()
	if st == nil {
		return "", nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	st = m.blocked.Load()
	if st == nil {
		return "", nil
	}
	return st.reason, m.unblockC
}

// closeWait is how long a close waits for the broker's answer.
const closeWait = 400 * time.Millisecond

// close closes the connection, cutting it after closeWait when the broker
// does not answer (a blocked connection), and waits for the watcher.
func (m *connMgr) close() {
	m.mu.Lock()
	conn := m.conn
	m.mu.Unlock()
	if conn != nil && !conn.IsClosed() {
		_ = conn.CloseDeadline(time.Now().Add(closeWait))
	}
	m.watchers.Wait()
}
