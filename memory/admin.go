package memory

import (
	"context"
	"fmt"
	"time"

	"github.com/ferrymq/ferry/consumer"
)

var _ consumer.Admin = (*Broker)(nil)

// defaultMaxDeliveries is the MaxReceiveCount CreateSource gives a queue
// with a DeadLetter and no MaxDeliveries, as SQS's console does.
const defaultMaxDeliveries = 10

// CreateSource creates queue name with cfg (consumer.Admin), as CreateQueue
// does: cfg.FIFO is QueueConfig.FIFO, cfg.DeadLetter and cfg.MaxDeliveries
// are DeadLetterQueue and MaxReceiveCount (10 when 0, as SQS's console
// offers), and cfg.Lease is VisibilityTimeout. The dead-letter queue is
// created first, of the same kind, when it does not exist, as on SQS. The memory broker keeps messages until they
// are acked, so cfg.Retention is ignored, as is cfg.Partitions. A queue
// that exists with the same configuration is not an error; with another
// it fails with ErrQueueExists. ctx is not used.
func (b *Broker) CreateSource(_ context.Context, name string, cfg consumer.SourceConfig) error {
	qc := QueueConfig{FIFO: cfg.FIFO, VisibilityTimeout: cfg.Lease}
	if cfg.Lease < 0 {
		return consumer.ConfigErrorf("SourceConfig.Lease", "must be >= 0, got %v", cfg.Lease)
	}
	if cfg.MaxDeliveries < 0 {
		return consumer.ConfigErrorf("SourceConfig.MaxDeliveries", "must be >= 0, got %d", cfg.MaxDeliveries)
	}
	if cfg.MaxDeliveries > 0 && cfg.DeadLetter == "" {
		return consumer.ConfigErrorf("SourceConfig.MaxDeliveries", "needs a DeadLetter queue")
	}
	if cfg.DeadLetter != "" {
		if cfg.DeadLetter == name {
			return consumer.ConfigErrorf("SourceConfig.DeadLetter", "must not be the queue itself")
		}
		qc.DeadLetterQueue, qc.MaxReceiveCount = cfg.DeadLetter, cfg.MaxDeliveries
		if qc.MaxReceiveCount == 0 {
			qc.MaxReceiveCount = defaultMaxDeliveries
		}
		if b.lookup(cfg.DeadLetter) == nil {
			if err := b.CreateQueue(cfg.DeadLetter, QueueConfig{FIFO: cfg.FIFO}); err != nil {
				return err
			}
		}
	}
	return b.CreateQueue(name, qc)
}

// DeleteSource deletes queue name and its messages (consumer.Admin). A queue
// that does not exist is not an error. A driver open on the queue goes on
// with the deleted queue as it was, apart from the broker: a Publish to
// name afterwards makes a new queue (unless WithAutoCreate(false)), which
// that driver does not see. A queue whose dead-letter queue this was keeps
// moving its messages there, out of reach. ctx is not used.
func (b *Broker) DeleteSource(_ context.Context, name string) error {
	if name == "" {
		return consumer.ConfigErrorf("queue", "name must not be empty")
	}
	if b.isClosed() {
		return fmt.Errorf("memory: delete queue %q: %w", name, ErrClosed)
	}
	b.mu.Lock()
	delete(b.queues, name)
	b.mu.Unlock()
	return nil
}

// QueueConfig configures one queue. The zero value is a standard queue with a
// 30s visibility timeout and no dead-letter queue.
type QueueConfig struct {
	// VisibilityTimeout is how long a fetched message stays hidden from other
	// fetches before it is delivered again, unless it is settled or its lease
	// is extended first. Default 30s (DefaultVisibilityTimeout).
	VisibilityTimeout time.Duration

	// FIFO makes the queue keep order per message group, like an SQS FIFO
	// queue: the group is Message.Key (which must not be empty), messages of a
	// group are delivered one at a time in publish order, and a message ID
	// published again within DefaultDedupWindow is dropped. Default false: a
	// standard queue, delivering in roughly publish order with no ordering
	// guarantee after redeliveries.
	FIFO bool

	// MaxReceiveCount moves a message to DeadLetterQueue instead of
	// delivering it for the (MaxReceiveCount+1)-th time, as SQS redrive
	// does. Default 0: messages are delivered again for ever.
	MaxReceiveCount int

	// DeadLetterQueue names the queue that takes messages past
	// MaxReceiveCount. Required when MaxReceiveCount > 0, and only then. It
	// must already exist, must differ from the queue itself, and must be
	// FIFO exactly when the queue is.
	DeadLetterQueue string
}

// CreateQueue creates the queue name. Creating a queue that exists with the
// same configuration does nothing; with a different one it fails with
// ErrQueueExists. An invalid configuration fails with a *consumer.ConfigError
// naming the field.
func (b *Broker) CreateQueue(name string, cfg QueueConfig) error {
	if name == "" {
		return consumer.ConfigErrorf("queue", "name must not be empty")
	}
	if cfg.VisibilityTimeout < 0 {
		return consumer.ConfigErrorf("QueueConfig.VisibilityTimeout", "must be >= 0, got %s", cfg.VisibilityTimeout)
	}
	if cfg.VisibilityTimeout == 0 {
		cfg.VisibilityTimeout = DefaultVisibilityTimeout
	}
	if cfg.MaxReceiveCount < 0 {
		return consumer.ConfigErrorf("QueueConfig.MaxReceiveCount", "must be >= 0, got %d", cfg.MaxReceiveCount)
	}
	if cfg.MaxReceiveCount > 0 && cfg.DeadLetterQueue == "" {
		return consumer.ConfigErrorf("QueueConfig.DeadLetterQueue", "is required when MaxReceiveCount > 0")
	}
	if cfg.MaxReceiveCount == 0 && cfg.DeadLetterQueue != "" {
		return consumer.ConfigErrorf("QueueConfig.MaxReceiveCount", "must be > 0 when DeadLetterQueue is set")
	}
	if cfg.DeadLetterQueue == name {
		return consumer.ConfigErrorf("QueueConfig.DeadLetterQueue", "must not be the queue itself")
	}
	if b.isClosed() {
		return fmt.Errorf("memory: create queue %q: %w", name, ErrClosed)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	var dlq *queue
	if cfg.DeadLetterQueue != "" {
		dlq = b.queues[cfg.DeadLetterQueue]
		if dlq == nil {
			return consumer.ConfigErrorf("QueueConfig.DeadLetterQueue", "names queue %q, which does not exist", cfg.DeadLetterQueue)
		}
		if dlq.cfg.FIFO != cfg.FIFO {
			return consumer.ConfigErrorf("QueueConfig.DeadLetterQueue", "queue %q must be FIFO exactly when %q is", cfg.DeadLetterQueue, name)
		}
	}
	if q := b.queues[name]; q != nil {
		if q.cfg != cfg {
			return fmt.Errorf("memory: create queue %q: %w", name, ErrQueueExists)
		}
		return nil
	}
	b.queues[name] = newQueue(b, name, cfg, dlq)
	return nil
}
