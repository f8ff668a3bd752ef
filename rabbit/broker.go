package rabbit

import (
	"context"
	crand "crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/url"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/msgmetrics"
	"github.com/ferrymq/ferry/internal/urlsecret"
)

// Errors of the package. Match them with errors.Is; an error the broker sent
// (a channel or connection closed by it) is also an *amqp091.Error, reached
// with errors.As.
var (
	// ErrClosed is returned by every call on a closed Broker or Driver. A
	// Fetch wraps it with driver.Fatal, so a consumer.Loop's Run ends.
	ErrClosed = errors.New("rabbit: broker closed")

	// ErrUnroutable is the reason for a message the broker returned because
	// no queue was bound to take it (published mandatory).
	ErrUnroutable = errors.New("rabbit: message unroutable")

	// ErrNacked is the reason for a message the broker refused (a negative
	// publisher confirm).
	ErrNacked = errors.New("rabbit: message nacked by the broker")

	// ErrBlocked is returned, with the context's error, by a Publish whose
	// context ended while the broker blocked the connection (a memory or
	// disk alarm).
	ErrBlocked = errors.New("rabbit: broker blocked the connection")

	// ErrNotConfirmed is the reason for a message whose channel closed before
	// the broker confirmed it, the broker not having refused it (that is
	// ErrRefused): the connection was lost or closed. It may or may not have
	// been taken.
	ErrNotConfirmed = errors.New("rabbit: channel closed before the publish was confirmed")

	// ErrEarlierFailed is the reason for a message not published because an
	// earlier message of the same key in the same call failed.
	ErrEarlierFailed = errors.New("rabbit: not published: an earlier message of the same key failed")

	// ErrStaleDelivery is returned by Settle for a delivery of a channel that
	// closed: the broker requeued it, and it is not acked on another channel.
	ErrStaleDelivery = errors.New("rabbit: delivery of a closed channel")

	// ErrInvalidHandle is returned by Settle for a handle that did not come
	// from this driver.
	ErrInvalidHandle = errors.New("rabbit: invalid delivery handle")

	// ErrConsumerCancelled is reported by Fetch when the broker cancelled the
	// consumer (the queue was deleted); consuming resumes once the queue is
	// declared again.
	ErrConsumerCancelled = errors.New("rabbit: consumer cancelled by the broker")
)

// Defaults of the options.
const (
	DefaultConfirmWindow = 512
	DefaultDialTimeout   = 10 * time.Second
	DefaultHeartbeat     = 10 * time.Second
	DefaultReconnectMin  = 100 * time.Millisecond
	DefaultReconnectMax  = 10 * time.Second
)

// DefaultRetryDelays are the delay queues a Return with a delay goes through
// unless WithRetryDelays says otherwise: a delay is rounded up to the next of
// these, and delays above the last go through the last.
var DefaultRetryDelays = []time.Duration{
	time.Second, 2 * time.Second, 5 * time.Second, 10 * time.Second, 30 * time.Second,
	time.Minute, 2 * time.Minute, 5 * time.Minute, 10 * time.Minute, 30 * time.Minute, time.Hour,
}

// Option configures a Broker. Dial applies the options in order and fails
// with a *consumer.ConfigError on the first that is invalid.
type Option func(*config) error

type config struct {
	logger      *slog.Logger
	topology    Topology
	window      int
	tls         *tls.Config
	dialTimeout time.Duration
	heartbeat   time.Duration
	backoffMin  time.Duration
	backoffMax  time.Duration
	retryDelays []time.Duration
	name        string
	maxMessage  int  // 0: DefaultMaxMessageSize
	lazy        bool // WithLazyConnect
	meters      metric.MeterProvider
}

// WithMeterProvider sets where Publish reports its calls, as the
// OpenTelemetry messaging conventions name them
// (messaging.client.operation.duration and messaging.client.sent.messages,
// with messaging.system "rabbitmq" and the destination as the user named
// it). Default the global provider, a no-op until one is installed. The
// consumers report through consumer.WithMeterProvider.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(c *config) error {
		if mp == nil {
			return consumer.ConfigErrorf("MeterProvider", "must not be nil")
		}
		c.meters = mp
		return nil
	}
}

// WithLogger sets the logger for reconnects, alarms and warnings. Default
// slog.Default().
func WithLogger(l *slog.Logger) Option {
	return func(c *config) error {
		if l == nil {
			return consumer.ConfigErrorf("Logger", "must not be nil")
		}
		c.logger = l
		return nil
	}
}

