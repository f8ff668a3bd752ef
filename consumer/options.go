package consumer

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// DeliveryMode chooses when a message is acknowledged.
type DeliveryMode uint8

const (
	// AtLeastOnce acknowledges a message only after its handler returned nil.
	// A crash in between delivers it again. This is the default.
	AtLeastOnce DeliveryMode = iota
	// AtMostOnce acknowledges a message before its handler runs: a crash or a
	// handler error loses it, and it is never delivered twice. For data where
	// a gap is better than a duplicate (metrics samples, presence pings).
	AtMostOnce
)

func (m DeliveryMode) String() string {
	switch m {
	case AtLeastOnce:
		return "at-least-once"
	case AtMostOnce:
		return "at-most-once"
	}
	return fmt.Sprintf("DeliveryMode(%d)", uint8(m))
}

// Ordering chooses what the loop keeps in order.
type Ordering uint8

const (
	// OrderByLane runs one message at a time per lane (a Kafka partition, an
	// SQS FIFO message group), in the broker's order. Messages without a lane
	// (a standard queue) run in parallel. This is the default.
	OrderByLane Ordering = iota
	// OrderByKey runs one message at a time per key inside each lane, so one
	// Kafka partition carrying many keys keeps many handlers busy while each
	// key still sees its messages in order. Messages without a lane are
	// ordered by key as well.
	OrderByKey
	// Unordered runs every message as soon as a worker is free.
	Unordered
)

func (o Ordering) String() string {
	switch o {
	case OrderByLane:
		return "by-lane"
	case OrderByKey:
		return "by-key"
	case Unordered:
		return "unordered"
	}
	return fmt.Sprintf("Ordering(%d)", uint8(o))
}

// ErrInvalidConfig matches, through errors.Is, every configuration error.
var ErrInvalidConfig = errors.New("invalid configuration")

// ConfigError names the configuration field that was wrong and why.
type ConfigError struct {
	Field  string
	Reason string
}

func (e *ConfigError) Error() string {
	return "ferry: invalid configuration: " + e.Field + " " + e.Reason
}

// Is reports whether target is ErrInvalidConfig.
func (e *ConfigError) Is(target error) bool { return target == ErrInvalidConfig }

// ConfigErrorf returns a *ConfigError for field, with its reason formatted
// as fmt.Sprintf formats it: the error every constructor and option of
// Ferry's packages returns for a bad setting, and the one for an adapter
// of one's own. Field names the setting as Go code spells it: an option by
// its name without With ("Concurrency" for WithConcurrency), a field of a
// configuration struct as Type.Field ("QueueConfig.DeadLetterQueue"), a
// middleware's option by the middleware and the option ("Retry.Initial"
// for RetryInitial), and an argument by its parameter's name ("topic").
func ConfigErrorf(field, format string, args ...any) error {
	return &ConfigError{Field: field, Reason: fmt.Sprintf(format, args...)}
}

// Option configures a Loop. Options that get a bad value make New fail with
// a *ConfigError naming the field.
type Option func(*config) error

type config struct {
	name           string
	named          bool // name given by WithName
	concurrency    int
	maxInFlight    int
	fetchBatch     int
	ordering       Ordering
	mode           DeliveryMode
	grace          time.Duration
	logger         *slog.Logger
	backoffMin     time.Duration
	backoffMax     time.Duration
	fetchBackoff   time.Duration
	maxInFlightOK  bool // set explicitly
	fetchBatchOK   bool
	meterProvider  metric.MeterProvider
	tracerProvider trace.TracerProvider

	reportAfter       time.Duration
	wedgedAfter       time.Duration
	healthInterval    time.Duration
	healthSamples     int
	retention         time.Duration
	retentionFraction float64
}

func defaultConfig() config {
	return config{
		name:         "ferry",
		concurrency:  8,
		ordering:     OrderByLane,
		mode:         AtLeastOnce,
		grace:        10 * time.Second,
		backoffMin:   100 * time.Millisecond,
		backoffMax:   10 * time.Second,
		fetchBackoff: 5 * time.Second,

		reportAfter:    10 * time.Second,
		wedgedAfter:    10 * time.Minute,
		healthInterval: 5 * time.Second,
		healthSamples:  12,
	}
}

