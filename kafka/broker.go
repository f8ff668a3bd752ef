package kafka

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"go.opentelemetry.io/otel"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/msgmetrics"
)

// Broker is a connection to a Kafka cluster: a [consumer.Publisher], and the
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
	loadErrs  sync.Map    // topic -> loadErr: the cluster's last refusal of a write to it
	maxRecord int32       // the producer's batch limit: a larger record cannot be sent
	maxWrite  int32       // the producer's request limit

	mu        sync.Mutex
	drivers   map[driver.Driver]struct{} // open consumer drivers, of either kind of group
	closed    chan struct{}
	closeOnce sync.Once

	metrics *msgmetrics.Publisher
}

var (
	_ consumer.Broker      = (*Broker)(nil)
	_ consumer.SystemNamer = (*Broker)(nil)
	_ driver.Opener        = (*Broker)(nil)
)

// System names the broker as OpenTelemetry's messaging.system does:
// [MessagingSystem].
func (b *Broker) System() string { return MessagingSystem }

// MessagingSystem is Kafka's messaging.system in OpenTelemetry's semantic
// conventions, in traces and metrics (Broker.System).
const MessagingSystem = "kafka"

// GroupProtocol reports the kind of group the Broker's consumers join
// ([WithGroupProtocol]).
func (b *Broker) GroupProtocol() GroupProtocol { return b.cfg.protocol }

// New connects to the cluster whose bootstrap addresses are seeds (host:port)
// and returns a Broker. It fails with a *[consumer.ConfigError] naming the
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
		kgoContext:     context.Background(),
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
	switch {
	case cfg.instanceID == "" || cfg.protocol == Classic:
	case cfg.protocol == Share:
		return nil, consumer.ConfigErrorf("InstanceID", "share groups have no static members (KIP-932); drop WithInstanceID or use a consumer group")
	default:
		// Measured on Kafka 4.4 with franz-go v1.22.3: the member that
		// comes back is refused (UNRELEASED_INSTANCE_ID) until the session
		// timeout, though the one that left sent the static leave (epoch
		// -2), so a restart would stall its partitions instead of sparing
		// a rebalance.
		return nil, consumer.ConfigErrorf("InstanceID", "static members are supported in Classic groups only: "+
			"a KIP-848 (NextGen) static member that restarts is refused by the coordinator until its session times out")
	}
	if cfg.meters == nil {
		cfg.meters = otel.GetMeterProvider()
	}
	pm, err := msgmetrics.NewPublisher(cfg.meters, MessagingSystem)
	if err != nil {
		return nil, fmt.Errorf("kafka: metrics: %w", err)
	}
	b := &Broker{
		metrics: pm,
		seeds:   append([]string(nil), seeds...),
		cfg:     cfg,
		log:     cfg.logger,
		drivers: make(map[driver.Driver]struct{}),
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

// clientOpts is every client's base: seeds, a logger (the producer's, whose
// link is plink, also keeps the cluster's write refusals), the Broker's
// dialer (or [WithTLS]'s config for a dialer of the user's), l as hooks,
// the user's options, and extra.
func (b *Broker) clientOpts(l *link, extra ...kgo.Opt) []kgo.Opt {
	var logger kgo.Logger = kgoLogger{b.log}
	if l == &b.plink {
		logger = producerLogger{kgoLogger{b.log}, b}
	}
	o := []kgo.Opt{kgo.SeedBrokers(b.seeds...), kgo.ClientID("ferry"), kgo.WithLogger(logger)}
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

// Close closes the Broker's producer and admin connections and every
// consumer driver it made that is still open (their Run then ends with an
// error wrapping [ErrClosed]). Consumers should be stopped first, by
// cancelling their Run: that commits what they finished. Calling Close again
// does nothing.
func (b *Broker) Close() error {
	b.closeOnce.Do(func() {
		close(b.closed)
		b.mu.Lock()
		ds := make([]driver.Driver, 0, len(b.drivers))
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

// addrOr is addr, or the seed addresses when addr is empty.
func (b *Broker) addrOr(addr string) string {
	if addr != "" {
		return addr
	}
	return strings.Join(b.seeds, ",")
}

// NewConsumer returns a delivery loop over topic: [consumer.NewOn] over the
// Broker, with opts. The name is required ([consumer.WithName]): without it
// NewConsumer fails with a *[consumer.ConfigError] naming the field "Name",
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
// topic, for [consumer.NewOn] or a loop of your own ([driver.Opener]). It
// does not reach the cluster (ctx is not used): the member joins its
// group on its first Fetch. It implements [driver.Connector],
// [driver.Revoker], [driver.LagReporter] and [driver.Aser] (a handler reaches
// the *kgo.Record with Message.As, given a **kgo.Record or a *kgo.Record
// to copy into); a share group member ([Share]) implements
// [driver.Extender] and [driver.Drainer] instead of [driver.Revoker]. An
// empty cfg.Name is a *[consumer.ConfigError] naming "Name".
func (b *Broker) Driver(_ context.Context, topic string, cfg driver.Config) (driver.Driver, error) {
	if cfg.Name == "" {
		return nil, consumer.ConfigErrorf("Name", "must be set with consumer.WithName: on Kafka the consumer's name is its group id, "+
			"and consumers of one topic with one name share its partitions")
	}
	if b.cfg.protocol == Share {
		return b.newShareDriver(topic, cfg.Name, cfg)
	}
	return b.newDriver(topic, cfg.Name)
}

func (b *Broker) forget(d driver.Driver) {
	b.mu.Lock()
	delete(b.drivers, d)
	b.mu.Unlock()
}