// WithTopology declares t when the Broker connects and again after every
// reconnect (see Topology). Default: nothing is declared.
func WithTopology(t Topology) Option {
	return func(c *config) error {
		if err := t.validate(); err != nil {
			return err
		}
		c.topology = t
		return nil
	}
}

// WithConfirmWindow sets how many published messages may wait for their
// publisher confirm at once, over all Publish calls of the Broker. Default
// 512 (DefaultConfirmWindow). A Publish beyond it waits for room.
func WithConfirmWindow(n int) Option {
	return func(c *config) error {
		if n < 1 {
			return consumer.ConfigErrorf("ConfirmWindow", "must be >= 1, got %d", n)
		}
		c.window = n
		return nil
	}
}

// WithTLS sets the TLS configuration for an amqps:// URL (its ServerName is
// the URL's host when empty). Default: the system roots.
func WithTLS(cfg *tls.Config) Option {
	return func(c *config) error {
		if cfg == nil {
			return consumer.ConfigErrorf("TLS", "must not be nil")
		}
		c.tls = cfg
		return nil
	}
}

// WithDialTimeout bounds each connection attempt (TCP, TLS and the AMQP
// handshake). Default 10s.
func WithDialTimeout(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return consumer.ConfigErrorf("DialTimeout", "must be > 0, got %v", d)
		}
		c.dialTimeout = d
		return nil
	}
}

// WithHeartbeat sets the AMQP heartbeat interval, which is how soon a dead
// peer is noticed. Default 10s.
func WithHeartbeat(d time.Duration) Option {
	return func(c *config) error {
		if d < time.Second {
			return consumer.ConfigErrorf("Heartbeat", "must be >= 1s, got %v", d)
		}
		c.heartbeat = d
		return nil
	}
}

// WithReconnectBackoff sets the backoff between attempts to reopen a lost
// connection or channel: exponential from min to max, with full jitter.
// Default 100ms to 10s.
func WithReconnectBackoff(min, max time.Duration) Option {
	return func(c *config) error {
		if min <= 0 || max < min {
			return consumer.ConfigErrorf("ReconnectBackoff", "needs 0 < min <= max, got %v and %v", min, max)
		}
		c.backoffMin, c.backoffMax = min, max
		return nil
	}
}

// WithRetryDelays sets the delay queues for a Return with a delay (see the
// package documentation): ascending, each at least a millisecond. Default
// DefaultRetryDelays.
func WithRetryDelays(delays ...time.Duration) Option {
	return func(c *config) error {
		if len(delays) == 0 {
			return consumer.ConfigErrorf("RetryDelays", "must not be empty")
		}
		for i, d := range delays {
			if d < time.Millisecond || (i > 0 && d <= delays[i-1]) {
				return consumer.ConfigErrorf("RetryDelays", "must be ascending and each >= 1ms, got %v", delays)
			}
		}
		c.retryDelays = append([]time.Duration(nil), delays...)
		return nil
	}
}

// WithLazyConnect makes Dial return without connecting: the publishing
// connection opens with the first Publish, the consuming connection when
// the first consumer starts (its Run calls the Driver's Connect). Use it
// for a service that must start, and report itself not ready, while
// RabbitMQ is down: its consumers say so (health disconnected, a WARN
// naming the queue and the broker, errors wrapping consumer.ErrUnreachable)
// and start consuming when the broker comes up. What Dial would have
// refused at once (credentials, the vhost, TLS, the topology) then ends a
// consumer's Run with a driver.Fatal error wrapping consumer.ErrRefused,
// and fails each Publish. Default: Dial connects, and fails when it cannot
// (see Dial).
func WithLazyConnect() Option {
	return func(c *config) error {
		c.lazy = true
		return nil
	}
}

// WithConnectionName names the Broker's connections in the management UI
// and in rabbitmqctl list_connections (suffixed "publish" and "consume").
// Default "ferry".
func WithConnectionName(name string) Option {
	return func(c *config) error {
		c.name = name
		return nil
	}
}

// Broker is a connection to RabbitMQ: a consumer.Publisher, and the source
// of Drivers and Consumers over its queues. It owns two connections, one for
// publishing and one for consuming, so that a broker blocking publishers
// (an alarm) never holds back acks, and reopens either when it is lost. It
// is safe for concurrent use.
type Broker struct {
	cfg      config
	uri      amqp.URI
	redacted string
	log      *slog.Logger

	pubConn  *connMgr
	consConn *connMgr
	pub      *publisher
	metrics  *msgmetrics.Publisher

	idPrefix string
	idSeq    atomic.Uint64

	mu         sync.Mutex
	drivers    map[*queueDriver]struct{}
	dropWarned map[string]bool // queues whose drop warning was logged

	connected atomic.Bool // a connection was ever opened (see classify)

	closeOnce sync.Once
	closed    chan struct{}
	life      context.Context // cancelled by Close: bounds every dial
	endLife   context.CancelFunc
}

