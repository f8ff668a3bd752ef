package consumertest

import (
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
)

// Harness connects the suite to one broker. The suite calls it from one
// goroutine per test; a Harness does not need to be safe for concurrent use.
//
// Everything a Harness makes for a test should be released with t.Cleanup:
// the suite never calls Close on anything.
type Harness interface {
	// NewSource creates a fresh, empty queue or topic for one test and
	// returns the name that Publish and NewConsumer take. Two calls never
	// return the same source. It fails the test (t.Fatal) when the broker
	// cannot create one.
	NewSource(t *testing.T, cfg SourceConfig) string

	// Publisher returns a Publisher for the broker. The suite asks for one
	// per test, publishes with it and with nothing else.
	Publisher(t *testing.T) consumer.Publisher

	// NewConsumer returns a new Consumer of source, built with opts (the
	// broker adapter passes them on to consumer.New). Each Consumer is Run at
	// most once. Consumers of one source share its messages as the broker
	// shares them between the members of one consumer group: on a queue each
	// message goes to one of them, on a log each lane belongs to one of them.
	// A consumer of a new source sees the messages published to it before the
	// consumer started (a Kafka group starts at the earliest offset).
	NewConsumer(t *testing.T, source string, opts ...consumer.Option) consumer.Consumer

	// Capabilities says what the broker can do, so that the suite skips what
	// it cannot and checks the rest.
	Capabilities() Capabilities

	// AsCheck is called from a handler with a message the consumer
	// delivered. It returns nil when m.As reaches the broker's own type of
	// a delivery (the type the adapter documents, such as *kgo.Record) and
	// what it reaches matches m, and an error saying what is wrong
	// otherwise. The suite itself checks that m.As refuses a type no
	// broker knows.
	AsCheck(m *consumer.Message) error
}

// SourceConfig is what one test asks of its source.
type SourceConfig struct {
	// Ordered asks for a source that keeps messages in order per lane, with
	// the message key deciding the lane: an SQS FIFO queue with the key as the
	// message group, a Kafka topic partitioned by key. Only asked for when
	// Capabilities.Ordered is true.
	Ordered bool

	// Lease asks for the lease (visibility timeout) that a delivery holds
	// before the broker gives it to someone else. Zero asks for the harness's
	// default, which should be generous (30 s or more). The suite asks only
	// for Capabilities.Lease, and only when it is not zero.
	Lease time.Duration
}

// Capabilities is what a broker can do, as far as the suite needs to know.
type Capabilities struct {
	// Ordered is true when NewSource honours SourceConfig.Ordered. The
	// ordering tests are skipped when it is false.
	Ordered bool

	// Lease is the short lease the harness can give a source when asked
	// (SourceConfig.Lease): the lease tests run handlers for three times it,
	// so one second is a good value. Zero means the broker's deliveries hold
	// no lease that runs out (Kafka, RabbitMQ), and the lease test is
	// skipped.
	Lease time.Duration

	// Redelivers is true when the broker takes a message back and can give it
	// to any consumer of the source (a queue: SQS, RabbitMQ, memory), and
	// false for a log (Kafka), where a lane belongs to one consumer of the
	// group and the delivery loop retries in place. The part of the in-flight
	// test that watches a second consumer take what the first one may not
	// hold runs only when it is true.
	Redelivers bool

	// Delays is true when Publish holds a message until its NotBefore (the
	// memory broker, SQS standard queues, RabbitMQ queues); false when it refuses one with
	// consumer.ErrDelayNotSupported. The delay clause checks whichever is
	// reported.
	Delays bool

	// MaxBody is the largest message body, in bytes, that the broker takes
	// next to a few short headers. Zero means at least 1 MiB. The round-trip
	// test sends a body of 1 MiB or MaxBody, whichever is smaller.
	MaxBody int
}

// InFlightCounter is implemented by harnesses whose broker can say how many
// of a source's messages are delivered and not yet settled (the memory
// broker's Stats, SQS ApproximateNumberOfMessagesNotVisible, RabbitMQ's
// unacked count). When the harness implements it, the in-flight test also
// checks that count against the consumer's WithMaxInFlight.
type InFlightCounter interface {
	// InFlight returns how many of source's messages are delivered and not
	// yet settled, now.
	InFlight(t *testing.T, source string) int
}
