// Package ferrytest runs a service's own integration tests against the real
// brokers Ferry supports, as net/http/httptest does for HTTP handlers: it
// connects to a broker, gives each test throwaway topics or queues and removes
// them afterwards, publishes fixtures, runs the service's handler (through its
// own middleware) until a condition holds, and reads what reached a
// dead-letter destination with the story Ferry's DeadLetter middleware wrote.
//
//	func TestBilling(t *testing.T) {
//		for _, kind := range ferrytest.Kinds {
//			t.Run(string(kind), func(t *testing.T) {
//				ctx := t.Context()
//				b := ferrytest.Open(t, kind)     // skips when the broker is not running
//				orders := b.Queue(t, "orders")   // removed when the test ends
//				dlq := b.Queue(t, "orders-dlq")
//				stack, _ := consumer.Standard(b, dlq.Name)
//				_ = orders.Publish(ctx, fixtures...)
//				err := orders.RunUntil(ctx, stack.Wrap(billing), func() bool { return paid() == 2 })
//				dead, err := dlq.DeadLetters(ctx) // the messages stay in the queue
//				...
//
// # Where the brokers are
//
// The addresses come from the environment, with defaults that match both
// ways of starting the brokers: `make brokers` (integration/brokers.sh,
// natively) and `docker compose up --wait` (docker-compose.yml):
//
//	FERRY_KAFKA_BROKERS   127.0.0.1:9092 (comma-separated)
//	FERRY_SQS_ENDPOINT    http://127.0.0.1:9324 (ElasticMQ; any static credentials)
//	FERRY_SQS_REGION      us-east-1
//	FERRY_AMQP_URL        amqp://guest:guest@127.0.0.1:5672/
//
// URL turns them into the URL [ferry.Open] takes. The memory broker (Memory)
// needs nothing: each Open makes a new one in the process.
//
// # When a broker is not running
//
// Open skips the test with a message naming the command that starts the
// brokers. With FERRY_REQUIRE_BROKERS=1 (as in CI) it fails the test instead,
// so that a broker that did not start is never a silently green run. Connect
// is the same without a testing.TB: its error wraps ErrUnreachable.
//
// # What a queue is on each broker
//
// A Queue is what a consumer reads and a publisher writes, made for one
// test: a Kafka topic (one partition unless Partitions says otherwise), an
// SQS standard queue, a RabbitMQ quorum queue, a queue of the memory broker
// (which refuses to publish to queues nobody created, as SQS and Kafka do).
// Consumers take its Name, and so do Publish and any Publisher such as the
// one of a DeadLetter middleware: a destination names the same queue on
// every broker (on RabbitMQ through the default exchange). Its Destination
// is that Name too.
//
// Removing a queue deletes the topic (Kafka, with the consumer groups this
// package made for it), the queue (SQS) or the queue and its delay queues
// (RabbitMQ, those of rabbit.DefaultRetryDelays), or the memory broker's
// queue: [consumer.Admin]'s DeleteSource on each.
package ferrytest

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/brokerkind"
	"github.com/ferrymq/ferry/internal/testenv"
)

// Kind names a broker. Its values are the names the ferry command and
// the benchmarks use too; a broker that runs as a service has the name of
// its testenv.Service.
type Kind string

// The brokers ferrytest connects to.
const (
	// Memory is the in-process broker of package memory.
	Memory Kind = brokerkind.Memory
	// Kafka is Apache Kafka, at FERRY_KAFKA_BROKERS.
	Kafka Kind = Kind(testenv.Kafka)
	// SQS is Amazon SQS or a compatible server (ElasticMQ), at
	// FERRY_SQS_ENDPOINT.
	SQS Kind = Kind(testenv.SQS)
	// RabbitMQ is RabbitMQ, at FERRY_AMQP_URL.
	RabbitMQ Kind = Kind(testenv.RabbitMQ)
	// KafkaShare is Apache Kafka at FERRY_KAFKA_BROKERS with share groups
	// (KIP-932, kafka.Share): Kafka as a queue, every consumer of a
	// queue with one name a member of one share group. The ferry command
	// calls it kafka, with group_protocol=share in its URL.
	KafkaShare Kind = "kafka-share"
)

// Kinds lists every broker, for a test that runs once on each, and Kafka's
// share groups.
var Kinds = []Kind{Memory, Kafka, SQS, RabbitMQ, KafkaShare}

