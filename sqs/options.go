package sqs

import (
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/metric"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
)

type config struct {
	logger          *slog.Logger
	waitTime        time.Duration
	settleWindow    time.Duration
	publishParallel int
	receivers       int
	meters          metric.MeterProvider
	fairQueues      bool
}

// WithMeterProvider sets where Publish reports its calls, as the
// OpenTelemetry messaging conventions name them
// (messaging.client.operation.duration and messaging.client.sent.messages,
// with messaging.system "aws_sqs"). Default the global provider, a no-op
// until one is installed. The consumers report through
// [consumer.WithMeterProvider].
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(c *config) error {
		if mp == nil {
			return consumer.ConfigErrorf("MeterProvider", "must not be nil")
		}
		c.meters = mp
		return nil
	}
}

// Option configures New. An option given a bad value makes New fail with a
// *[consumer.ConfigError] naming the field.
type Option func(*config) error

// WithLogger sets where the broker and its drivers log. Default
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

// WithWaitTime sets how long one ReceiveMessage waits for messages to
// arrive (long polling, WaitTimeSeconds), in whole seconds from 1 to
// [MaxWaitTime] (3s). Default MaxWaitTime. SQS allows 20 s, which would save
// empty receives on an idle queue (one every 3 s instead of every 20 s),
// but a poll open when SQS stops answering would then tell the loop so
// only after 20 s or more: Ferry reports an outage within
// [driver.ReportWithin].
func WithWaitTime(d time.Duration) Option {
	return func(c *config) error {
		if d < time.Second || d > MaxWaitTime || d%time.Second != 0 {
			return consumer.ConfigErrorf("WaitTime", "must be whole seconds from 1s to %s (a longer poll would hide an outage past %s), got %s", MaxWaitTime, driver.ReportWithin, d)
		}
		c.waitTime = d
		return nil
	}
}

// WithSettleWindow sets how long a consumer lets acknowledgements gather
// before it sends a DeleteMessageBatch that is not full, when the previous
// one went out less than that long ago. Under load, deletes then go out ten
// at a time; when messages are few, each ack goes out at once. Default 10ms;
// 0 sends every batch at once.
func WithSettleWindow(d time.Duration) Option {
	return func(c *config) error {
		if d < 0 || d > time.Second {
			return consumer.ConfigErrorf("SettleWindow", "must be from 0 to 1s, got %s", d)
		}
		c.settleWindow = d
		return nil
	}
}

// WithPublishConcurrency sets how many SendMessageBatch calls one Publish
// makes at once. Batches that share a key wait for each other, so the
// messages of one key still go in order. Default 8.
func WithPublishConcurrency(n int) Option {
	return func(c *config) error {
		if n < 1 {
			return consumer.ConfigErrorf("PublishConcurrency", "must be >= 1, got %d", n)
		}
		c.publishParallel = n
		return nil
	}
}

// WithMaxReceivers bounds how many ReceiveMessage calls one consumer has
// open at once. A consumer opens as many as it takes to fill its bound on
// messages in flight ([consumer.WithMaxInFlight]), ten messages each, and no
// more; on a FIFO queue, one at a time (see the package documentation).
// Default 32.
func WithMaxReceivers(n int) Option {
	return func(c *config) error {
		if n < 1 {
			return consumer.ConfigErrorf("MaxReceivers", "must be >= 1, got %d", n)
		}
		c.receivers = n
		return nil
	}
}

// WithFairQueues makes Publish send a message's Key as its message group id
// (MessageGroupId) on standard queues too, as SQS fair queues take it:
// when one group (a tenant, say) floods a queue, SQS serves the other
// groups' messages first, so that one noisy tenant does not hold back the
// rest. Order is not kept on a standard queue, with or without it; the
// consumer still reads the Key back exactly. A Key that is not a valid
// group id (up to 128 characters of letters, digits and punctuation) is
// sent as its hash, as on FIFO queues; a message without a Key has no
// group. Default off. FIFO queues always group by Key.
//
// SQS gives no backlog per group through its API (its CloudWatch metrics
// ApproximateNumberOfNoisyGroups and the per-group dwell times are where a
// noisy tenant shows). ElasticMQ, on which Ferry's tests run, keeps the
// group id but does not reorder by it.
func WithFairQueues(on bool) Option {
	return func(c *config) error {
		c.fairQueues = on
		return nil
	}
}