var (
	_ consumer.Broker      = (*Broker)(nil)
	_ consumer.SystemNamer = (*Broker)(nil)
	_ driver.Opener        = (*Broker)(nil)
)

// System names the broker as OpenTelemetry's messaging.system does: "rabbitmq".
func (b *Broker) System() string { return "rabbitmq" }

// Redact returns rawURL with its password replaced by "xxxxx", for logs and
// errors. The user information runs from after "amqp://" to the last "@"
// of rawURL, so that a password holding any character, "@", "/" and
// whitespace included, is hidden whole, whether or not the URL parses.
func Redact(rawURL string) string { return urlsecret.Redact(rawURL) }

// Dial connects to the RabbitMQ at url (amqp:// or amqps://, with the vhost
// as its path) and declares the topology of WithTopology. An invalid URL or
// option fails with a *consumer.ConfigError; a broker that cannot be reached
// fails with an error wrapping consumer.ErrUnreachable, one that refuses the
// credentials, the vhost, the TLS handshake or the topology with an error
// wrapping consumer.ErrRefused, each wrapping the cause too (an
// *amqp091.Error where the broker said why). Neither error holds the
// password.
//
// Dial fails fast because the Broker is a publisher too: a service that
// publishes learns of a wrong URL, or of a broker that is down, when it
// starts rather than at its first Publish. The Drivers and consumers of a
// Broker need no connection to be built (they connect when they run, and
// reconnect by themselves), so WithLazyConnect gives a Broker, and
// consumers, that can be built while RabbitMQ is down.
func Dial(rawURL string, opts ...Option) (*Broker, error) {
	c := config{
		logger:      slog.Default(),
		window:      DefaultConfirmWindow,
		dialTimeout: DefaultDialTimeout,
		heartbeat:   DefaultHeartbeat,
		backoffMin:  DefaultReconnectMin,
		backoffMax:  DefaultReconnectMax,
		retryDelays: DefaultRetryDelays,
		name:        "ferry",
	}
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o(&c); err != nil {
			return nil, err
		}
	}
	redacted := Redact(rawURL)
	if err := urlsecret.Check(rawURL); err != nil {
		// url.Parse would read a part of the password as the host, the
		// vhost or the query, and errors quote those.
		return nil, consumer.ConfigErrorf("URL", "%s: the user and password %v", redacted, err)
	}
	uri, err := amqp.ParseURI(rawURL)
	if err != nil {
		// url.Parse's errors quote the URL or a part of it (the text
		// after the first ":" of a password holding a "/" reads as a
		// port): none of their text is kept.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = errors.New("it does not parse as a URL (reserved characters such as / @ : in the user or password must be percent-escaped)")
		}
		return nil, consumer.ConfigErrorf("URL", "%s is not an AMQP URL: %v", redacted, scrub(err, rawURL))
	}
	if c.meters == nil {
		c.meters = otel.GetMeterProvider()
	}
	pm, err := msgmetrics.NewPublisher(c.meters, "rabbitmq")
	if err != nil {
		return nil, fmt.Errorf("rabbit: metrics: %w", err)
	}
	var p [4]byte
	_, _ = crand.Read(p[:])
	b := &Broker{
		metrics:    pm,
		cfg:        c,
		uri:        uri,
		redacted:   redacted,
		log:        c.logger.With("broker", redacted),
		idPrefix:   hex.EncodeToString(p[:]) + "-",
		drivers:    make(map[*queueDriver]struct{}),
		dropWarned: make(map[string]bool),
		closed:     make(chan struct{}),
	}
	b.life, b.endLife = context.WithCancel(context.Background())
	b.pubConn = newConnMgr(b, "publish")
	b.consConn = newConnMgr(b, "consume")
	b.pub = newPublisher(b)
	if c.lazy {
		return b, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*c.dialTimeout)
	defer cancel()
	if _, err := b.pubConn.get(ctx); err != nil {
		b.endLife()
		b.closeConns()
		return nil, err
	}
	return b, nil
}

// scrub removes the URL's password from an error's text, in case a library
// quoted it (amqp091's parse errors quote the whole URL).
func scrub(err error, rawURL string) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	if out := urlsecret.Scrub(msg, urlsecret.Forms(rawURL)); out != msg {
		return &scrubbed{msg: out}
	}
	return err
}

