package kafka

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kbin"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/msgmetrics"
)

// Errors returned by the adapter. Match them with errors.Is.
var (
	// ErrClosed is returned by every call on a closed Broker. A consumer's
	// Fetch wraps it with driver.Fatal, so its Run ends.
	ErrClosed = errors.New("kafka: broker closed")

	// ErrAuthentication is wrapped by the error of any call the broker
	// refused because the client could not authenticate (a wrong SASL user
	// or password, a TLS handshake that failed on a certificate), along
	// with consumer.ErrRefused. A consumer's Run ends with it (it is marked
	// driver.Fatal) instead of retrying for ever. The error never carries
	// the password.
	ErrAuthentication = errors.New("kafka: authentication failed")

	// ErrPeekShort is wrapped by Peek's error when it could not read a
	// partition up to the end offset it listed: nothing more came for a
	// few seconds. The error names each partition and how far it got.
	ErrPeekShort = errors.New("kafka: peek stopped short of the end")
)

// GroupProtocol chooses how the members of a consumer group share a topic's
// partitions.
type GroupProtocol uint8

const (
	// Classic is the consumer group protocol every Kafka version speaks,
	// with the cooperative-sticky assignor: a rebalance moves only the
	// partitions that change owner, and the others keep flowing. This is
	// the default.
	Classic GroupProtocol = iota
	// NextGen is KIP-848, the consumer group protocol of Kafka 4.x: the group
	// coordinator assigns partitions (its uniform assignor) and members
	// reconcile one partition at a time, with no group-wide barrier. It
	// needs a broker whose group.coordinator.rebalance.protocols includes
	// "consumer" (the default from 4.0).
	NextGen
)

func (p GroupProtocol) String() string {
	switch p {
	case Classic:
		return "classic"
	case NextGen:
		return "consumer"
	}
	return "GroupProtocol(" + strconv.Itoa(int(p)) + ")"
}

// Defaults of the options.
const (
	// DefaultCommitInterval is how often a consumer commits what it finished,
	// between rebalances.
	DefaultCommitInterval = time.Second
	// StuckAfter is how long a partition whose records wait (fetched,
	// unfinished) may go without finishing any before the consumer pauses
	// fetching it, when WithPartitionBuffer is not set.
	StuckAfter = 500 * time.Millisecond
	// DefaultRevokeWait bounds how long a rebalance waits for the handlers of
	// revoked partitions to return before it commits and lets go.
	DefaultRevokeWait = 20 * time.Second
)

type config struct {
	kopts           []kgo.Opt
	logger          *slog.Logger
	protocol        GroupProtocol
	commitInterval  time.Duration
	partitionBuffer int
	revokeWait      time.Duration
	sessionTimeout  time.Duration
	rebalanceTO     time.Duration
	kgoRebalanceTO  time.Duration // kgo.RebalanceTimeout in kopts (franz-go's default when absent)
	tls             *tls.Config   // WithTLS
	dial            *dialer       // the Broker's own dialer; nil when kopts bring one
	commitHook      func(CommitEvent)
	rebalanceHook   func(RebalanceEvent)
	meters          metric.MeterProvider
}

// WithMeterProvider sets where Publish reports its calls, as the
// OpenTelemetry messaging conventions name them
// (messaging.client.operation.duration and messaging.client.sent.messages,
// with messaging.system "kafka"). Default the global provider, a no-op
// until one is installed. The consumers report through
// consumer.WithMeterProvider.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(c *config) error {
		if mp == nil {
			return consumer.ConfigErrorf("MeterProvider", "must not be nil")
		}
		c.meters = mp
		return nil
	}
}

// Option configures a Broker. An option given a bad value makes New fail
// with a *consumer.ConfigError naming the field.
type Option func(*config) error

// WithClientOpts passes franz-go options through to every client the Broker
// makes (producer, consumers, admin): fetch and batch sizes, timeouts,
// compression, dialers, hooks. Options that would break Ferry's contract are
// refused with a *consumer.ConfigError: a consumer group or topics of their
// own (a consumer's group and topic are given to NewConsumer or Driver),
// autocommit settings (Ferry commits only what handlers finished), partition
// callbacks and BlockRebalanceOnPoll (Ferry owns the rebalance), kgo.InstanceID
// (every consumer of the Broker would join as one static member), acks other
// than all, a disabled idempotent producer, kgo.ManualFlushing and
// kgo.DefaultProduceTopicAlways (Publish promises durability, order and its
// topic). A kgo.RebalanceTimeout given here bounds a consumer's wait on
// revoke as WithRebalanceTimeout does (which wins when both are set).
// Default: none.
func WithClientOpts(opts ...kgo.Opt) Option {
	return func(c *config) error {
		for _, o := range opts {
			if o == nil {
				return consumer.ConfigErrorf("ClientOpts", "must not contain nil")
			}
		}
		c.kopts = append(c.kopts, opts...)
		return nil
	}
}

