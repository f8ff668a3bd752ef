package kafka

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl"

	"go.opentelemetry.io/otel/metric"

	"github.com/ferrymq/ferry/consumer"
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
	// Share makes every consumer a member of a share group (KIP-932, Kafka
	// 4.2 and later): Kafka as a queue. Members share partitions, the
	// broker hands each record to one member under a lock that a running
	// handler renews, and each record is acknowledged by itself, with no
	// offsets and no order; more members than partitions all get work.
	// See Share groups in the package documentation.
	Share
)

func (p GroupProtocol) String() string {
	switch p {
	case Classic:
		return "classic"
	case NextGen:
		return "consumer"
	case Share:
		return "share"
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
	instanceID      string // WithInstanceID
	rebalanceTO     time.Duration
	kgoRebalanceTO  time.Duration // kgo.RebalanceTimeout in kopts (franz-go's default when absent)
	// kgoContext is kgo.WithContext in kopts (context.Background when
	// absent): share group sessions derive their clients' contexts from it.
	kgoContext    context.Context
	tls           *tls.Config // WithTLS
	dial          *dialer     // the Broker's own dialer; nil when kopts bring one
	commitHook    func(CommitEvent)
	rebalanceHook func(RebalanceEvent)
	meters        metric.MeterProvider
}

// WithMeterProvider sets where Publish reports its calls, as the
// OpenTelemetry messaging conventions name them
// (messaging.client.operation.duration and messaging.client.sent.messages,
// with messaging.system "kafka"). Default the global provider, a no-op
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

// Option configures a Broker. An option given a bad value makes New fail
// with a *[consumer.ConfigError] naming the field.
type Option func(*config) error

// WithClientOpts passes franz-go options through to every client the Broker
// makes (producer, consumers, admin): fetch and batch sizes, timeouts,
// compression, dialers, hooks. Options that would break Ferry's contract are
// refused with a *[consumer.ConfigError]: a consumer group or topics of their
// own (a consumer's group and topic are given to NewConsumer or Driver),
// autocommit settings (Ferry commits only what handlers finished), partition
// callbacks and BlockRebalanceOnPoll (Ferry owns the rebalance), kgo.InstanceID
// (use [WithInstanceID], which keeps two consumers of one group apart), acks other
// than all, a disabled idempotent producer, kgo.ManualFlushing and
// kgo.DefaultProduceTopicAlways (Publish promises durability, order and its
// topic). A kgo.RebalanceTimeout given here bounds a consumer's wait on
// revoke as [WithRebalanceTimeout] does (which wins when both are set).
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
// error wrapping [consumer.ErrRefused] that says which side speaks TLS.
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

// WithGroupProtocol chooses the kind of group the Broker's consumers join:
// a consumer group, Classic (cooperative-sticky) or NextGen (KIP-848), or
// a share group (Share). Default Classic.
func WithGroupProtocol(p GroupProtocol) Option {
	return func(c *config) error {
		if p != Classic && p != NextGen && p != Share {
			return consumer.ConfigErrorf("GroupProtocol", "must be Classic, NextGen or Share, got %d", p)
		}
		c.protocol = p
		return nil
	}
}

// WithCommitInterval sets how often a consumer commits, per partition, the
// offset below which every record is finished. Commits also happen when
// partitions are revoked and when the consumer stops. Default 1s
// ([DefaultCommitInterval]).
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
// half of the loop's fetch batch ([consumer.WithFetchBatch], at most the
// loop's in-flight bound), so that a partition whose oldest record does not
// progress (a retry in place, a hold, a slow key) leaves the rest of the
// loop's room to the others; it is paused once it holds that many with none
// finished for half a second ([StuckAfter]), or once more records wait in the
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
// [NextGen] (KIP-848) group's session timeout is the group config
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

// WithInstanceID makes each consumer of the Broker a static member of its
// group (group.instance.id, KIP-345): give each process its own id that
// outlives restarts, such as a StatefulSet pod's name. A static member
// does not leave its group when it stops, and one that comes back with the
// same id within the session timeout gets its partitions back with no
// rebalance, so a rolling restart does not move every partition twice; a
// member that does not come back keeps its partitions unread until the
// session timeout ends (raise it with [WithSessionTimeout] to cover a
// restart, and watch lag). The id is scoped to the group: consumers of
// different groups on one Broker share it, and a second consumer of one
// group on the same Broker is refused with a *[consumer.ConfigError], since
// it would fence the first. When another process joins the group with the
// same id, the coordinator fences this one: its Run ends with an error
// wrapping [ErrFenced] rather than fight the other for the id. It applies to
// Classic groups: New refuses it with [Share] (share groups have no static
// members) and with [NextGen] (on Kafka 4.4 a KIP-848 static member that
// restarts is refused until its session times out, which stalls its
// partitions instead of sparing a rebalance). Default: none (dynamic
// members).
func WithInstanceID(id string) Option {
	return func(c *config) error {
		if id == "" {
			return consumer.ConfigErrorf("InstanceID", "must not be empty")
		}
		// Kafka checks a group.instance.id as it checks a topic name.
		if len(id) > 249 || id == "." || id == ".." || strings.ContainsFunc(id, func(r rune) bool {
			return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-')
		}) {
			return consumer.ConfigErrorf("InstanceID", "%q is not one Kafka takes: at most 249 of ASCII letters, digits, '.', '_' and '-', and not . or ..", id)
		}
		c.instanceID = id
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
// [WithRebalanceHook]: partitions assigned, partitions revoked (after the
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
	// them ourselves, saying why. franz-go refuses a kgo.ShareGroup beside
	// it ("cannot use both ConsumerGroup and ShareGroup").
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
	if ctx, ok := cl.OptValue(kgo.WithContext).(context.Context); ok && ctx != nil {
		c.kgoContext = ctx
	}
	if b, _ := cl.OptValue(kgo.ManualFlushing).(bool); b {
		return refuse("kgo.ManualFlushing", "Publish returns once its records are durable, and nothing would ever flush them")
	}
	if b, _ := cl.OptValue(kgo.DefaultProduceTopicAlways).(bool); b {
		return refuse("kgo.DefaultProduceTopicAlways", "Publish writes to the topic it is given, and dead letters to theirs")
	}
	if vs := cl.OptValues(kgo.InstanceID); len(vs) == 2 && vs[1] == true {
		return refuse("kgo.InstanceID", "use kafka.WithInstanceID, which refuses a second consumer of one group on the Broker (it would fence the first)")
	}
	if id, _ := cl.OptValue(kgo.TransactionalID).(string); id != "" {
		return refuse("kgo.TransactionalID", "Publish runs no transactions, and franz-go fails every record a transactional producer writes outside one; for writes that commit with your data, use the outbox")
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