// The environment variables ferrytest reads; see the package documentation
// for their defaults.
const (
	// EnvBroker picks the broker of KindFromEnv: memory (the default),
	// kafka, sqs, rabbitmq or kafka-share.
	EnvBroker = "FERRY_TEST_BROKER"
	// EnvRequireBrokers, set to 1, makes Open fail a test whose broker does
	// not answer instead of skipping it.
	EnvRequireBrokers = testenv.EnvRequireBrokers
	// EnvKafkaBrokers is the comma-separated list of Kafka's bootstrap
	// addresses.
	EnvKafkaBrokers = testenv.EnvKafkaBrokers
	// EnvSQSEndpoint is the base URL of the SQS-compatible server.
	EnvSQSEndpoint = testenv.EnvSQSEndpoint
	// EnvSQSRegion is the region SQS requests are signed for.
	EnvSQSRegion = testenv.EnvSQSRegion
	// EnvAMQPURL is RabbitMQ's AMQP URL.
	EnvAMQPURL = testenv.EnvAMQPURL
)

// StartCommand is the command that starts the brokers, named in the message
// of a skipped or failed test.
const StartCommand = testenv.StartCommand

// ErrUnreachable is wrapped by the error of Connect when the broker does not
// answer.
var ErrUnreachable = errors.New("ferrytest: broker not reachable")

// DefaultTimeout bounds RunUntil, DeadLetters and Peek when their context
// has no deadline, and each step of Open and Queue.
const DefaultTimeout = 30 * time.Second

// KindFromEnv returns the broker FERRY_TEST_BROKER names, Memory when it is
// unset, and an error naming the kinds when it names none of them.
func KindFromEnv() (Kind, error) {
	v := strings.ToLower(strings.TrimSpace(os.Getenv(EnvBroker)))
	if v == "" {
		return Memory, nil
	}
	for _, k := range Kinds {
		if string(k) == v {
			return k, nil
		}
	}
	return "", fmt.Errorf("ferrytest: %s=%q is not one of %s", EnvBroker, v, kindNames())
}

// kindNames lists Kinds for an error: "memory, kafka, sqs, rabbitmq, kafka-share".
func kindNames() string {
	names := make([]string, len(Kinds))
	for i, k := range Kinds {
		names[i] = string(k)
	}
	return strings.Join(names, ", ")
}

// URL returns the URL [ferry.Open] takes for kind, from the environment:
// kafka://127.0.0.1:9092 (with ?group_protocol=share for KafkaShare),
// sqs://ferry:ferry@127.0.0.1:9324?region=us-east-1&tls=false,
// amqp://guest:guest@127.0.0.1:5672/ and, for Memory,
// mem://?autocreate=false with their defaults. It returns "" for an unknown
// kind.
func URL(kind Kind) string {
	switch kind {
	case Memory:
		return "mem://?autocreate=false"
	case Kafka:
		return "kafka://" + strings.Join(testenv.KafkaBrokers(), ",")
	case KafkaShare:
		return "kafka://" + strings.Join(testenv.KafkaBrokers(), ",") + "?group_protocol=share"
	case SQS:
		u, err := url.Parse(testenv.SQSEndpoint())
		if err != nil || u.Host == "" {
			return "sqs://" + testenv.SQSEndpoint() // ferry.Open names what is wrong
		}
		q := url.Values{"region": {testenv.SQSRegion()}}
		if u.Scheme == "http" {
			q.Set("tls", "false")
		}
		return (&url.URL{Scheme: "sqs", User: url.UserPassword(testenv.SQSAccessKey, testenv.SQSSecretKey), Host: u.Host, RawQuery: q.Encode()}).String()
	case RabbitMQ:
		return testenv.AMQPURL()
	}
	return ""
}

// Broker is a broker opened for tests: a [ferry.Broker] (Publish,
// NewConsumer), and the queues made on it. Close removes those queues, then
// closes the broker.
type Broker struct {
	ferry.Broker
	// Kind is the broker's kind.
	Kind Kind

	admin admin

	mu     sync.Mutex
	queues map[*Queue]struct{}
	closed bool
}

