package memory

import (
	"time"

	"go.opentelemetry.io/otel/metric"

	"github.com/ferrymq/ferry/consumer"
)

// DefaultVisibilityTimeout is a queue's visibility timeout when its
// QueueConfig leaves it zero, as on SQS.
const DefaultVisibilityTimeout = 30 * time.Second

// DefaultDedupWindow is how long a FIFO queue remembers message IDs to drop
// duplicates, as on SQS.
const DefaultDedupWindow = 5 * time.Minute

// Option configures a Broker. New applies the options in order and fails
// with a *consumer.ConfigError on the first that is invalid.
type Option func(*config) error

type config struct {
	autoCreate    bool
	dedupWindow   time.Duration
	meterProvider metric.MeterProvider
}

// WithMeterProvider sets where Publish reports its calls, as the
// OpenTelemetry messaging conventions name them
// (messaging.client.operation.duration and messaging.client.sent.messages,
// with messaging.system "ferry_memory"). Default the global provider, a
// no-op until one is installed.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(c *config) error {
		if mp == nil {
			return consumer.ConfigErrorf("MeterProvider", "must not be nil")
		}
		c.meterProvider = mp
		return nil
	}
}

// WithAutoCreate chooses what happens on Publish, Driver or NewConsumer for a
// queue that does not exist. When true (the default), such a queue is
// created with the zero QueueConfig, which is what a test double wants. When
// false, those calls fail with ErrQueueNotFound, as SQS does.
func WithAutoCreate(enabled bool) Option {
	return func(c *config) error {
		c.autoCreate = enabled
		return nil
	}
}

// WithDedupWindow sets how long FIFO queues remember published message IDs
// to drop duplicates. Default 5m (DefaultDedupWindow); zero turns
// deduplication off. A negative window is refused.
func WithDedupWindow(d time.Duration) Option {
	return func(c *config) error {
		if d < 0 {
			return consumer.ConfigErrorf("DedupWindow", "must be >= 0 (0 turns deduplication off), got %v", d)
		}
		c.dedupWindow = d
		return nil
	}
}
