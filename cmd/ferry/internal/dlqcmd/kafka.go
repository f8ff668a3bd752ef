package dlqcmd

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
)

// kafkaBroker is what a redrive on Kafka uses of a kafka.Broker.
type kafkaBroker interface {
	ferry.Broker
	Peek(ctx context.Context, topic, group string, perPartition int) ([]consumer.Message, error)
	Admin() *kadm.Client
}

// ErrGroupInUse is returned by a redrive on Kafka whose group has members.
var ErrGroupInUse = errors.New("the redrive's consumer group is in use")

// kafkaChunk is how many records of each partition one read brings.
const kafkaChunk = 100

// redriveKafka is Redrive on Kafka. It reads the dead-letter topic from
// the group's committed offsets without joining the group (a member that
// dies would hold its partitions until its session timed out, and a
// second run would wait that long), and commits the offset past each
// record, as a consumer outside a group may (kadm CommitOffsets), once the
// record is published. A group that has members refuses those commits:
// two redrives of one group cannot run at once, nor can a redrive and a
// consumer of that group.
func redriveKafka(ctx context.Context, b kafkaBroker, cfg RedriveConfig, res *Result, bar *progress) error {
	adm := b.Admin()
	commit := func(m consumer.Message) error {
		p, err := strconv.ParseInt(m.Lane, 10, 32)
		if err != nil {
			return fmt.Errorf("record %s has no partition", m.ID)
		}
		var o kadm.Offsets
		o.AddOffset(cfg.Destination, int32(p), m.Offset+1, -1)
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), opTimeout)
		defer cancel()
		r, err := adm.CommitOffsets(cctx, cfg.Group, o)
		if err == nil {
			err = r.Error()
		}
		if err != nil {
			return fmt.Errorf("committing the offset of group %q past %s: %w", cfg.Group, m.ID, err)
		}
		return nil
	}
	// Refuse at once rather than after the first publish.
	dctx, cancel := context.WithTimeout(ctx, opTimeout)
	groups, err := adm.DescribeGroups(dctx, cfg.Group)
	cancel()
	if err != nil {
		return fmt.Errorf("describing group %q: %w", cfg.Group, err)
	}
	if g, ok := groups[cfg.Group]; ok && len(g.Members) > 0 {
		return fmt.Errorf("%w: group %q has %d members: another redrive, or a consumer, uses it (name another with --group)",
			ErrGroupInUse, cfg.Group, len(g.Members))
	}
	var next time.Time
	for {
		msgs, err := b.Peek(ctx, cfg.Destination, cfg.Group, kafkaChunk)
		if err != nil {
			if ctx.Err() != nil && errors.Is(err, context.Canceled) {
				res.Interrupted = true
				return nil
			}
			return err
		}
		if len(msgs) == 0 {
			return nil
		}
		for _, m := range msgs {
			if ctx.Err() != nil {
				res.Interrupted = true
				return nil
			}
			if cfg.Limit > 0 && res.Moved >= cfg.Limit {
				return nil
			}
			dm := driver.Message{ID: m.ID, Key: m.Key, Body: m.Body, Headers: m.Headers}
			if !cfg.Filter.Match(dm) {
				if err := commit(m); err != nil {
					return err
				}
				res.Skipped++
				bar.show(*res)
				continue
			}
			if !pace(ctx, cfg.Rate, &next) {
				res.Interrupted = true
				return nil
			}
			pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), opTimeout)
			err := b.Publish(pctx, cfg.To, redriven(dm, cfg.Destination))
			cancel()
			if err != nil {
				return fmt.Errorf("publishing %s to %s (it stays in %s): %w", m.ID, cfg.To, cfg.Destination, err)
			}
			if err := commit(m); err != nil {
				res.Moved++
				return fmt.Errorf("%w: message %s was published to %s, and a later redrive publishes it again", err, m.ID, cfg.To)
			}
			res.Moved++
			bar.show(*res)
		}
	}
}

// kafkaLeft is how many records of topic lie past group's committed
// offsets.
func kafkaLeft(ctx context.Context, adm *kadm.Client, topic, group string) (int64, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), opTimeout)
	defer cancel()
	ends, err := adm.ListEndOffsets(ctx, topic)
	if err != nil {
		return -1, err
	}
	starts, err := adm.ListStartOffsets(ctx, topic)
	if err != nil {
		return -1, err
	}
	commits, err := adm.FetchOffsets(ctx, group)
	if err != nil {
		return -1, err
	}
	var left int64
	ends.Each(func(e kadm.ListedOffset) {
		from := int64(0)
		if s, ok := starts.Lookup(topic, e.Partition); ok {
			from = s.Offset
		}
		if c, ok := commits.Lookup(topic, e.Partition); ok && c.Err == nil && c.At > from {
			from = c.At
		}
		left += max(e.Offset-from, 0)
	})
	return left, nil
}

// pace waits until the rate lets the next message go, and reports false
// when ctx ended first.
func pace(ctx context.Context, rate float64, next *time.Time) bool {
	if rate <= 0 {
		return true
	}
	if wait := time.Until(*next); wait > 0 {
		t := time.NewTimer(wait)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			return false
		}
	}
	*next = time.Now().Add(time.Duration(float64(time.Second) / rate))
	return true
}