// WithTLS dials the brokers over TLS with cfg, as kgo.DialTLSConfig does
// (cfg.ServerName, when empty, is the host dialed). A TLS client at a
// plaintext listener, or a plaintext client at a TLS listener, is a
// configuration error: Publish fails and Run returns within seconds with an
// error wrapping consumer.ErrRefused that says which side speaks TLS.
// Default: plaintext.
func WithTLS(cfg *tls.Config) Option {
	return func(c *config) error {
		if cfg == nil {
			return consumer.ConfigErrorf("TLS", "must not be nil")
		}
		c.tls = cfg
		return nil
	}
}

// WithSASL authenticates every connection with m, for example
// scram.Auth{User: u, Pass: p}.AsSha512Mechanism() from
// github.com/twmb/franz-go/pkg/sasl/scram. A failed authentication is an
// error wrapping ErrAuthentication. Default: no SASL.
func WithSASL(m sasl.Mechanism) Option {
	return func(c *config) error {
		if m == nil {
			return consumer.ConfigErrorf("SASL", "must not be nil")
		}
		c.kopts = append(c.kopts, kgo.SASL(m))
		return nil
	}
}

// WithClientID sets the client id the brokers see in their logs and quotas.
// Default "ferry".
func WithClientID(id string) Option {
	return func(c *config) error {
		if id == "" {
			return consumer.ConfigErrorf("ClientID", "must not be empty")
		}
		c.kopts = append(c.kopts, kgo.ClientID(id))
		return nil
	}
}

// WithLogger sends the adapter's own logs, and franz-go's warnings and
// errors, to l. Default slog.Default().
func WithLogger(l *slog.Logger) Option {
	return func(c *config) error {
		if l == nil {
			return consumer.ConfigErrorf("Logger", "must not be nil")
		}
		c.logger = l
		return nil
	}
}

// WithGroupProtocol chooses the consumer group protocol of the Broker's
// consumers. Default Classic (cooperative-sticky).
func WithGroupProtocol(p GroupProtocol) Option {
	return func(c *config) error {
		if p != Classic && p != NextGen {
			return consumer.ConfigErrorf("GroupProtocol", "must be Classic or NextGen, got %d", p)
		}
		c.protocol = p
		return nil
	}
}

// WithCommitInterval sets how often a consumer commits, per partition, the
// offset below which every record is finished. Commits also happen when
// partitions are revoked and when the consumer stops. Default 1s
// (DefaultCommitInterval).
func WithCommitInterval(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return consumer.ConfigErrorf("CommitInterval", "must be > 0, got %s", d)
		}
		c.commitInterval = d
		return nil
	}
}

// WithPartitionBuffer sets how many records of one partition a consumer may
// hold fetched and unfinished: what a poll brings beyond waits in the
// consumer, fetching that partition pauses, and it resumes once half of
// them are finished, while the other partitions flow. Default: automatic:
// half of the loop's fetch batch (consumer.WithFetchBatch, at most the
// loop's in-flight bound), so that a partition whose oldest record does not
// progress (a retry in place, a hold, a slow key) leaves the rest of the
// loop's room to the others; it is paused once it holds that many with none
// finished for half a second (StuckAfter), or once more records wait in the
// consumer than it finished in the last half second. A set value pauses at
// that count whether the partition makes progress or not.
func WithPartitionBuffer(n int) Option {
	return func(c *config) error {
		if n <= 0 {
			return consumer.ConfigErrorf("PartitionBuffer", "must be > 0, got %d", n)
		}
		c.partitionBuffer = n
		return nil
	}
}

// WithSessionTimeout sets the consumer group session timeout: how long the
// coordinator waits for a heartbeat before it removes a member. Heartbeats
// run in the background, so a slow handler does not need a longer one.
// Default 45s (franz-go's default; the broker bounds it with
// group.min/max.session.timeout.ms). It applies to Classic groups; a
// NextGen (KIP-848) group's session timeout is the group config
// consumer.session.timeout.ms on the broker.
func WithSessionTimeout(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return consumer.ConfigErrorf("SessionTimeout", "must be > 0, got %s", d)
		}
		c.sessionTimeout = d
		return nil
	}
}

// WithRebalanceTimeout sets how long a classic group waits for its members
// to rejoin during a rebalance, which bounds how long a member may take to
// let go of revoked partitions. A consumer waits at most this, less a
// margin, for the handlers of revoked partitions (whose contexts are
// cancelled at once) before it commits and lets go. Default 60s.
func WithRebalanceTimeout(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return consumer.ConfigErrorf("RebalanceTimeout", "must be > 0, got %s", d)
		}
		c.rebalanceTO = d
		return nil
	}
}

