package kafka

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
)

// This file is what the adapter knows of its connections to the cluster.
// franz-go retries failed dials, lost connections and refused logins
// inside the client, and a caller of PollRecords or ProduceSync sees only
// that nothing comes (until its context ends). So every client of a Broker
// carries a link, fed by franz-go's connection hooks, that remembers what
// it last saw; and the Broker dials the connections itself, so that a TLS
// client at a plaintext listener, or the reverse, is told apart from a
// broker that is down.

// failGrace is how long every broker the client talks to must fail, with
// none answering, before the link is down: a connection that drops and is
// dialled again at once (an idle connection the broker closed, a leader
// that moved) is not an outage.
const failGrace = time.Second

// link is what one franz-go client last saw of its connections: when a
// broker last answered, and the failures since. It implements franz-go's
// connection hooks (kgo.WithHooks).
type link struct {
	okAt    atomic.Int64 // unix nanos of the last response read from any broker; 0 never
	failing atomic.Bool  // a failure since the last response: the fast path of answered

	mu       sync.Mutex
	failFrom time.Time // the first failure since the last response; zero when none
	addr     string    // the broker of the last failure
	err      error     // the last failure

	// The last failure of all, kept when another broker answers: a
	// cluster with one broker down answers through the others, and a
	// request waiting for that broker must still be told why.
	anyAddr string
	anyErr  error
	anyAt   time.Time
}

var (
	_ kgo.HookBrokerConnect = (*link)(nil)
	_ kgo.HookBrokerE2E     = (*link)(nil)
)

// OnBrokerConnect records a failed dial or connection set-up (TLS, API
// versions, SASL).
func (l *link) OnBrokerConnect(meta kgo.BrokerMetadata, _ time.Duration, _ net.Conn, err error) {
	if err != nil {
		l.failed(meta, err)
	}
}

// OnBrokerE2E records a response read (the broker answers), or a request
// or response lost on a connection.
func (l *link) OnBrokerE2E(meta kgo.BrokerMetadata, _ int16, e kgo.BrokerE2E) {
	if err := e.Err(); err != nil {
		l.failed(meta, err)
		return
	}
	l.answered()
}

func (l *link) answered() {
	l.okAt.Store(time.Now().UnixNano())
	if l.failing.Load() {
		l.mu.Lock()
		l.failing.Store(false)
		l.failFrom, l.addr, l.err = time.Time{}, "", nil
		l.mu.Unlock()
	}
}