// Connect opens the broker of kind from the environment (see URL). When the
// broker does not accept a connection, the error wraps [ErrUnreachable] and
// names the command that starts the brokers.
func Connect(ctx context.Context, kind Kind) (*Broker, error) {
	raw := URL(kind)
	if raw == "" {
		return nil, fmt.Errorf("ferrytest: unknown broker kind %q (one of %s)", kind, kindNames())
	}
	if kind != Memory { // the others are services, of the same name (Kafka's share groups, Kafka)
		svc := testenv.Service(kind)
		if kind == KafkaShare {
			svc = testenv.Kafka
		}
		if addr, err := testenv.Reachable(svc); err != nil {
			return nil, fmt.Errorf("%w: %s at %s: %w; start the brokers with %s", ErrUnreachable, kind, addr, err, StartCommand)
		}
	}
	fb, err := ferry.Open(ctx, raw)
	if err != nil {
		return nil, fmt.Errorf("ferrytest: open %s: %w", kind, err)
	}
	b := &Broker{Broker: fb, Kind: kind, queues: map[*Queue]struct{}{}}
	if b.admin, err = newAdmin(kind, fb); err != nil {
		fb.Close()
		return nil, fmt.Errorf("ferrytest: %s: %w", kind, err)
	}
	return b, nil
}

// Open connects to the broker of kind (see Connect) for the test t and
// closes it when t ends, removing every queue made on it. When the broker
// does not answer, t is skipped with a message naming the command that
// starts the brokers, or fails when FERRY_REQUIRE_BROKERS=1; any other error
// fails t.
func Open(t testing.TB, kind Kind) *Broker {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), DefaultTimeout)
	defer cancel()
	b, err := Connect(ctx, kind)
	if errors.Is(err, ErrUnreachable) {
		if testenv.RequireBrokers() {
			t.Fatalf("%v (%s=1 makes this a failure)", err, EnvRequireBrokers)
		}
		t.Skipf("%v, or set %s=1 to fail instead of skipping", err, EnvRequireBrokers)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Errorf("ferrytest: close %s: %v", kind, err)
		}
	})
	return b
}

// QueueOption configures NewQueue.
type QueueOption func(*queueConfig) error

type queueConfig struct {
	partitions int32
}

// Partitions sets the number of partitions of a Kafka topic. Default 1.
// Other brokers ignore it.
func Partitions(n int) QueueOption {
	return func(c *queueConfig) error {
		if n < 1 || n > 1<<20 {
			return fmt.Errorf("ferrytest: Partitions must be between 1 and %d, got %d", 1<<20, n)
		}
		c.partitions = int32(n)
		return nil
	}
}

// Queue is a topic or queue made for a test.
type Queue struct {
	// Name is the topic or queue: what NewConsumer takes. It is "ferry-",
	// the prefix given (lower case, other characters as '-', cut to fit),
	// and a random suffix: at most 60 characters, which every broker takes.
	Name string
	// Destination is what Publish (and any Publisher, such as that of a
	// DeadLetter middleware) takes to reach the queue: the Name, on every
	// broker. (It was another string on RabbitMQ when a plain name was an
	// exchange there.)
	Destination string

	b       *Broker
	mu      sync.Mutex
	groups  []string // Kafka consumer groups made for it
	removed bool
}

// NewQueue makes a topic or queue of a name no other test uses, made of
// prefix (see [Queue.Name]). Close removes it, unless Remove did first.
func (b *Broker) NewQueue(ctx context.Context, prefix string, opts ...QueueOption) (*Queue, error) {
	cfg := queueConfig{partitions: 1}
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o(&cfg); err != nil {
			return nil, err
		}
	}
	if prefix == "" {
		prefix = "queue"
	}
	b.mu.Lock()
	closed := b.closed
	b.mu.Unlock()
	if closed {
		return nil, errors.New("ferrytest: NewQueue on a closed Broker")
	}
	name := testenv.NewName(prefix)
	dest, err := b.admin.create(ctx, name, cfg)
	if err != nil {
		return nil, fmt.Errorf("ferrytest: create %s %q: %w", b.Kind, name, err)
	}
	q := &Queue{Name: name, Destination: dest, b: b}
	b.mu.Lock()
	b.queues[q] = struct{}{}
	b.mu.Unlock()
	return q, nil
}

// Queue is NewQueue for the test t: it fails t when the queue cannot be
// made, and removes the queue when t ends (a subtest's queues go when the
// subtest ends, even on a Broker shared with its parent).
func (b *Broker) Queue(t testing.TB, prefix string, opts ...QueueOption) *Queue {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), DefaultTimeout)
	defer cancel()
	q, err := b.NewQueue(ctx, prefix, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), DefaultTimeout)
		defer cancel()
		if err := q.Remove(ctx); err != nil {
			t.Errorf("%v", err)
		}
	})
	return q
}