// CommitEvent describes one offset commit the broker accepted, for
// WithCommitHook.
type CommitEvent struct {
	Topic  string
	Group  string
	Member string          // the member id the coordinator knows this consumer by
	Offset map[int32]int64 // partition -> committed offset (the next record to read)
}

// WithCommitHook calls fn after each commit the broker accepted, from the
// goroutine that committed. It is meant for tests and audits (who committed
// what, when); fn must not block. Default: none.
func WithCommitHook(fn func(CommitEvent)) Option {
	return func(c *config) error {
		if fn == nil {
			return consumer.ConfigErrorf("CommitHook", "must not be nil")
		}
		c.commitHook = fn
		return nil
	}
}

// RebalanceEvent describes what one rebalance callback did, for
// WithRebalanceHook: partitions assigned, partitions revoked (after the
// loop let go of them and what finished was committed), or partitions lost
// (nothing committed).
type RebalanceEvent struct {
	Topic    string
	Group    string
	Member   string
	Assigned []int32
	Revoked  []int32
	Lost     []int32
}

// WithRebalanceHook calls fn at the end of each rebalance callback that
// concerned the consumer's topic, from franz-go's group goroutine. It is
// meant for tests and audits; fn must not block. Default: none.
func WithRebalanceHook(fn func(RebalanceEvent)) Option {
	return func(c *config) error {
		if fn == nil {
			return consumer.ConfigErrorf("RebalanceHook", "must not be nil")
		}
		c.rebalanceHook = fn
		return nil
	}
}

// Broker is a connection to a Kafka cluster: a consumer.Publisher, and the
// factory of consumers (NewConsumer, Driver). It is safe for concurrent use.
type Broker struct {
	seeds []string
	cfg   config
	log   *slog.Logger

	prod *kgo.Client
	adm  *kadm.Client
	admc *kgo.Client

	authOK    atomic.Bool // the producer has got through once
	plink     link        // what the producer saw of its connections
	maxRecord int32       // the producer's batch limit: a larger record cannot be sent
	maxWrite  int32       // the producer's request limit

	mu        sync.Mutex
	drivers   map[*kafkaDriver]struct{}
	closed    chan struct{}
	closeOnce sync.Once

	metrics *msgmetrics.Publisher
}

var (
	_ consumer.Broker      = (*Broker)(nil)
	_ consumer.SystemNamer = (*Broker)(nil)
	_ driver.Opener        = (*Broker)(nil)
)

// System names the broker as OpenTelemetry's messaging.system does: "kafka".
func (b *Broker) System() string { return "kafka" }

// New connects to the cluster whose bootstrap addresses are seeds (host:port)
// and returns a Broker. It fails with a *consumer.ConfigError naming the
// field when seeds is empty or an option is wrong; it does not wait for the
// cluster to answer (the first Publish, Fetch or admin call does).
func New(seeds []string, opts ...Option) (*Broker, error) {
	if len(seeds) == 0 {
		return nil, consumer.ConfigErrorf("Seeds", "must name at least one broker address")
	}
	for _, s := range seeds {
		if s == "" {
			return nil, consumer.ConfigErrorf("Seeds", "must not contain an empty address")
		}
	}
	cfg := config{
		logger:         slog.Default(),
		commitInterval: DefaultCommitInterval,
		revokeWait:     DefaultRevokeWait,
	}
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o(&cfg); err != nil {
			return nil, err
		}
	}
	if err := checkClientOpts(seeds, &cfg); err != nil {
		return nil, err
	}
	if cfg.meters == nil {
		cfg.meters = otel.GetMeterProvider()
	}
	pm, err := msgmetrics.NewPublisher(cfg.meters, "kafka")
	if err != nil {
		return nil, fmt.Errorf("kafka: metrics: %w", err)
	}
	b := &Broker{
		metrics: pm,
		seeds:   append([]string(nil), seeds...),
		cfg:     cfg,
		log:     cfg.logger,
		drivers: make(map[*kafkaDriver]struct{}),
		closed:  make(chan struct{}),
	}
	prod, err := kgo.NewClient(b.clientOpts(&b.plink,
		kgo.RequiredAcks(kgo.AllISRAcks()),
		// Java's default partitioner: murmur2 of the key for keyed records,
		// sticky batches for the others.
		kgo.RecordPartitioner(kgo.UniformBytesPartitioner(64<<10, true, true, nil)),
		// Java's default linger since Kafka 4.0 (KIP-1030): concurrent
		// Publish calls share batches. A call does not wait it out once
		// the producer knows the topic's partitions (see Publish).
		kgo.ProducerLinger(5*time.Millisecond),
		kgo.RecordDeliveryTimeout(2*time.Minute),
	)...)
	if err != nil {
		return nil, fmt.Errorf("kafka: producer: %w", err)
	}
	admc, err := kgo.NewClient(b.clientOpts(nil)...)
	if err != nil {
		prod.Close()
		return nil, fmt.Errorf("kafka: admin client: %w", err)
	}
	b.prod, b.admc, b.adm = prod, admc, kadm.NewClient(admc)
	b.maxRecord, _ = prod.OptValue(kgo.ProducerBatchMaxBytes).(int32)
	b.maxWrite, _ = prod.OptValue(kgo.BrokerMaxWriteBytes).(int32)
	return b, nil
}

