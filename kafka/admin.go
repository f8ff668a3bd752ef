package kafka

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"

	"github.com/ferrymq/ferry/consumer"
)

var _ consumer.Admin = (*Broker)(nil)

// CreateSource creates topic name with cfg ([consumer.Admin]): cfg.Partitions
// partitions (0 is 1) at the cluster's default replication factor, and
// cfg.Retention as its retention.ms (0 is the cluster's default). It is
// CreateTopic under the portable configuration, and like it waits until the
// partitions have leaders and takes a topic that exists already for made:
// its configuration is left as it is. FIFO is ignored, a topic being ordered
// per partition already. Kafka has no broker dead-lettering: a
// cfg.DeadLetter or cfg.MaxDeliveries is a *[consumer.ConfigError], as a
// negative Partitions or MaxDeliveries is, and so is cfg.Lease: a record
// holds no lease, its partition being the group member's until a rebalance.
func (b *Broker) CreateSource(ctx context.Context, name string, cfg consumer.SourceConfig) error {
	if cfg.DeadLetter != "" {
		return consumer.ConfigErrorf("SourceConfig.DeadLetter", "Kafka has no broker dead-lettering; dead-letter with consumer.DeadLetter to a topic of your own")
	}
	if cfg.MaxDeliveries != 0 {
		return consumer.ConfigErrorf("SourceConfig.MaxDeliveries", "Kafka counts no deliveries: it has no broker dead-lettering")
	}
	if cfg.Lease != 0 {
		return consumer.ConfigErrorf("SourceConfig.Lease", "Kafka records hold no lease: a partition is the group member's until a rebalance")
	}
	if cfg.Partitions < 0 || cfg.Partitions > 1<<31-1 {
		return consumer.ConfigErrorf("SourceConfig.Partitions", "must be >= 0 and fit an int32, got %d", cfg.Partitions)
	}
	if cfg.Retention < 0 {
		return consumer.ConfigErrorf("SourceConfig.Retention", "must be >= 0, got %v", cfg.Retention)
	}
	return b.CreateTopic(ctx, name, TopicConfig{Partitions: int32(cfg.Partitions), Retention: cfg.Retention})
}

// DeleteSource deletes topic name and its records ([consumer.Admin]). A topic
// that does not exist is not an error. The consumer groups that read it
// are left: their committed offsets are the group's, deleted with
// Admin().DeleteGroups.
func (b *Broker) DeleteSource(ctx context.Context, name string) error {
	if name == "" {
		return consumer.ConfigErrorf("topic", "must not be empty")
	}
	return b.DeleteTopic(ctx, name)
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
