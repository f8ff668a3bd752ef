package kafka

import (
	"context"

	"github.com/ferrymq/ferry/consumer"
)

var _ consumer.Admin = (*Broker)(nil)

// CreateSource creates topic name with cfg (consumer.Admin): cfg.Partitions
// partitions (0 is 1) at the cluster's default replication factor, and
// cfg.Retention as its retention.ms (0 is the cluster's default). It is
// CreateTopic under the portable configuration, and like it waits until the
// partitions have leaders and takes a topic that exists already for made:
// its configuration is left as it is. FIFO is ignored, a topic being ordered
// per partition already. Kafka has no broker dead-lettering: a
// cfg.DeadLetter or cfg.MaxDeliveries is a *consumer.ConfigError, as a
// negative Partitions or MaxDeliveries is.
func (b *Broker) CreateSource(ctx context.Context, name string, cfg consumer.SourceConfig) error {
	if cfg.DeadLetter != "" {
		return consumer.ConfigErrorf("SourceConfig.DeadLetter", "Kafka has no broker dead-lettering; dead-letter with consumer.DeadLetter to a topic of your own")
	}
	if cfg.MaxDeliveries != 0 {
		return consumer.ConfigErrorf("SourceConfig.MaxDeliveries", "Kafka counts no deliveries: it has no broker dead-lettering")
	}
	if cfg.Partitions < 0 || cfg.Partitions > 1<<31-1 {
		return consumer.ConfigErrorf("SourceConfig.Partitions", "must be >= 0 and fit an int32, got %d", cfg.Partitions)
	}
	if cfg.Retention < 0 {
		return consumer.ConfigErrorf("SourceConfig.Retention", "must be >= 0, got %v", cfg.Retention)
	}
	return b.CreateTopic(ctx, name, TopicConfig{Partitions: int32(cfg.Partitions), Retention: cfg.Retention})
}

// DeleteSource deletes topic name and its records (consumer.Admin). A topic
// that does not exist is not an error. The consumer groups that read it
// are left: their committed offsets are the group's, deleted with
// Admin().DeleteGroups.
func (b *Broker) DeleteSource(ctx context.Context, name string) error {
	if name == "" {
		return consumer.ConfigErrorf("topic", "must not be empty")
	}
	return b.DeleteTopic(ctx, name)
}