// clientOpts is every client's base: seeds, a logger, the Broker's dialer
// (or WithTLS's config for a dialer of the user's), l as hooks, the user's
// options, and extra.
func (b *Broker) clientOpts(l *link, extra ...kgo.Opt) []kgo.Opt {
	o := []kgo.Opt{kgo.SeedBrokers(b.seeds...), kgo.ClientID("ferry"), kgo.WithLogger(kgoLogger{b.log})}
	switch {
	case b.cfg.dial != nil:
		o = append(o, kgo.Dialer(b.cfg.dial.dial))
	case b.cfg.tls != nil:
		o = append(o, kgo.DialTLSConfig(b.cfg.tls))
	}
	if l != nil {
		o = append(o, kgo.WithHooks(l))
	}
	o = append(o, b.cfg.kopts...)
	return append(o, extra...)
}

// checkClientOpts refuses the franz-go options that would break the
// contract. It reads them back from a client that never connects (a
// franz-go client dials only when asked to do something).
func checkClientOpts(seeds []string, c *config) error {
	c.dial = &dialer{timeout: 10 * time.Second, tls: c.tls} // franz-go's default DialTimeout
	opts := c.kopts
	if len(opts) == 0 {
		return nil
	}
	if c.tls != nil {
		// franz-go refuses a kgo.Dialer of the user's along with it,
		// as it should: the dialer would dial in plaintext.
		opts = append([]kgo.Opt{kgo.DialTLSConfig(c.tls)}, opts...)
	}
	// A group of the probe's own, so that franz-go accepts group options
	// (it refuses autocommit options without a group) and we can refuse
	// them ourselves, saying why.
	const probeGroup = "ferry.probe.group"
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(seeds...), kgo.ConsumerGroup(probeGroup)}, opts...)...)
	if err != nil {
		return consumer.ConfigErrorf("ClientOpts", "%v", err)
	}
	defer cl.Close()
	refuse := func(name, why string) error {
		return consumer.ConfigErrorf("ClientOpts", "%s is not allowed: %s", name, why)
	}
	if t, _ := cl.OptValue(kgo.DialTLSConfig).(*tls.Config); t != c.tls {
		c.dial = nil // a TLS config of the user's: franz-go dials
	} else if d, ok := cl.OptValue(kgo.DialTimeout).(time.Duration); ok && d > 0 {
		c.dial.timeout = d
	}
	if g, _ := cl.OptValue(kgo.ConsumerGroup).(string); g != probeGroup {
		return refuse("kgo.ConsumerGroup", "a consumer's group is the consumer's name (consumer.WithName), or the group given to Driver")
	}
	if ts, _ := cl.OptValue(kgo.ConsumeTopics).([]string); len(ts) > 0 {
		return refuse("kgo.ConsumeTopics", "a consumer's topic is the one given to NewConsumer or Driver")
	}
	if ps, _ := cl.OptValue(kgo.ConsumePartitions).(map[string]map[int32]kgo.Offset); len(ps) > 0 {
		return refuse("kgo.ConsumePartitions", "a consumer reads its topic through its group")
	}
	if b, _ := cl.OptValue(kgo.ConsumeRegex).(bool); b {
		return refuse("kgo.ConsumeRegex", "a consumer reads one topic")
	}
	if b, _ := cl.OptValue(kgo.BlockRebalanceOnPoll).(bool); b {
		return refuse("kgo.BlockRebalanceOnPoll", "processing runs off the poll path; a blocked rebalance would stall the group")
	}
	if b, _ := cl.OptValue(kgo.GreedyAutoCommit).(bool); b {
		return refuse("kgo.GreedyAutoCommit", "Ferry commits only what handlers finished")
	}
	if b, _ := cl.OptValue(kgo.AutoCommitMarks).(bool); b {
		return refuse("kgo.AutoCommitMarks", "Ferry commits only what handlers finished")
	}
	if d, _ := cl.OptValue(kgo.AutoCommitInterval).(time.Duration); d != 5*time.Second {
		return refuse("kgo.AutoCommitInterval", "Ferry commits itself; use WithCommitInterval")
	}
	c.kgoRebalanceTO, _ = cl.OptValue(kgo.RebalanceTimeout).(time.Duration)
	if b, _ := cl.OptValue(kgo.ManualFlushing).(bool); b {
		return refuse("kgo.ManualFlushing", "Publish returns once its records are durable, and nothing would ever flush them")
	}
	if b, _ := cl.OptValue(kgo.DefaultProduceTopicAlways).(bool); b {
		return refuse("kgo.DefaultProduceTopicAlways", "Publish writes to the topic it is given, and dead letters to theirs")
	}
	if vs := cl.OptValues(kgo.InstanceID); len(vs) == 2 && vs[1] == true {
		return refuse("kgo.InstanceID", "every consumer of a Broker would join as the same static member and fence the others")
	}
	if b, _ := cl.OptValue(kgo.DisableIdempotentWrite).(bool); b {
		return refuse("kgo.DisableIdempotentWrite", "Publish keeps per-key order with the idempotent producer")
	}
	// franz-go wraps rebalance callbacks once a group is set, so they are
	// told apart without one: franz-go refuses callbacks and autocommit
	// settings on a client with no group.
	nogroup, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(seeds...)}, opts...)...)
	if err != nil {
		return refuse("a rebalance callback or autocommit setting", fmt.Sprintf("the consumer owns its group's callbacks and commits (%v)", err))
	}
	nogroup.Close()
	if a, ok := cl.OptValue(kgo.RequiredAcks).(kgo.Acks); ok && a != kgo.AllISRAcks() {
		return refuse("kgo.RequiredAcks", "Publish returns only once all in-sync replicas have the records")
	}
	return nil
}

