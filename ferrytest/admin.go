package ferrytest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/aws/smithy-go"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
	"github.com/ferrymq/ferry/memory"
	"github.com/ferrymq/ferry/rabbit"
)

// This file holds what ferrytest asks of each broker beyond Publish and
// NewConsumer: making and removing queues, and reading them without
// taking anything away.

// admin manages the queues of one broker.
type admin interface {
	// create makes queue name and returns the destination that reaches it.
	create(ctx context.Context, name string, cfg queueConfig) (string, error)
	// remove deletes queue name and the consumer groups made for it.
	remove(ctx context.Context, name string, groups []string) error
	// exists asks the broker whether queue name exists.
	exists(ctx context.Context, name string) (bool, error)
	// peek returns the messages queue name holds, leaving them there.
	peek(ctx context.Context, q *Queue) ([]consumer.Message, error)
	// close releases what the admin opened.
	close() error
}

func newAdmin(kind Kind, b ferry.Broker) (admin, error) {
	switch kind {
	case Memory:
		if mb, ok := ferry.Memory(b); ok {
			return &memAdmin{b: mb}, nil
		}
	case Kafka:
		if kb, ok := b.(kafkaBroker); ok {
			return &kafkaAdmin{b: kb}, nil
		}
	case SQS:
		if sb, ok := b.(sqsBroker); ok {
			return &sqsAdmin{b: sb}, nil
		}
	case RabbitMQ:
		if rb, ok := b.(rabbitBroker); ok {
			return &rabbitAdmin{b: rb, url: testenv.AMQPURL()}, nil
		}
	}
	return nil, fmt.Errorf("ferry.Open gave a %T, which ferrytest cannot manage", b)
}

// fromDriver is the message a handler would see for a delivery.
func fromDriver(m driver.Message) consumer.Message {
	return consumer.Message{
		ID: m.ID, Key: m.Key, Body: m.Body, Headers: m.Headers, Source: m.Source,
		Lane: m.Lane, Offset: m.Offset, Deliveries: m.Deliveries, PublishedAt: m.PublishedAt,
	}
}

// answerRevocations lets a driver that takes lanes away go on without a
// loop, until the returned function is called (after the driver's Close).
func answerRevocations(d driver.Driver) (stop func()) {
	r, ok := d.(driver.Revoker)
	if !ok {
		return func() {}
	}
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		for {
			select {
			case rev := <-r.Revoked():
				if rev.Done != nil {
					close(rev.Done)
				}
			case <-done:
				return
			}
		}
	}()
	return func() { close(done); <-stopped }
}

// peekQueue fetches want messages from a queue through d, then hands every
// one back unattempted, so that they are delivered again as they were.
func peekQueue(ctx context.Context, d driver.Driver, want int) ([]consumer.Message, error) {
	defer answerRevocations(d)()
	var got []driver.Message
	var err error
	for len(got) < want && err == nil {
		got, err = d.Fetch(ctx, got, want-len(got))
	}
	if len(got) > 0 {
		back := make([]driver.Settlement, len(got))
		for i, m := range got {
			back[i] = driver.Settlement{Handle: m.Handle, Action: driver.Return, NotAttempted: true, History: m.Known}
		}
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		serr := d.Settle(sctx, back)
		cancel()
		if serr != nil {
			err = errors.Join(err, fmt.Errorf("handing the messages back: %w", serr))
		}
	}
	err = errors.Join(err, d.Close())
	if err != nil {
		return nil, fmt.Errorf("read %d of %d messages: %w", len(got), want, err)
	}
	out := make([]consumer.Message, len(got))
	for i, m := range got {
		out[i] = fromDriver(m)
	}
	return out, nil
}

// memAdmin: queues of the memory broker live as long as the broker.
type memAdmin struct{ b *memory.Broker }

func (a *memAdmin) create(_ context.Context, name string, _ queueConfig) (string, error) {
	return name, a.b.CreateQueue(name, memory.QueueConfig{})
}

func (a *memAdmin) remove(context.Context, string, []string) error { return nil }

func (a *memAdmin) exists(_ context.Context, name string) (bool, error) {
	return a.b.Messages(name) != nil, nil
}

func (a *memAdmin) peek(_ context.Context, q *Queue) ([]consumer.Message, error) {
	return a.b.Messages(q.Name), nil
}

func (a *memAdmin) close() error { return nil }

