package consumer

import (
	"context"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
)

// This file is the contract every broker adapter keeps (kafka, sqs,
// rabbit, memory): a Broker, and the optional interfaces a caller finds
// by type assertion, as database/sql finds a driver's optional
// interfaces.

// Broker is a broker Ferry runs on: a Publisher, and a source of delivery
// loops. Every adapter's *Broker implements it, and ferry.Open returns
// it. The source of NewConsumer, and a Publish destination, is a queue
// (memory, SQS, RabbitMQ) or a topic (Kafka).
//
// What a broker does beyond the contract is found by type assertion:
// Admin (create and delete sources), Peeker (read without consuming),
// SystemNamer (the broker's messaging.system) and driver.Opener (the raw
// driver under a loop).
type Broker interface {
	Publisher
	// NewConsumer returns a delivery loop over source with opts. It need
	// not reach the broker: Run does, and reports while it cannot.
	NewConsumer(ctx context.Context, source string, opts ...Option) (*Loop, error)
	// Close releases the broker's connections. Loops over it stop.
	Close() error
}

// NewOn returns a delivery loop over source of o, with opts: the driver is
// opened with the loop's name and in-flight bound (driver.Config), so a
// broker that needs them (the Kafka group, the RabbitMQ prefetch) is made
// for the loop. It is how every adapter's NewConsumer is written, and the
// way to build a loop over an adapter of one's own. It fails with a
// *ConfigError when an option is invalid, and with Driver's error.
func NewOn(ctx context.Context, o driver.Opener, source string, opts ...Option) (*Loop, error) {
	if o == nil {
		return nil, ConfigErrorf("Opener", "must not be nil")
	}
	cfg, err := buildConfig(opts)
	if err != nil {
		return nil, err
	}
	dc := driver.Config{MaxInFlight: cfg.maxInFlight}
	if cfg.named {
		dc.Name = cfg.name
	}
	d, err := o.Driver(ctx, source, dc)
	if err != nil {
		return nil, err
	}
	if d == nil {
		return nil, ConfigErrorf("Driver", "the opener returned no driver and no error for %q", source)
	}
	l, err := newLoop(d, cfg)
	if err != nil {
		_ = d.Close()
		return nil, err
	}
	return l, nil
}

// Admin creates and deletes a broker's sources, with a configuration that
// means the same on every broker. Kafka, SQS, RabbitMQ and memory brokers
// implement it.
type Admin interface {
	// CreateSource creates the queue or topic name with cfg. A source that
	// exists already is not an error when it was made alike.
	CreateSource(ctx context.Context, name string, cfg SourceConfig) error
	// DeleteSource deletes the queue or topic name, and its messages. A
	// source that does not exist is not an error.
	DeleteSource(ctx context.Context, name string) error
}

// SourceConfig is how Admin.CreateSource makes a queue or a topic. The
// zero value is the broker's default: one partition, a standard queue, no
// dead-letter target.
type SourceConfig struct {
	// Partitions is the number of partitions of a Kafka topic; 0 is 1.
	// Other brokers ignore it.
	Partitions int
	// FIFO makes an ordered queue: an SQS FIFO queue (its name must end in
	// ".fifo"), a memory FIFO queue, a RabbitMQ queue with a single active
	// consumer. Kafka topics are ordered per partition already.
	FIFO bool
	// DeadLetter names a queue the broker itself moves a message to after
	// MaxDeliveries deliveries (an SQS redrive policy, a RabbitMQ
	// dead-letter target). Ferry's own dead-lettering (Standard,
	// DeadLetter) does not need it. Kafka has none: CreateSource fails
	// with a *ConfigError when it is set.
	DeadLetter string
	// MaxDeliveries is the broker's delivery limit for DeadLetter; 0 is the
	// broker's default when DeadLetter is set.
	MaxDeliveries int
	// Retention is how long the broker keeps a message; 0 is its default.
	Retention time.Duration
	// Lease is how long a fetched message stays hidden from other consumers
	// before the broker delivers it again, unless it is settled or its lease
	// is extended first (a Consumer extends the lease of a handler still
	// running): an SQS queue's VisibilityTimeout, a memory queue's
	// VisibilityTimeout. 0 is the broker's default (30 s on both).
	//
	// Kafka and RabbitMQ deliveries hold no lease that runs out, and
	// CreateSource fails with a *ConfigError when Lease is set there. (A
	// RabbitMQ consumer timeout, x-consumer-timeout, is not one: it closes
	// the whole channel, taking back every delivery on it, and no extend
	// renews it. Set it by policy as a safeguard if you want one.)
	Lease time.Duration
}

// Peeker reads messages of a source without consuming them: no lease is
// taken, nothing is acknowledged, and no consumer's position moves.
type Peeker interface {
	// Peek returns up to max messages of source, oldest first.
	Peek(ctx context.Context, source string, max int) ([]Message, error)
}

// SystemNamer names the broker as OpenTelemetry's messaging.system does:
// "kafka", "aws_sqs", "rabbitmq", or "ferry_memory".
type SystemNamer interface {
	System() string
}