// Close closes the Broker's producer and admin connections and every
// consumer driver it made that is still open (their Run then ends with an
// error wrapping ErrClosed). Consumers should be stopped first, by
// cancelling their Run: that commits what they finished. Calling Close again
// does nothing.
func (b *Broker) Close() error {
	b.closeOnce.Do(func() {
		close(b.closed)
		b.mu.Lock()
		ds := make([]*kafkaDriver, 0, len(b.drivers))
		for d := range b.drivers {
			ds = append(ds, d)
		}
		b.mu.Unlock()
		for _, d := range ds {
			_ = d.Close()
		}
		b.prod.Close()
		b.admc.Close()
	})
	return nil
}

func (b *Broker) isClosed() bool {
	select {
	case <-b.closed:
		return true
	default:
		return false
	}
}

// Publish sends msgs to topic and returns nil once all in-sync replicas
// have every record (acks=all, idempotent producer). Key is the record key
// and picks the partition as the Java client does (murmur2), so Ferry and
// Java producers agree; an empty Key is no key (records spread over
// partitions). Headers become record headers; ID, when set, travels in the
// header HeaderMessageID. Records of one key are produced in the order given,
// within a call and across calls.
//
// Records the cluster refused are reported in a *consumer.PublishError,
// each wrapping franz-go's error (kerr errors match with errors.Is). The
// cluster refuses whole batches: a record it refuses (larger than the
// topic's max.message.bytes, say) fails the records of its partition sent
// in the same batch with it, which may be records of other calls made at
// the same time (the producer lingers to batch them), and each call
// reports its own. Each record is checked before it is sent (its size
// counted as franz-go counts it), and the records of one key are sent
// one after another: a record that fails, refused here (larger than the
// producer's batch limit) or by the cluster, fails every later record of
// its key in the call, without sending them.
func (b *Broker) Publish(ctx context.Context, topic string, msgs ...consumer.Message) error {
	start := time.Now()
	err := b.publish(ctx, topic, msgs)
	if len(msgs) > 0 {
		b.metrics.Record(ctx, topic, len(msgs), start, err)
	}
	return err
}

