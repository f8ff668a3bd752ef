package demo

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"net"
	"net/url"
	"os"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/cmd/ferry/internal/cli"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/brokerkind"
	"github.com/ferrymq/ferry/kafka"
	"github.com/ferrymq/ferry/memory"
	"github.com/ferrymq/ferry/rabbit"
	"github.com/ferrymq/ferry/sqs"
)

// This file is where a run's messages live: the broker opened from
// Config.Broker, with the orders queue (or topic) and its dead-letter queue
// made fresh for the run.

// brokerName is how the demo's text names the broker of kind (cli.Kind's
// value): "Kafka", "SQS", "RabbitMQ" or "the memory broker".
func brokerName(kind string) string {
	switch kind {
	case brokerkind.Kafka:
		return "Kafka"
	case brokerkind.SQS:
		return "SQS"
	case brokerkind.RabbitMQ:
		return "RabbitMQ"
	}
	return "the memory broker"
}

// site is the broker of a run and its two queues: the source of the orders
// and the dead-letter queue. On Kafka they are topics and the two billing
// consumers are members of one consumer group.
type site struct {
	kind  string // cli.Kind of b
	url   string // ferry.Open's URL, for a second connection
	shown string // the URL without its password
	b     ferry.Broker
	mem   *memory.Broker // on the memory broker only

	orders, dlq string        // queue or topic names: what Publish takes too, on every broker
	group       string        // the billing consumers' group (Kafka)
	dlqGroup    string        // the dead-letter reader's group (Kafka)
	ordersURL   string        // the orders queue's URL (SQS)
	visibility  time.Duration // memory and SQS

	mu     sync.Mutex
	extra  []ferry.Broker // more connections, closed with the site
	closed bool
}

// errUnknownBroker is returned when ferry.Open gives a Broker of a kind the
// demo does not know how to set up.
var errUnknownBroker = errors.New("demo: the broker opened from this URL lacks the methods the demo needs")

// openSite opens the broker of cfg and creates the run's queues on it. A
// bad URL fails with ferry's *URLError (errors.Is ferry.ErrBadURL).
func openSite(ctx context.Context, cfg Config) (_ *site, err error) {
	raw := cfg.Broker
	if raw == "" {
		raw = "mem://"
	}
	b, err := ferry.Open(ctx, raw)
	if err != nil {
		return nil, err
	}
	s := &site{kind: cli.Kind(b), url: raw, shown: ferry.Redact(raw), b: b, visibility: cfg.VisibilityTimeout}
	defer func() {
		if err != nil {
			s.close(context.WithoutCancel(ctx))
		}
	}()
	if m, ok := ferry.Memory(b); ok && s.kind == brokerkind.Memory {
		s.mem = m
		s.orders, s.dlq = OrdersQueue, DeadLetterQueue
		return s, s.createQueue(ctx)
	}
	id := runID()
	s.orders, s.dlq = "ferry-demo-"+id+"-orders", "ferry-demo-"+id+"-orders-dlq"
	switch s.kind {
	case brokerkind.Kafka:
		s.group, s.dlqGroup = "ferry-demo-"+id+"-billing", "ferry-demo-"+id+"-dlq-reader"
		return s, s.createKafka(ctx)
	case brokerkind.SQS:
		return s, s.createSQS(ctx)
	case brokerkind.RabbitMQ:
		return s, s.createRabbit(ctx)
	}
	return nil, fmt.Errorf("%w (%s)", errUnknownBroker, s.shown)
}

// runID is a random name for a run's queues: runs never see each other's.
func runID() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// createQueue makes the orders queue, with the run's visibility timeout,
// and its dead-letter queue on the memory broker and SQS (CreateSource
// makes the dead-letter queue too). The broker's own redrive, after 10
// receives, is a backstop far behind the DeadLetter middleware's attempts:
// a message that reaches it lands in the dead-letter queue without a
// reason, which the verdict would catch.
func (s *site) createQueue(ctx context.Context) error {
	if s.kind == brokerkind.SQS {
		// SQS counts the visibility timeout in whole seconds, and
		// CreateSource rounds it up: the demo counts with what SQS keeps.
		s.visibility = time.Duration(math.Ceil(s.visibility.Seconds())) * time.Second
	}
	adm, ok := s.b.(consumer.Admin)
	if !ok {
		return fmt.Errorf("%w (%s)", errUnknownBroker, s.kind)
	}
	cfg := consumer.SourceConfig{Lease: s.visibility, DeadLetter: s.dlq, MaxDeliveries: 10}
	if err := adm.CreateSource(ctx, s.orders, cfg); err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	return nil
}