// kafkaBroker is what ferry.Open returns for kafka://.
type kafkaBroker interface {
	CreateTopic(ctx context.Context, topic string, cfg kafka.TopicConfig) error
	DeleteTopic(ctx context.Context, topic string) error
	Admin() *kadm.Client
	PeekGroup(ctx context.Context, topic, group string, perPartition int) ([]consumer.Message, error)
}

type kafkaAdmin struct{ b kafkaBroker }

func (a *kafkaAdmin) create(ctx context.Context, name string, cfg queueConfig) (string, error) {
	return name, a.b.CreateTopic(ctx, name, kafka.TopicConfig{Partitions: cfg.partitions})
}

func (a *kafkaAdmin) remove(ctx context.Context, name string, groups []string) error {
	err := a.b.DeleteTopic(ctx, name)
	if len(groups) > 0 {
		resp, gerr := a.b.Admin().DeleteGroups(ctx, groups...)
		if gerr == nil {
			for _, g := range resp.Sorted() {
				// A group that never joined, or never committed, may
				// be gone already.
				if g.Err != nil && !errors.Is(g.Err, kerr.GroupIDNotFound) {
					gerr = errors.Join(gerr, fmt.Errorf("delete consumer group %q: %w", g.Group, g.Err))
				}
			}
		}
		err = errors.Join(err, gerr)
	}
	return err
}

func (a *kafkaAdmin) exists(ctx context.Context, name string) (bool, error) {
	td, err := a.b.Admin().ListTopics(ctx, name)
	if err != nil {
		return false, err
	}
	d, ok := td[name]
	if !ok || errors.Is(d.Err, kerr.UnknownTopicOrPartition) {
		return false, nil
	}
	return d.Err == nil, d.Err
}

// peek reads the topic whole through the broker's Peek: a plain read of
// every partition from its start to its end offset, in no consumer group
// and settling nothing. (A consumer group's driver would stop at its
// partition buffer: records never settled hold it full.)
func (a *kafkaAdmin) peek(ctx context.Context, q *Queue) ([]consumer.Message, error) {
	return a.b.PeekGroup(ctx, q.Name, "", 0)
}

func (a *kafkaAdmin) close() error { return nil }

// sqsBroker is what ferry.Open returns for sqs://.
type sqsBroker interface {
	Client() *awssqs.Client
	driver.Opener
}

type sqsAdmin struct{ b sqsBroker }

func (a *sqsAdmin) create(ctx context.Context, name string, _ queueConfig) (string, error) {
	_, err := a.b.Client().CreateQueue(ctx, &awssqs.CreateQueueInput{QueueName: aws.String(name)})
	return name, err
}

// queueURL returns the URL of queue name, or "" when it does not exist.
func (a *sqsAdmin) queueURL(ctx context.Context, name string) (string, error) {
	out, err := a.b.Client().GetQueueUrl(ctx, &awssqs.GetQueueUrlInput{QueueName: aws.String(name)})
	var gone *types.QueueDoesNotExist
	var api smithy.APIError
	switch {
	case errors.As(err, &gone):
		return "", nil
	case errors.As(err, &api) && (api.ErrorCode() == "AWS.SimpleQueueService.NonExistentQueue" || api.ErrorCode() == "QueueDoesNotExist"):
		return "", nil
	case err != nil:
		return "", err
	}
	return aws.ToString(out.QueueUrl), nil
}

func (a *sqsAdmin) remove(ctx context.Context, name string, _ []string) error {
	u, err := a.queueURL(ctx, name)
	if err != nil || u == "" {
		return err
	}
	_, err = a.b.Client().DeleteQueue(ctx, &awssqs.DeleteQueueInput{QueueUrl: aws.String(u)})
	return err
}

func (a *sqsAdmin) exists(ctx context.Context, name string) (bool, error) {
	u, err := a.queueURL(ctx, name)
	return u != "", err
}

// peek receives the messages the queue says it holds, then makes them
// visible again at once. Each read counts as a receive
// (ApproximateReceiveCount), as any look at an SQS queue does.
func (a *sqsAdmin) peek(ctx context.Context, q *Queue) ([]consumer.Message, error) {
	u, err := a.queueURL(ctx, q.Name)
	if err != nil {
		return nil, err
	}
	if u == "" {
		return nil, fmt.Errorf("queue %q does not exist", q.Name)
	}
	attrs, err := a.b.Client().GetQueueAttributes(ctx, &awssqs.GetQueueAttributesInput{
		QueueUrl: aws.String(u), AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameApproximateNumberOfMessages},
	})
	if err != nil {
		return nil, err
	}
	want, err := strconv.Atoi(attrs.Attributes[string(types.QueueAttributeNameApproximateNumberOfMessages)])
	if err != nil {
		return nil, fmt.Errorf("queue depth: %w", err)
	}
	if want == 0 {
		return nil, nil
	}
	d, err := a.b.Driver(ctx, q.Name, driver.Config{})
	if err != nil {
		return nil, err
	}
	return peekQueue(ctx, d, want)
}