func (b *Broker) publish(ctx context.Context, topic string, msgs []consumer.Message) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if b.isClosed() {
		return fmt.Errorf("kafka: publish to %q: %w", topic, ErrClosed)
	}
	if topic == "" {
		return consumer.ConfigErrorf("topic", "must not be empty")
	}
	if len(msgs) == 0 {
		return nil
	}
	if err := b.checkAccess(ctx); err != nil {
		return fmt.Errorf("kafka: publish to %q: %w", topic, err)
	}
	maxBytes := b.maxRecordFor(topic)
	var (
		failed []consumer.FailedMessage
		dead   map[string]bool // keys with a failed record: their later records are not sent
	)
	fail := func(i int, err error) {
		failed = append(failed, consumer.FailedMessage{Index: i, Err: err})
	}
	kill := func(key string) {
		if key == "" {
			return
		}
		if dead == nil {
			dead = make(map[string]bool)
		}
		dead[key] = true
	}
	// Each record is checked before it is sent, and the records of a
	// key are sent one after another (the next once the cluster has the
	// previous): a record of a key that fails, here or in the cluster,
	// fails the key's later records of the call without sending them.
	recs := make([]kgo.Record, len(msgs))
	// The keys' and header values' bytes share one buffer, and the
	// headers one slice: a few allocations a call rather than a few a
	// record.
	nbytes, nheaders := 0, 0
	for i := range msgs {
		m := &msgs[i]
		nbytes += len(m.Key) + len(m.ID)
		nheaders += len(m.Headers)
		if m.ID != "" {
			nheaders++
		}
		for _, v := range m.Headers {
			nbytes += len(v)
		}
	}
	buf := make([]byte, 0, nbytes)
	bytesOf := func(s string) []byte {
		n := len(buf)
		buf = append(buf, s...)
		return buf[n:len(buf):len(buf)]
	}
	headers := make([]kgo.RecordHeader, 0, nheaders)
	var (
		wave  = make([]int, 0, len(msgs)) // sent together: keyless records, and the first of each key
		queue map[string][]int            // each key's later records, in order; nil when no key repeats
		keys  map[string]struct{}         // the keys seen, until one repeats
		twice bool                        // a key repeats
	)
	for i := range msgs {
		m := &msgs[i]
		r := &recs[i]
		r.Topic = topic
		if m.Key != "" {
			r.Key = bytesOf(m.Key)
		}
		r.Value = m.Body
		if len(m.Headers) > 0 || m.ID != "" {
			h0 := len(headers)
			if m.ID != "" {
				headers = append(headers, kgo.RecordHeader{Key: HeaderMessageID, Value: bytesOf(m.ID)})
			}
			for k, v := range m.Headers {
				if k == HeaderMessageID && m.ID != "" {
					continue
				}
				headers = append(headers, kgo.RecordHeader{Key: k, Value: bytesOf(v)})
			}
			r.Headers = headers[h0:len(headers):len(headers)]
		}
		if m.Key != "" && !twice {
			if keys == nil {
				keys = make(map[string]struct{}, len(msgs))
			}
			_, twice = keys[m.Key]
			keys[m.Key] = struct{}{}
		}
	}
	// Most calls repeat no key: then every record goes in one wave.
	for i := range msgs {
		key := msgs[i].Key
		switch {
		case !twice || key == "":
			wave = append(wave, i)
		case queue[key] != nil:
			queue[key] = append(queue[key], i)
		default:
			if queue == nil {
				queue = make(map[string][]int, len(keys))
			}
			queue[key] = []int{}
			wave = append(wave, i)
		}
	}
	var (
		sendable []int
		batch    []*kgo.Record
		index    map[*kgo.Record]int // a record's place in recs, made on the first failure
	)
	for len(wave) > 0 {
		sendable = sendable[:0]
		for _, i := range wave {
			r, key := &recs[i], msgs[i].Key
			switch {
			case dead[key]:
				fail(i, fmt.Errorf("kafka: not sent: an earlier record of key %q in this call failed", key))
			case maxBytes > 0 && recordSize(r) > int(maxBytes):
				fail(i, fmt.Errorf("kafka: record of about %d bytes exceeds the producer's batch limit of %d bytes: %w", recordSize(r), maxBytes, kerr.MessageTooLarge))
				kill(key)
			default:
				sendable = append(sendable, i)
			}
		}
		// ProduceSync rather than Produce and a wait: it ends the linger
		// of the partitions it wrote to once every record is buffered, so
		// a caller waiting for its acks does not also wait out the linger
		// that batches concurrent callers' records.
		batch = batch[:0]
		for _, i := range sendable {
			batch = append(batch, &recs[i])
		}
		for _, res := range b.prod.ProduceSync(ctx, batch...) {
			if res.Err == nil {
				continue
			}
			if index == nil {
				index = make(map[*kgo.Record]int, len(recs))
				for i := range recs {
					index[&recs[i]] = i
				}
			}
			i := index[res.Record]
			fail(i, b.publishErr(topic, res.Err))
			kill(msgs[i].Key)
		}
		wave = wave[:0]
		for key, rest := range queue {
			if len(rest) == 0 {
				delete(queue, key)
				continue
			}
			wave = append(wave, rest[0])
			queue[key] = rest[1:]
		}
		slices.Sort(wave)
	}
	if len(failed) == 0 {
		return nil
	}
	sortFailed(failed)
	if len(failed) == len(msgs) {
		if err := ctx.Err(); err != nil {
			return b.deadlineErr(topic, err)
		}
	}
	return &consumer.PublishError{Failed: failed}
}

