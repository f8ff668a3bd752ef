package rabbit

import (
	"crypto/tls"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/metric"

	"github.com/ferrymq/ferry/consumer"
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
// unless [WithRetryDelays] says otherwise: a delay is rounded up to the next of
// these, and delays above the last go through the last.
var DefaultRetryDelays = []time.Duration{
	time.Second, 2 * time.Second, 5 * time.Second, 10 * time.Second, 30 * time.Second,
	time.Minute, 2 * time.Minute, 5 * time.Minute, 10 * time.Minute, 30 * time.Minute, time.Hour,
}

// Option configures a Broker. Dial applies the options in order and fails
// with a *[consumer.ConfigError] on the first that is invalid.
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
// consumers report through [consumer.WithMeterProvider].
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
// 512 ([DefaultConfirmWindow]). A Publish beyond it waits for room.
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
// naming the queue and the broker, errors wrapping [consumer.ErrUnreachable])
// and start consuming when the broker comes up. What Dial would have
// refused at once (credentials, the vhost, TLS, the topology) then ends a
// consumer's Run with a [driver.Fatal] error wrapping [consumer.ErrRefused],
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