// ordersPartitions is the orders topic's partition count on Kafka: room
// for both consumers of the group, and for a kill to move some.
const ordersPartitions = 6

func (s *site) createKafka(ctx context.Context) error {
	k, ok := s.b.(consumer.Admin)
	if !ok {
		return fmt.Errorf("%w (Kafka)", errUnknownBroker)
	}
	if err := k.CreateSource(ctx, s.dlq, consumer.SourceConfig{Partitions: 1}); err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	if err := k.CreateSource(ctx, s.orders, consumer.SourceConfig{Partitions: ordersPartitions}); err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	return nil
}

func (s *site) createSQS(ctx context.Context) error {
	if err := s.createQueue(ctx); err != nil {
		return err
	}
	// The orders queue's depth, which left counts, is SQS's own, beyond
	// consumer.Lag: it is asked of the queue's URL.
	q, ok := s.b.(*sqs.Broker)
	if !ok {
		return fmt.Errorf("%w (SQS)", errUnknownBroker)
	}
	out, err := q.Client().GetQueueUrl(ctx, &awssqs.GetQueueUrlInput{QueueName: aws.String(s.orders)})
	if err != nil {
		return fmt.Errorf("demo: URL of SQS queue %s: %w", s.orders, err)
	}
	s.ordersURL = aws.ToString(out.QueueUrl)
	return nil
}

// rabbitConn runs f with a connection of its own, for what the rabbit
// package leaves to the caller: a queue's depth (declaring and deleting
// queues is consumer.Admin's).
func (s *site) rabbitConn(ctx context.Context, f func(conn *amqp.Connection) error) error {
	u, err := url.Parse(s.url)
	if err != nil {
		return err
	}
	cfg := amqp.Config{}
	if file := u.Query().Get("ca_file"); file != "" {
		// ferry.Open's own parameter, not amqp091's: the CA to trust.
		pem, err := os.ReadFile(file)
		if err != nil {
			return err
		}
		roots := x509.NewCertPool()
		roots.AppendCertsFromPEM(pem)
		cfg.TLSClientConfig = &tls.Config{RootCAs: roots, ServerName: u.Hostname(), MinVersion: tls.VersionTLS12}
	}
	u.RawQuery = ""
	dialCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	cfg.Dial = func(network, addr string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(dialCtx, network, addr)
	}
	conn, err := amqp.DialConfig(u.String(), cfg)
	if err != nil {
		return errors.New(ferry.Redact(err.Error()))
	}
	defer conn.Close()
	return f(conn)
}

// onChannel runs f on a new channel of conn: a failed queue operation
// closes its channel, so each gets its own.
func onChannel(conn *amqp.Connection, f func(ch *amqp.Channel) error) error {
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer func() {
		if !ch.IsClosed() {
			_ = ch.Close()
		}
	}()
	return f(ch)
}

func (s *site) createRabbit(ctx context.Context) error {
	r, ok := s.b.(consumer.Admin)
	if s.kind != brokerkind.RabbitMQ || !ok {
		return fmt.Errorf("%w (RabbitMQ)", errUnknownBroker)
	}
	for _, q := range []string{s.dlq, s.orders} {
		// Quorum queues, as the rabbit package declares by default: they
		// count deliveries (x-delivery-count).
		if err := r.CreateSource(ctx, q, consumer.SourceConfig{}); err != nil {
			return fmt.Errorf("demo: declare RabbitMQ queue %s: %w", q, err)
		}
	}
	return nil
}

// delayQueues are the queues the rabbit package routes delayed retries of
// the orders queue through (see its package documentation).
func (s *site) delayQueues() []string {
	var out []string
	for _, d := range rabbit.DefaultRetryDelays {
		out = append(out, s.orders+".ferry-delay."+strconv.FormatInt(d.Milliseconds(), 10)+"ms")
	}
	return out
}

// open opens another connection to the broker, as another process would:
// the victim's, so that killing it cuts its own connection only. On the
// memory broker it returns the site's broker: a process has only one.
func (s *site) open(ctx context.Context) (ferry.Broker, error) {
	if s.kind == brokerkind.Memory {
		return s.b, nil
	}
	b, err := ferry.Open(ctx, s.url)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.extra = append(s.extra, b)
	s.mu.Unlock()
	return b, nil
}

