package memory

import (
	"context"
	"fmt"

	"github.com/ferrymq/ferry/consumer"
)

var _ consumer.Admin = (*Broker)(nil)

// defaultMaxDeliveries is the MaxReceiveCount CreateSource gives a queue
// with a DeadLetter and no MaxDeliveries, as SQS's console does.
const defaultMaxDeliveries = 10

// CreateSource creates queue name with cfg (consumer.Admin), as CreateQueue
// does: cfg.FIFO is QueueConfig.FIFO, cfg.DeadLetter and cfg.MaxDeliveries
// are DeadLetterQueue and MaxReceiveCount (10 when 0, as SQS's console
// offers). The dead-letter queue is created first, of the same kind, when
// it does not exist, as on SQS. The memory broker keeps messages until they
// are acked, so cfg.Retention is ignored, as is cfg.Partitions. A queue
// that exists with the same configuration is not an error; with another
// it fails with ErrQueueExists. ctx is not used.
func (b *Broker) CreateSource(_ context.Context, name string, cfg consumer.SourceConfig) error {
	qc := QueueConfig{FIFO: cfg.FIFO}
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