// checkAccess makes sure the producer gets through before records wait
// on a connection that never comes: franz-go retries a refused SASL
// handshake until the records' delivery timeout, and a TLS/plaintext
// mismatch for as long as it is asked to, so a wrong password or a wrong
// port would otherwise look like a hang. A cluster that does not answer
// is no such refusal: Publish waits for it, up to its context. Once the
// producer got through, it is not asked again.
func (b *Broker) checkAccess(ctx context.Context) error {
	if b.authOK.Load() {
		return nil
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	err := b.prod.Ping(pctx)
	switch {
	case err == nil:
		b.authOK.Store(true)
		return nil
	case refusedBy(&b.plink, err):
		addr, _ := b.plink.last()
		return refused(b.addrOr(addr), err)
	}
	return nil // not answering for now: the producer keeps trying, as it should
}

// addrOr is addr, or the seed addresses when addr is empty.
func (b *Broker) addrOr(addr string) string {
	if addr != "" {
		return addr
	}
	return strings.Join(b.seeds, ",")
}

// deadlineErr is the error of a Publish to topic whose every record failed
// as its context ended with ctxErr: that error, and what the producer
// last saw of the cluster when it had not got through since.
func (b *Broker) deadlineErr(topic string, ctxErr error) error {
	addr, seen := b.plink.last()
	if seen == nil {
		return fmt.Errorf("kafka: publish to %q: %w", topic, ctxErr)
	}
	why := unreachable(addr, seen)
	if refusedBy(&b.plink, seen) {
		why = refused(addr, seen)
	}
	return fmt.Errorf("kafka: publish to %q: %w; the client last saw: %w", topic, ctxErr, why)
}

func (b *Broker) publishErr(topic string, err error) error {
	if isRefusal(err) {
		addr, _ := b.plink.last()
		return fmt.Errorf("kafka: publish to %q: %w", topic, refused(b.addrOr(addr), err))
	}
	return fmt.Errorf("kafka: publish to %q: %w", topic, err)
}

func sortFailed(f []consumer.FailedMessage) {
	for i := 1; i < len(f); i++ {
		for j := i; j > 0 && f[j].Index < f[j-1].Index; j-- {
			f[j], f[j-1] = f[j-1], f[j]
		}
	}
}

// recordSize is the size of a batch holding r alone, as franz-go counts it
// before it refuses a record as too large (a v2 batch header, and the
// record's varint-framed encoding), plus a small margin.
func recordSize(r *kgo.Record) int {
	const (
		batchHeader = 61 // franz-go's recordBatchOverhead
		margin      = 16
	)
	l := 1 + 1 + 1 + // attributes, timestamp delta, offset delta (first of its batch)
		kbin.VarintLen(int32(len(r.Key))) + len(r.Key) +
		kbin.VarintLen(int32(len(r.Value))) + len(r.Value) +
		kbin.VarintLen(int32(len(r.Headers)))
	for _, h := range r.Headers {
		l += kbin.VarintLen(int32(len(h.Key))) + len(h.Key) + kbin.VarintLen(int32(len(h.Value))) + len(h.Value)
	}
	return batchHeader + kbin.VarintLen(int32(l)) + l + margin
}

// maxRecordFor is the largest batch the producer sends to topic: its batch
// limit, or less when its request limit leaves less room.
func (b *Broker) maxRecordFor(topic string) int32 {
	m := b.maxRecord
	if b.maxWrite > 0 {
		// A produce request's own header, the topic and the partition
		// come out of the request limit; 512 bytes is more than those.
		if w := b.maxWrite - 512 - int32(len(topic)); m <= 0 || w < m {
			m = w
		}
	}
	return m
}

// HeaderMessageID is the record header that carries consumer.Message.ID
// when a publisher sets one. A consumed record without it gets the ID
// topic/partition/offset. It is the ID on the consuming side, not one of
// Message.Headers, as the other brokers' message ids are.
const HeaderMessageID = "ferry-message-id"

// readHeaders returns a consumed record's HeaderMessageID (the last, if the
// record has several) and its other headers, nil when it has none: most
// records carry only the id, and building a map costs more than the rest
// of turning a record into a message.
func readHeaders(r *kgo.Record) (id string, headers map[string]string) {
	others := 0
	for i := range r.Headers {
		if h := &r.Headers[i]; h.Key == HeaderMessageID {
			id = string(h.Value)
		} else {
			others++
		}
	}
	if others == 0 {
		return id, nil
	}
	headers = make(map[string]string, others)
	for i := range r.Headers {
		if h := &r.Headers[i]; h.Key != HeaderMessageID {
			headers[h.Key] = string(h.Value)
		}
	}
	return id, headers
}

// TopicConfig says how CreateTopic makes a topic.
type TopicConfig struct {
	// Partitions is the number of partitions. Default 1.
	Partitions int32
	// ReplicationFactor is how many brokers keep each partition. Default -1:
	// the cluster's default.replication.factor.
	ReplicationFactor int16
	// Retention is how long records are kept (retention.ms). Default 0: the
	// cluster's log.retention setting. Negative keeps them for ever.
	Retention time.Duration
	// Configs are further topic configs (cleanup.policy, min.insync.replicas...).
	Configs map[string]string
}

// CreateTopic creates topic with cfg and waits until its partitions have
// leaders. A topic that exists already is not an error (its configuration
// is left as it is).
func (b *Broker) CreateTopic(ctx context.Context, topic string, cfg TopicConfig) error {
	if topic == "" {
		return consumer.ConfigErrorf("topic", "must not be empty")
	}
	if cfg.Partitions < 0 {
		return consumer.ConfigErrorf("TopicConfig.Partitions", "must be >= 0, got %d", cfg.Partitions)
	}
	if cfg.Partitions == 0 {
		cfg.Partitions = 1
	}
	if cfg.ReplicationFactor == 0 {
		cfg.ReplicationFactor = -1
	}
	configs := make(map[string]*string, len(cfg.Configs)+1)
	for k, v := range cfg.Configs {
		configs[k] = &v
	}
	if cfg.Retention != 0 {
		ms := "-1"
		if cfg.Retention > 0 {
			ms = strconv.FormatInt(cfg.Retention.Milliseconds(), 10)
		}
		configs["retention.ms"] = &ms
	}
	resp, err := b.adm.CreateTopic(ctx, cfg.Partitions, cfg.ReplicationFactor, configs, topic)
	if err == nil {
		err = resp.Err
	}
	if err != nil && !errors.Is(err, kerr.TopicAlreadyExists) {
		return fmt.Errorf("kafka: create topic %q: %w", topic, wrapAuth(err))
	}
	// Wait for leaders: a produce right after CreateTopics may otherwise
	// wait for metadata to catch up.
	for {
		md, err := b.adm.Metadata(ctx, topic)
		if err == nil {
			if t, ok := md.Topics[topic]; ok && t.Err == nil && len(t.Partitions) > 0 {
				ready := true
				for _, p := range t.Partitions {
					if p.Err != nil || p.Leader < 0 {
						ready = false
					}
				}
				if ready {
					return nil
				}
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("kafka: create topic %q: waiting for leaders: %w", topic, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// DeleteTopic deletes topic. A topic that does not exist is not an error.
func (b *Broker) DeleteTopic(ctx context.Context, topic string) error {
	resp, err := b.adm.DeleteTopic(ctx, topic)
	if err == nil {
		err = resp.Err
	}
	if err != nil && !errors.Is(err, kerr.UnknownTopicOrPartition) {
		return fmt.Errorf("kafka: delete topic %q: %w", topic, wrapAuth(err))
	}
	return nil
}

// Admin returns a kadm client over the Broker's admin connection, for
// what Ferry does not wrap (describing groups, listing offsets). It is
// closed with the Broker.
func (b *Broker) Admin() *kadm.Client { return b.adm }

// NewConsumer returns a delivery loop over topic: consumer.NewOn over the
// Broker, with opts. The name is required (consumer.WithName): without it
// NewConsumer fails with a *consumer.ConfigError naming the field "Name",
// because on Kafka the name is the group id, every consumer of one topic
// and name is a member of one group and shares the topic's partitions
// with the others, and a default would have two services that forgot it
// split each other's partitions.
//
// NewConsumer does not reach the cluster (ctx is not used): Run does, and
// reports and retries while it cannot (see the package doc).
func (b *Broker) NewConsumer(ctx context.Context, topic string, opts ...consumer.Option) (*consumer.Loop, error) {
	return consumer.NewOn(ctx, b, topic, opts...)
}

// Driver returns the driver of one member of the group cfg.Name over
// topic, for consumer.NewOn or a loop of your own (driver.Opener). It
// does not reach the cluster (ctx is not used): the member joins its
// group on its first Fetch. It implements driver.Connector,
// driver.Revoker, driver.LagReporter and driver.Aser (a handler reaches
// the *kgo.Record with Message.As, given a **kgo.Record or a *kgo.Record
// to copy into). An empty cfg.Name is a *consumer.ConfigError naming
// "Name".
func (b *Broker) Driver(_ context.Context, topic string, cfg driver.Config) (driver.Driver, error) {
	if cfg.Name == "" {
		return nil, consumer.ConfigErrorf("Name", "must be set with consumer.WithName: on Kafka the consumer's name is its group id, "+
			"and consumers of one topic with one name share its partitions")
	}
	d, err := b.newDriver(topic)
	if err != nil {
		return nil, err
	}
	if err := d.start(cfg.Name); err != nil {
		b.forget(d)
		return nil, err
	}
	return d, nil
}

func (b *Broker) forget(d *kafkaDriver) {
	b.mu.Lock()
	delete(b.drivers, d)
	b.mu.Unlock()
}