func (l *link) failed(meta kgo.BrokerMetadata, err error) {
	// The client's own doing: a request whose caller gave up, a client
	// or connection it closed.
	if isContextErr(err) || errors.Is(err, kgo.ErrClientClosed) || errors.Is(err, net.ErrClosed) {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.failFrom.IsZero() {
		l.failFrom = time.Now()
	}
	l.addr, l.err = net.JoinHostPort(meta.Host, strconv.Itoa(int(meta.Port))), err
	l.anyAddr, l.anyErr, l.anyAt = l.addr, err, time.Now()
	l.failing.Store(true)
}

// lastSince returns the last failure to reach a broker at or after t,
// whether or not other brokers answered since.
func (l *link) lastSince(t time.Time) (addr string, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.anyErr == nil || l.anyAt.Before(t) {
		return "", nil
	}
	return l.anyAddr, l.anyErr
}

// last returns the last failure since a broker last answered, if any.
func (l *link) last() (addr string, err error) {
	if !l.failing.Load() {
		return "", nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.addr, l.err
}

// down returns the last failure when no broker has answered since the
// failures began failGrace ago, or at once when it is a refusal (see
// isRefusal): the client cannot get through.
func (l *link) down() (addr string, err error) {
	if !l.failing.Load() {
		return "", nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.failFrom.IsZero() || time.Since(l.failFrom) < failGrace && !isRefusal(l.err) {
		return "", nil
	}
	return l.addr, l.err
}

// everAnswered reports whether a broker answered this client once.
func (l *link) everAnswered() bool { return l.okAt.Load() != 0 }

// refusedBy reports whether err is a refusal no retry can fix, as seen by
// a client with link l. A TLS/plaintext mismatch met by a client that got
// through before is taken for a connection that dropped during its
// handshake (a broker going down, a proxy): the listener was not wrong a
// moment ago.
func refusedBy(l *link, err error) bool {
	if !isRefusal(err) {
		return false
	}
	var mm *mismatchError
	return l == nil || !errors.As(err, &mm) || !l.everAnswered()
}

// isRefusal reports whether err is the cluster refusing this client for
// good: a TLS/plaintext mismatch, a failed authentication, or an
// authorization refused.
func isRefusal(err error) bool {
	var mm *mismatchError
	return errors.As(err, &mm) || isAuthErr(err) || isAuthzErr(err)
}

// isAuthzErr reports whether err is an authorization refused: the client
// authenticated, and may not read the topic or join the group.
func isAuthzErr(err error) bool {
	return errors.Is(err, kerr.TopicAuthorizationFailed) ||
		errors.Is(err, kerr.GroupAuthorizationFailed) ||
		errors.Is(err, kerr.ClusterAuthorizationFailed)
}

// refused is err, seen at addr, marked as a refusal: [consumer.ErrRefused],
// and [ErrAuthentication] when the client could not authenticate.
func refused(addr string, err error) error {
	var mm *mismatchError
	switch {
	case errors.As(err, &mm):
		return fmt.Errorf("%w: %w", consumer.ErrRefused, err) // the mismatch names the address
	case isAuthErr(err) && !errors.Is(err, ErrAuthentication):
		return fmt.Errorf("%w: %w: %s: %w", consumer.ErrRefused, ErrAuthentication, addr, err)
	}
	return fmt.Errorf("%w: %s: %w", consumer.ErrRefused, addr, err)
}

// unreachable is err, seen at addr, marked [consumer.ErrUnreachable].
func unreachable(addr string, err error) error {
	return fmt.Errorf("%w: %s: %w", consumer.ErrUnreachable, addr, err)
}

// isDialErr reports whether err is, or wraps, a failed dial.
func isDialErr(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

func isContextErr(err error) bool {
	return errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
}

// mismatchError is a connection that met the other kind of listener: a
// TLS client at a plaintext listener (which closes the connection on the
// client's hello), or a plaintext client at a TLS listener (which answers
// with a TLS alert). It keeps its cause out of the error chain on
// purpose: franz-go retries an error that wraps a reset connection, and
// this one no retry fixes.
type mismatchError struct {
	addr      string
	clientTLS bool
	cause     error
}

func (e *mismatchError) Error() string {
	if e.clientTLS {
		return fmt.Sprintf("TLS mismatch: the client speaks TLS, but the listener at %s does not: it closed the connection on the TLS hello (%v); is it a plaintext listener?", e.addr, e.cause)
	}
	return fmt.Sprintf("TLS mismatch: the listener at %s speaks TLS, but the client does not: it answered with a TLS alert; configure TLS (WithTLS) or use a plaintext listener", e.addr)
}

// dialer dials every connection of a Broker's clients (unless
// [WithClientOpts] brings a kgo.Dialer or kgo.DialTLSConfig of its own), as
// franz-go's default dialer does, over TLS with [WithTLS]'s config, and
// tells a TLS/plaintext mismatch apart from a broker that is down: see
// mismatchError.
type dialer struct {
	timeout time.Duration // kgo.DialTimeout: the dial and the TLS handshake
	tls     *tls.Config   // nil: plaintext
}

func (d *dialer) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, d.timeout)
	defer cancel()
	raw, err := (&net.Dialer{}).DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	c := &watchedConn{Conn: raw, addr: addr, plain: d.tls == nil}
	if d.tls == nil {
		return c, nil
	}
	cfg := d.tls.Clone()
	if cfg.ServerName == "" {
		host, _, err := net.SplitHostPort(addr)
		if err != nil {
			_ = raw.Close()
			return nil, fmt.Errorf("unable to split host:port for dialing: %w", err)
		}
		cfg.ServerName = host
	}
	tc := tls.Client(c, cfg)
	if err := tc.HandshakeContext(ctx); err != nil {
		_ = raw.Close()
		var rh tls.RecordHeaderError
		switch {
		case ctx.Err() != nil:
		case c.read == 0 && (errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET)),
			errors.As(err, &rh): // it answered, not in TLS
			return nil, &mismatchError{addr: addr, clientTLS: true, cause: err}
		}
		return nil, err
	}
	return tc, nil
}

// watchedConn counts what the listener sent first: under TLS, whether it
// said anything before it closed the connection; in plaintext, whether
// its first bytes are a TLS alert record (no Kafka response starts so: it
// would announce more than 350 MB).
type watchedConn struct {
	net.Conn
	addr  string
	plain bool
	read  int // bytes read so far; only the reading goroutine touches it
}

func (c *watchedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	first := c.read == 0
	c.read += n
	if c.plain && first && n >= 2 && p[0] == 0x15 && p[1] == 0x03 {
		return 0, &mismatchError{addr: c.addr}
	}
	return n, err
}
