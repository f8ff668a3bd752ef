package ferrytest

import (
	"context"
	"errors"
	"fmt"
	"math"

	"github.com/twmb/franz-go/pkg/kerr"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/kafka"
	"github.com/ferrymq/ferry/memory"
)

// This file holds what ferrytest asks of each broker beyond Publish and
// NewConsumer: making and removing queues ([consumer.Admin]), and reading
// them without taking anything away ([consumer.Peeker]). Only what the
// contract cannot say is asked of an adapter's own type: Kafka's consumer
// groups, and whether a topic or a memory queue exists.

// admin manages the queues of one broker through its [consumer.Admin] and
// [consumer.Peeker].
type admin struct {
	b      ferry.Broker
	adm    consumer.Admin
	peeker consumer.Peeker
	kind   Kind
}

func newAdmin(kind Kind, b ferry.Broker) (admin, error) {
	adm, ok := b.(consumer.Admin)
	if !ok {
		return admin{}, fmt.Errorf("ferry.Open gave a %T, which creates no queues (consumer.Admin)", b)
	}
	p, ok := b.(consumer.Peeker)
	if !ok {
		return admin{}, fmt.Errorf("ferry.Open gave a %T, which reads no queue without consuming it (consumer.Peeker)", b)
	}
	return admin{b: b, adm: adm, peeker: p, kind: kind}, nil
}

// create makes queue name and returns the destination that reaches it:
// its name, on every broker.
func (a *admin) create(ctx context.Context, name string, cfg queueConfig) (string, error) {
	if err := a.adm.CreateSource(ctx, name, consumer.SourceConfig{Partitions: int(cfg.partitions)}); err != nil {
		return "", err
	}
	return name, nil
}

// remove deletes queue name and the Kafka consumer groups made for it.
func (a *admin) remove(ctx context.Context, name string, groups []string) error {
	err := a.adm.DeleteSource(ctx, name)
	if kb, ok := a.b.(*kafka.Broker); ok && len(groups) > 0 {
		resp, gerr := kb.Admin().DeleteGroups(ctx, groups...)
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

// exists asks the broker whether queue name exists: the topic list on
// Kafka, the memory broker's queues, and elsewhere a driver's Connect,
// which looks the queue up (SQS GetQueueUrl, a passive queue.declare on
// RabbitMQ) without consuming.
func (a *admin) exists(ctx context.Context, name string) (bool, error) {
	switch b := a.b.(type) {
	case *memory.Broker:
		return b.Messages(name) != nil, nil
	case *kafka.Broker:
		td, err := b.Admin().ListTopics(ctx, name)
		if err != nil {
			return false, err
		}
		d, ok := td[name]
		if !ok || errors.Is(d.Err, kerr.UnknownTopicOrPartition) {
			return false, nil
		}
		return d.Err == nil, d.Err
	}
	o, ok := a.b.(driver.Opener)
	if !ok {
		return false, fmt.Errorf("a %T opens no driver", a.b)
	}
	d, err := o.Driver(ctx, name, driver.Config{Name: "ferrytest-exists"})
	if err != nil {
		return false, err
	}
	defer d.Close()
	c, ok := d.(driver.Connector)
	if !ok {
		return false, fmt.Errorf("a %T driver looks up no queue", d)
	}
	err = c.Connect(ctx)
	if errors.Is(err, consumer.ErrSourceNotFound) {
		return false, nil
	}
	return err == nil, err
}

// peekAll is the max of a Peek that wants the whole queue.
const peekAll = math.MaxInt32

// peek returns the messages queue name holds, leaving them there.
func (a *admin) peek(ctx context.Context, q *Queue) ([]consumer.Message, error) {
	return a.peeker.Peek(ctx, q.Name, peekAll)
}

// close releases what the admin opened: nothing, the broker's connections
// being the broker's.
func (a *admin) close() error { return nil }