// Close removes every queue made on b and not removed yet, then closes the
// broker. It returns every error on the way, joined; calling it again does
// nothing.
func (b *Broker) Close() error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil
	}
	b.closed = true
	qs := make([]*Queue, 0, len(b.queues))
	for q := range b.queues {
		qs = append(qs, q)
	}
	b.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), DefaultTimeout)
	defer cancel()
	var errs []error
	for _, q := range qs {
		errs = append(errs, q.Remove(ctx))
	}
	errs = append(errs, b.admin.close(), b.Broker.Close())
	return errors.Join(errs...)
}

// Remove deletes the topic or queue (see the package documentation for
// what goes with it). Removing it again does nothing.
func (q *Queue) Remove(ctx context.Context) error {
	q.mu.Lock()
	if q.removed {
		q.mu.Unlock()
		return nil
	}
	q.removed = true
	groups := q.groups
	q.mu.Unlock()
	q.b.mu.Lock()
	delete(q.b.queues, q)
	q.b.mu.Unlock()
	if err := q.b.admin.remove(ctx, q.Name, groups); err != nil {
		return fmt.Errorf("ferrytest: remove %s %q: %w", q.b.Kind, q.Name, err)
	}
	return nil
}

// Exists asks the broker whether the topic or queue exists. On the memory
// broker it exists until the broker is closed.
func (q *Queue) Exists(ctx context.Context) (bool, error) {
	q.b.mu.Lock()
	closed := q.b.closed
	q.b.mu.Unlock()
	if closed && q.b.Kind == Memory {
		return false, nil
	}
	ok, err := q.b.admin.exists(ctx, q.Name)
	if err != nil {
		return false, fmt.Errorf("ferrytest: look up %s %q: %w", q.b.Kind, q.Name, err)
	}
	return ok, nil
}

// Publish publishes msgs to the queue, through the Broker: it returns once
// the broker has them durably (see [consumer.Publisher]).
func (q *Queue) Publish(ctx context.Context, msgs ...consumer.Message) error {
	if err := q.b.Publish(ctx, q.Destination, msgs...); err != nil {
		return fmt.Errorf("ferrytest: publish to %q: %w", q.Name, err)
	}
	return nil
}

func (q *Queue) addGroup(g string) {
	q.mu.Lock()
	q.groups = append(q.groups, g)
	q.mu.Unlock()
}

// RunUntil runs h on a new consumer of the queue until until returns true,
// then stops the consumer (which drains: what finished is acked) and returns
// nil. until is called every 10 ms from one goroutine; h runs on the
// consumer's workers, so what both read must be synchronised (an
// atomic counter, a mutex).
//
// The consumer is b.NewConsumer with opts, after [consumer.WithName] of a name
// of its own (a Kafka consumer group no other test shares, deleted with the
// queue); pass WithName to choose it (a group of yours is left alone). When ctx ends first, or has no deadline and [DefaultTimeout]
// passes, RunUntil stops the consumer and returns an error wrapping
// context.DeadlineExceeded (or ctx's error); when the consumer stops by
// itself, an error wrapping its own.
func (q *Queue) RunUntil(ctx context.Context, h consumer.Handler, until func() bool, opts ...consumer.Option) error {
	if until == nil {
		return errors.New("ferrytest: RunUntil needs a condition")
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, DefaultTimeout)
		defer cancel()
	}
	name := testenv.NewName("run")
	opts = append([]consumer.Option{consumer.WithName(name)}, opts...)
	l, err := q.b.NewConsumer(ctx, q.Name, opts...)
	if err != nil {
		return fmt.Errorf("ferrytest: consumer of %q: %w", q.Name, err)
	}
	if l.Name() == name {
		q.addGroup(name) // ours to delete; a name of the caller's is left alone
	}
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- l.Run(runCtx, h) }()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		if until() {
			stop()
			if err := <-done; err != nil {
				return fmt.Errorf("ferrytest: consumer of %q: %w", q.Name, err)
			}
			return nil
		}
		select {
		case err := <-done:
			if ctx.Err() != nil { // the loop saw the deadline first
				return fmt.Errorf("ferrytest: the condition on %q did not hold in time: %w", q.Name, errors.Join(ctx.Err(), err))
			}
			if err == nil {
				err = errors.New("returned nil")
			}
			return fmt.Errorf("ferrytest: consumer of %q stopped before the condition held: %w", q.Name, err)
		case <-ctx.Done():
			stop()
			<-done
			return fmt.Errorf("ferrytest: the condition on %q did not hold in time: %w", q.Name, ctx.Err())
		case <-tick.C:
		}
	}
}
