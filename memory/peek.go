package memory

import (
	"context"
	"fmt"

	"github.com/ferrymq/ferry/consumer"
)

var _ consumer.Peeker = (*Broker)(nil)

// Peek returns up to max of the messages queue holds, oldest first
// (consumer.Peeker): the first max of Messages, visible, delayed or in
// flight alike, and nothing about them changes (no receive is counted). A
// max below 1 is a *consumer.ConfigError; a queue that does not exist is
// an error wrapping ErrQueueNotFound and consumer.ErrSourceNotFound (Peek
// creates no queue, whatever WithAutoCreate says). ctx is not used.
func (b *Broker) Peek(_ context.Context, queue string, max int) ([]consumer.Message, error) {
	if max < 1 {
		return nil, consumer.ConfigErrorf("max", "must be >= 1, got %d", max)
	}
	ms := b.Messages(queue)
	if ms == nil {
		return nil, fmt.Errorf("memory: peek %q: %w: %w", queue, ErrQueueNotFound, consumer.ErrSourceNotFound)
	}
	if len(ms) > max {
		ms = ms[:max:max]
	}
	return ms, nil
}