// scrubbed is an error whose text had a password taken out. It does not
// unwrap: the original's text holds the password.
type scrubbed struct{ msg string }

func (e *scrubbed) Error() string { return e.msg }

// warnDrops logs, once per queue in the Broker's life, that RabbitMQ drops
// the messages of q, a queue of the topology that a consumer of the Broker
// opened on conn, past its delivery limit (see dropLimit).
func (b *Broker) warnDrops(q Queue, conn *amqp.Connection) {
	version, _ := conn.Properties["version"].(string)
	limit, byDefault, drops := dropLimit(q, version)
	if !drops {
		return
	}
	b.mu.Lock()
	warned := b.dropWarned[q.Name]
	b.dropWarned[q.Name] = true
	b.mu.Unlock()
	if warned {
		return
	}
	b.log.Warn("rabbit: quorum queue has no dead-letter exchange: a message delivered more than delivery_limit times is dropped (declare a DeadLetterExchange)",
		"queue", q.Name, "delivery_limit", limit, "broker_default_limit", byDefault, "rabbitmq_version", version)
}

func (b *Broker) isClosed() bool {
	select {
	case <-b.closed:
		return true
	default:
		return false
	}
}

// Close stops every Driver of the Broker (their unsettled deliveries go back
// to the queue), fails Publish calls waiting for confirms with ErrClosed, and
// closes both connections. It returns within about a second whatever the
// broker does (a blocked connection is cut). Calling it again does nothing.
func (b *Broker) Close() error {
	b.closeOnce.Do(func() {
		close(b.closed)
		b.endLife() // a dial under way ends now
		b.mu.Lock()
		ds := make([]*queueDriver, 0, len(b.drivers))
		for d := range b.drivers {
			ds = append(ds, d)
		}
		b.mu.Unlock()
		var wg sync.WaitGroup
		for _, d := range ds {
			// Closing the connection closes the channels: the drivers do
			// not wait for the broker.
			wg.Go(func() { d.close(false) })
		}
		wg.Wait()
		b.closeConns()
	})
	return nil
}

func (b *Broker) closeConns() {
	var wg sync.WaitGroup
	wg.Go(b.pubConn.close)
	if b.consConn != nil {
		wg.Go(b.consConn.close)
	}
	wg.Wait()
}

// newID returns a unique message id for a message published without one.
func (b *Broker) newID() string {
	n := b.idSeq.Add(1)
	buf := make([]byte, 0, len(b.idPrefix)+12)
	buf = append(buf, b.idPrefix...)
	return string(strconv.AppendUint(buf, n, 10))
}

// backoff returns the wait before attempt n (0-based): exponential with full
// jitter between the configured bounds.
func (b *Broker) backoff(n int) time.Duration {
	d := b.cfg.backoffMin
	for i := 0; i < n && d < b.cfg.backoffMax; i++ {
		d *= 2
	}
	d = min(d, b.cfg.backoffMax)
	return b.cfg.backoffMin/2 + rand.N(d)
}

// sleep waits d, or until ctx ends or the broker closes; it reports whether
// the wait ran its course.
func (b *Broker) sleep(ctx context.Context, d time.Duration, stop <-chan struct{}) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
	case <-b.closed:
	case <-stop:
	}
	return false
}

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
		m.b.log.Info("rabbit: reconnected", "connection", m.role, "generation", gen)
	}
	dc.conn = conn
	close(dc.done)
}

// connect opens a connection and declares the topology on it, within the
// dial timeout and until Close: the TCP connect with the context, the TLS
// and AMQP handshakes and the declarations under a deadline that Close
// brings forward.
func (m *connMgr) connect() (*amqp.Connection, error) {
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
	if m.b.uri.Scheme == "amqps" {
		t := m.b.cfg.tls
		if t == nil {
			t = &tls.Config{}
		}
		t = t.Clone()
		if t.ServerName == "" {
			t.ServerName = m.b.uri.Host
		}
		cfg.TLSClientConfig = t
	}
	conn, err := amqp.DialConfig(m.b.uri.String(), cfg)
	if err != nil {
		if ctx.Err() != nil && m.b.isClosed() {
			return nil, ErrClosed
		}
		kind := classify(err, stageHandshake, m.b.connected.Load())
		return nil, fmt.Errorf("rabbit: connect to %s: %w: %w", m.b.redacted, kind, scrub(err, m.b.uri.String()))
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