// WithName names the consumer in logs, metrics, dead-letter headers and
// idempotency keys. Default "ferry", except on Kafka, where the name is the
// consumer group id and kafka.Broker.NewConsumer requires it.
func WithName(name string) Option {
	return func(c *config) error {
		if name == "" {
			return ConfigErrorf("Name", "must not be empty")
		}
		c.name, c.named = name, true
		return nil
	}
}

// WithConcurrency sets how many handlers run at once. Default 8.
func WithConcurrency(n int) Option {
	return func(c *config) error {
		if n <= 0 {
			return ConfigErrorf("Concurrency", "must be > 0, got %d", n)
		}
		c.concurrency = n
		return nil
	}
}

// WithMaxInFlight bounds how many messages the consumer holds unsettled at
// once, running, queued behind their key or waiting for a retry; fetching
// stops while it is full. Deferred messages (Defer) are counted apart, up to
// as many again, so that duplicates waiting on another worker never starve
// fresh messages. It must be at least the concurrency. Default four times
// the concurrency.
func WithMaxInFlight(n int) Option {
	return func(c *config) error {
		if n <= 0 {
			return ConfigErrorf("MaxInFlight", "must be > 0, got %d", n)
		}
		c.maxInFlight = n
		c.maxInFlightOK = true
		return nil
	}
}

// WithFetchBatch bounds how many messages one fetch asks for. Default the
// maximum in flight, capped at 256.
func WithFetchBatch(n int) Option {
	return func(c *config) error {
		if n <= 0 {
			return ConfigErrorf("FetchBatch", "must be > 0, got %d", n)
		}
		c.fetchBatch = n
		c.fetchBatchOK = true
		return nil
	}
}

// WithOrdering chooses what stays in order. Default OrderByLane.
func WithOrdering(o Ordering) Option {
	return func(c *config) error {
		if o > Unordered {
			return ConfigErrorf("Ordering", "unknown value %d", o)
		}
		c.ordering = o
		return nil
	}
}

// WithDeliveryMode chooses at-least-once or at-most-once (see AtMostOnce).
// Default AtLeastOnce.
func WithDeliveryMode(m DeliveryMode) Option {
	return func(c *config) error {
		if m > AtMostOnce {
			return ConfigErrorf("DeliveryMode", "unknown value %d", m)
		}
		c.mode = m
		return nil
	}
}

// WithShutdownGrace sets how long handlers still running when Run's context
// ends may take to finish before their contexts are cancelled and their
// messages are left for redelivery. Default 10s.
func WithShutdownGrace(d time.Duration) Option {
	return func(c *config) error {
		if d < 0 {
			return ConfigErrorf("ShutdownGrace", "must be >= 0, got %s", d)
		}
		c.grace = d
		return nil
	}
}

// WithLogger sets where the loop logs. Default slog.Default().
func WithLogger(l *slog.Logger) Option {
	return func(c *config) error {
		if l == nil {
			return ConfigErrorf("Logger", "must not be nil")
		}
		c.logger = l
		return nil
	}
}

// WithRedeliveryBackoff sets the delay before a message whose handler
// failed with a plain error (not RetryAfter) is delivered again: min doubled
// per attempt, capped at max. Default 100ms up to 10s. The Retry middleware
// chooses its own delays and overrides this.
func WithRedeliveryBackoff(min, max time.Duration) Option {
	return func(c *config) error {
		if min < 0 {
			return ConfigErrorf("RedeliveryBackoff", "min must be >= 0, got %s", min)
		}
		if max < min {
			return ConfigErrorf("RedeliveryBackoff", "max %s is below min %s", max, min)
		}
		c.backoffMin, c.backoffMax = min, max
		return nil
	}
}