func (a *sqsAdmin) close() error { return nil }

// rabbitBroker is what ferry.Open returns for amqp:// and amqps://.
type rabbitBroker interface {
	driver.Opener
	System() string
}

// rabbitAdmin declares queues through package rabbit (the quorum queue its
// Topology declares by default) and deletes and inspects them on an AMQP
// connection of its own.
type rabbitAdmin struct {
	b   rabbitBroker
	url string

	mu   sync.Mutex
	conn *amqp.Connection
}

// discard is the logger of the admin's own declarations.
var discard = slog.New(slog.DiscardHandler)

func (a *rabbitAdmin) create(_ context.Context, name string, _ queueConfig) (string, error) {
	b, err := rabbit.Dial(a.url, rabbit.WithLogger(discard), rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: name}}}))
	if err != nil {
		return "", err
	}
	return rabbit.ToQueue(name), b.Close()
}

// channel returns a new channel on the admin's connection, dialling it when
// needed.
func (a *rabbitAdmin) channel() (*amqp.Channel, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.conn == nil || a.conn.IsClosed() {
		c, err := amqp.DialConfig(a.url, amqp.Config{Dial: amqp.DefaultDial(5 * time.Second)})
		if err != nil {
			return nil, fmt.Errorf("dial: %w", err)
		}
		a.conn = c
	}
	return a.conn.Channel()
}

func (a *rabbitAdmin) remove(_ context.Context, name string, _ []string) error {
	queues := []string{name}
	for _, d := range rabbit.DefaultRetryDelays {
		queues = append(queues, name+".ferry-delay."+strconv.FormatInt(d.Milliseconds(), 10)+"ms")
	}
	var errs []error
	for _, q := range queues {
		ch, err := a.channel()
		if err != nil {
			return err
		}
		if _, err := ch.QueueDelete(q, false, false, false); err != nil && !isNotFound(err) {
			errs = append(errs, fmt.Errorf("delete queue %q: %w", q, err))
		}
		ch.Close()
	}
	return errors.Join(errs...)
}

func isNotFound(err error) bool {
	var ae *amqp.Error
	return errors.As(err, &ae) && ae.Code == amqp.NotFound
}

// depth returns how many ready messages queue name holds, and false when
// it does not exist.
func (a *rabbitAdmin) depth(name string) (int, bool, error) {
	ch, err := a.channel()
	if err != nil {
		return 0, false, err
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(name, true, false, false, false, nil)
	if isNotFound(err) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, err
	}
	return q.Messages, true, nil
}

func (a *rabbitAdmin) exists(_ context.Context, name string) (bool, error) {
	_, ok, err := a.depth(name)
	return ok, err
}

// peek takes the queue's ready messages without acking them, then hands
// them back (basic.nack with requeue): they are delivered again with their
// delivery count one higher, as after any look at a queue.
func (a *rabbitAdmin) peek(ctx context.Context, q *Queue) ([]consumer.Message, error) {
	want, ok, err := a.depth(q.Name)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, fmt.Errorf("queue %q does not exist", q.Name)
	}
	if want == 0 {
		return nil, nil
	}
	// The prefetch must hold the whole queue: peekQueue settles nothing
	// until it has read it all, and the broker pushes no more than the
	// prefetch of unacked deliveries.
	d, err := a.b.Driver(ctx, q.Name, driver.Config{MaxInFlight: min(want, 65535)})
	if err != nil {
		return nil, err
	}
	ms, err := peekQueue(ctx, d, want)
	if err != nil {
		return nil, err
	}
	// The broker requeues what was handed back on its own time: wait (a
	// little) until the queue counts them again, so that a read right
	// after this one finds them.
	for wait := time.Now().Add(5 * time.Second); time.Now().Before(wait) && ctx.Err() == nil; {
		if n, _, err := a.depth(q.Name); err != nil || n >= len(ms) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	return ms, nil
}

func (a *rabbitAdmin) close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.conn == nil {
		return nil
	}
	err := a.conn.CloseDeadline(time.Now().Add(2 * time.Second))
	if errors.Is(err, amqp.ErrClosed) {
		return nil
	}
	return err
}