// driver returns a driver over the orders queue (or, with dlq, over the
// dead-letter queue) on b, one of the site's connections. On Kafka every
// billing consumer joins one group.
func (s *site) driver(ctx context.Context, b ferry.Broker, dlq bool, maxInFlight int) (driver.Driver, error) {
	source := s.orders
	if dlq {
		source = s.dlq
	}
	group := s.group
	if dlq {
		group = s.dlqGroup
	}
	o, ok := b.(driver.Opener)
	if !ok {
		return nil, errUnknownBroker
	}
	return o.Driver(ctx, source, driver.Config{Name: group, MaxInFlight: maxInFlight})
}

// lagOf is what the status line shows as the lag: messages waiting or in
// flight. Kafka's lag, counted from the committed offset, already holds
// what is in flight.
func (s *site) lagOf(l consumer.Lag) int64 {
	if s.kind == brokerkind.Kafka {
		return l.Messages
	}
	return l.Messages + max(l.InFlight, 0)
}

// left counts the messages of the orders queue not yet handled: waiting,
// in flight, or waiting for a retry. loop, when not nil, is the running
// consumer whose deliveries RabbitMQ counts nowhere else.
func (s *site) left(ctx context.Context, loop *consumer.Loop) (int64, error) {
	switch s.kind {
	case brokerkind.Memory:
		q := s.mem.Stats(s.orders)
		return q.Visible + q.Delayed + q.InFlight, nil
	case brokerkind.Kafka:
		return s.kafkaLag(ctx)
	case brokerkind.SQS:
		out, err := s.b.(*sqs.Broker).Client().GetQueueAttributes(ctx, &awssqs.GetQueueAttributesInput{
			QueueUrl: aws.String(s.ordersURL),
			AttributeNames: []types.QueueAttributeName{
				types.QueueAttributeNameApproximateNumberOfMessages,
				types.QueueAttributeNameApproximateNumberOfMessagesNotVisible,
				types.QueueAttributeNameApproximateNumberOfMessagesDelayed,
			},
		})
		if err != nil {
			return 0, fmt.Errorf("demo: depth of %s: %w", s.orders, err)
		}
		var n int64
		for _, v := range out.Attributes {
			i, _ := strconv.ParseInt(v, 10, 64)
			n += i
		}
		return n, nil
	}
	// RabbitMQ: the ready messages of the orders queue and of its delay
	// queues, and the running consumer's unacknowledged deliveries.
	var n int64
	err := s.rabbitConn(ctx, func(conn *amqp.Connection) error {
		for _, q := range append([]string{s.orders}, s.delayQueues()...) {
			err := onChannel(conn, func(ch *amqp.Channel) error {
				st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
				if err == nil {
					n += int64(st.Messages)
				}
				return err
			})
			var ae *amqp.Error
			if errors.As(err, &ae) && ae.Code == amqp.NotFound && q != s.orders {
				continue // the delay queue of a delay no retry needed
			}
			if err != nil {
				return fmt.Errorf("demo: depth of %s: %w", q, err)
			}
		}
		return nil
	})
	if err != nil {
		return 0, err
	}
	if loop != nil {
		l, err := loop.Lag(ctx)
		if err != nil {
			return 0, err
		}
		n += max(l.InFlight, 0)
	}
	return n, nil
}

// share reports whether the run's consumers are members of a share group
// (a kafka:// URL with group_protocol=share).
func (s *site) share() bool {
	kb, ok := s.b.(*kafka.Broker)
	return ok && kb.GroupProtocol() == kafka.Share
}

// kafkaLag is the billing group's lag on the orders topic: the end offsets
// minus the committed ones; for a share group, the records its coordinator
// counts as not acknowledged.
func (s *site) kafkaLag(ctx context.Context) (int64, error) {
	adm := s.b.(*kafka.Broker).Admin()
	if s.share() {
		ds, err := adm.DescribeShareGroupOffsets(ctx, s.group)
		if err == nil {
			err = ds[s.group].Err
		}
		if err != nil {
			return 0, fmt.Errorf("demo: share group offsets of %s: %w", s.group, err)
		}
		var n int64
		for _, o := range ds[s.group].Offsets[s.orders] {
			if o.Err != nil || o.Lag < 0 {
				return 0, fmt.Errorf("demo: share group offsets of %s: partition %d: no lag known yet (%v)", s.group, o.Partition, o.Err)
			}
			n += o.Lag
		}
		return n, nil
	}
	commits, err := adm.FetchOffsets(ctx, s.group)
	if err != nil {
		return 0, fmt.Errorf("demo: committed offsets of %s: %w", s.group, err)
	}
	ends, err := adm.ListEndOffsets(ctx, s.orders)
	if err != nil {
		return 0, fmt.Errorf("demo: end offsets of %s: %w", s.orders, err)
	}
	var n int64
	var ferr error
	ends.Each(func(e kadm.ListedOffset) {
		if e.Err != nil {
			ferr = e.Err
			return
		}
		from := int64(0) // the topic is the run's own: it starts at 0
		if c, ok := commits.Lookup(s.orders, e.Partition); ok && c.Err == nil && c.At >= 0 {
			from = c.At
		}
		n += max(e.Offset-from, 0)
	})
	if ferr != nil {
		return 0, fmt.Errorf("demo: end offsets of %s: %w", s.orders, ferr)
	}
	return n, nil
}