// WithFetchBackoff caps the delay between fetch attempts after the broker
// failed. Default 5s.
func WithFetchBackoff(max time.Duration) Option {
	return func(c *config) error {
		if max <= 0 {
			return ConfigErrorf("FetchBackoff", "must be > 0, got %s", max)
		}
		c.fetchBackoff = max
		return nil
	}
}

// WithReportAfter sets how long a consumer may go, from the start of Run,
// without its broker answering before it logs a WARN saying so (its health
// is "starting" all that time, and "disconnected" from the first failed
// fetch or connect, which is logged at once). Default 10s.
func WithReportAfter(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return ConfigErrorf("ReportAfter", "must be > 0, got %s", d)
		}
		c.reportAfter = d
		return nil
	}
}

// WithWedgedAfter sets how long a consumer may make no progress at all (no
// message fetched, finished, settled or held) while messages wait, before
// its Health says it is wedged and its liveness fails: a handler that hangs
// and ignores its context, or a loop that is stuck. Set it above the longest
// a handler may run. Default 10m.
func WithWedgedAfter(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return ConfigErrorf("WedgedAfter", "must be > 0, got %s", d)
		}
		c.wedgedAfter = d
		return nil
	}
}

// WithMeterProvider sets where the loop reports its metrics. Default the
// global provider (otel.GetMeterProvider), a no-op until one is installed.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(c *config) error {
		if mp == nil {
			return ConfigErrorf("MeterProvider", "must not be nil")
		}
		c.meterProvider = mp
		return nil
	}
}

// WithTracerProvider makes the Loop run every handler run in a consumer span
// of tp named "process SOURCE", the child of the trace context the message
// carries in its headers (see TracePublisher), with the messaging attributes
// of the message (system, source, consumer group, message id, partition and
// offset, body size) and the run's attempt. A failed run marks its span as
// an error; Retry and DeadLetter add events to it. Default none: the Loop
// makes no spans, and tracing costs nothing.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return func(c *config) error {
		if tp == nil {
			return ConfigErrorf("TracerProvider", "must not be nil")
		}
		c.tracerProvider = tp
		return nil
	}
}

// WithHealthWindow sets how the loop samples its health: every interval,
// keeping the last samples (at least 3). Default every 5 s, 12 samples: a
// minute.
func WithHealthWindow(interval time.Duration, samples int) Option {
	return func(c *config) error {
		if interval <= 0 {
			return ConfigErrorf("HealthWindow", "interval must be > 0, got %s", interval)
		}
		if samples < 3 {
			return ConfigErrorf("HealthWindow", "needs at least 3 samples, got %d", samples)
		}
		c.healthInterval, c.healthSamples = interval, samples
		return nil
	}
}

// WithRetention tells the loop how long its source keeps a message (a Kafka
// topic's retention.ms, an SQS queue's MessageRetentionPeriod) and at what
// fraction of it the backlog's age is an alarm: past it, Health says
// HealthBacklogPastRetention. Default off: no retention is known.
func WithRetention(retention time.Duration, fraction float64) Option {
	return func(c *config) error {
		if retention <= 0 {
			return ConfigErrorf("Retention", "must be > 0, got %s", retention)
		}
		if fraction <= 0 || fraction > 1 {
			return ConfigErrorf("Retention", "fraction must be in (0, 1], got %v", fraction)
		}
		c.retention, c.retentionFraction = retention, fraction
		return nil
	}
}

func buildConfig(opts []Option) (config, error) {
	c := defaultConfig()
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o(&c); err != nil {
			return c, err
		}
	}
	if !c.maxInFlightOK {
		c.maxInFlight = 4 * c.concurrency
	}
	if c.maxInFlight < c.concurrency {
		return c, ConfigErrorf("MaxInFlight", "%d is below Concurrency %d", c.maxInFlight, c.concurrency)
	}
	if !c.fetchBatchOK {
		c.fetchBatch = min(c.maxInFlight, 256)
	}
	if c.logger == nil {
		c.logger = slog.Default()
	}
	return c, nil
}