// takeover says how the broker hands a killed consumer's messages to the
// other one.
func (s *site) takeover() string {
	switch {
	case s.share():
		return "its client left the share group, giving back what it held; the broker hands those records to " + Survivor +
			" (a crashed process's records would come back when their locks ran out, 30s by default)"
	}
	switch s.kind {
	case brokerkind.Kafka:
		return "its client left the consumer group; after the rebalance " + Survivor +
			" reads its partitions again from the last committed offset (a crashed process would be noticed after the group's session timeout, 45s by default)"
	case brokerkind.RabbitMQ:
		return "its connection closed, so RabbitMQ requeued its unacknowledged deliveries at once"
	}
	return fmt.Sprintf("the broker hands them out again after the %s visibility timeout", s.visibility)
}

// takenOverAfter ends the verdict's line about the kill.
func (s *site) takenOverAfter() string {
	if s.share() {
		return "once the broker had them back"
	}
	switch s.kind {
	case brokerkind.Kafka:
		return "after the rebalance"
	case brokerkind.RabbitMQ:
		return "once RabbitMQ requeued them"
	}
	return "after the visibility timeout"
}

// describe names the broker and the run's queues, for the first lines.
func (s *site) describe() string {
	if s.kind == brokerkind.Memory {
		return "the memory broker"
	}
	what := "queue"
	if s.kind == brokerkind.Kafka {
		what = "topic"
	}
	return fmt.Sprintf("%s at %s (%s %s and its dead-letter %s %s, made for this run)", brokerName(s.kind), s.shown, what, s.orders, what, s.dlq)
}

// close deletes the run's queues and closes every connection.
func (s *site) close(ctx context.Context) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.closed = true
	extra := s.extra
	s.mu.Unlock()
	for _, b := range extra {
		_ = b.Close()
	}
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	if adm, ok := s.b.(consumer.Admin); ok && s.kind != brokerkind.Memory {
		// On RabbitMQ with the orders queue's delay queues.
		_ = adm.DeleteSource(ctx, s.orders)
		_ = adm.DeleteSource(ctx, s.dlq)
	}
	if k, ok := s.b.(*kafka.Broker); ok {
		_, _ = k.Admin().DeleteGroups(ctx, s.group, s.dlqGroup)
	}
	_ = s.b.Close()
}

// closeExtra closes b, one of the site's extra connections, now.
func (s *site) closeExtra(b ferry.Broker) {
	if b == s.b {
		return
	}
	s.mu.Lock()
	s.extra = slices.DeleteFunc(s.extra, func(x ferry.Broker) bool { return x == b })
	s.mu.Unlock()
	_ = b.Close()
}

// dlqReader reads the dead-letter queue of a real broker while the run
// goes on, keeping a copy of every message for the verdict (the memory
// broker's can be read in place).
type dlqReader struct {
	loop *consumer.Loop

	mu   sync.Mutex
	msgs []consumer.Message
}

func newDLQReader(ctx context.Context, s *site, log *slog.Logger) (*dlqReader, error) {
	drv, err := s.driver(ctx, s.b, true, 64)
	if err != nil {
		return nil, fmt.Errorf("demo: dead-letter reader: %w", err)
	}
	loop, err := consumer.New(drv, consumer.WithName("dlq-reader"), consumer.WithLogger(log))
	if err != nil {
		_ = drv.Close()
		return nil, err
	}
	return &dlqReader{loop: loop}, nil
}

// Handle keeps a copy of m.
func (d *dlqReader) Handle(_ context.Context, m *consumer.Message) error {
	c := consumer.Message{ID: m.ID, Key: m.Key, Body: bytes.Clone(m.Body), Headers: maps.Clone(m.Headers)}
	d.mu.Lock()
	d.msgs = append(d.msgs, c)
	d.mu.Unlock()
	return nil
}

func (d *dlqReader) messages() []consumer.Message {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.msgs)
}
