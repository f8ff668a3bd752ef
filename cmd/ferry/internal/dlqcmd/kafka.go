package dlqcmd

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/kafka"
)

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
//
// A record that names no source stops its partition there: committing
// past it would pass it over for good (the next redrive of the group
// starts past it), so the group's offset stays before it and the rest of
// that partition waits for a run that says where it goes (--to).
func redriveKafka(ctx context.Context, b *kafka.Broker, cfg RedriveConfig, rt *router, res *Result, bar *progress) error {
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
	stopped := map[string]bool{} // partitions stopped at a record that names no source
	for {
		msgs, err := b.PeekGroup(ctx, cfg.Destination, cfg.Group, kafkaChunk)
		if err != nil {
			if ctx.Err() != nil && errors.Is(err, context.Canceled) {
				res.Interrupted = true
				return nil
			}
			return err
		}
		read := 0
		for _, m := range msgs {
			if stopped[m.Lane] {
				continue
			}
			read++
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
			src, to, err := rt.route(ctx, dm)
			if err != nil {
				return err
			}
			if to == "" {
				stopped[m.Lane] = true
				res.Unrouted++
				res.Stopped = append(res.Stopped, fmt.Sprintf(
					"partition %s of %s stopped at offset %d: that record names no source (no %s header, or %s itself); the group's offset stays before it, and a run with --to SOURCE moves it and the rest of the partition",
					m.Lane, cfg.Destination, m.Offset, consumer.HeaderDLQSource, cfg.Destination))
				bar.show(*res)
				continue
			}
			if !pace(ctx, cfg.Rate, &next) {
				res.Interrupted = true
				return nil
			}
			pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), opTimeout)
			err = b.Publish(pctx, to, redriven(dm, cfg.Destination))
			cancel()
			if err != nil {
				return fmt.Errorf("publishing %s to %s (it stays in %s): %w", m.ID, src, cfg.Destination, err)
			}
			if err := commit(m); err != nil {
				res.Moved++
				res.To[src]++
				return fmt.Errorf("%w: message %s was published to %s, and a later redrive publishes it again", err, m.ID, src)
			}
			res.Moved++
			res.To[src]++
			bar.show(*res)
		}
		if read == 0 {
			return nil
		}
	}
}

// partRange is where a read of one partition begins and ends.
type partRange struct {
	partition int32
	from, end int64 // the first offset to read, and the end offset
}

// kafkaRanges is, per partition of topic, where a read past group's
// committed offsets begins (the log start where it committed nothing, or
// for group "") and the end offset.
func kafkaRanges(ctx context.Context, adm *kadm.Client, topic, group string) ([]partRange, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), opTimeout)
	defer cancel()
	ends, err := adm.ListEndOffsets(ctx, topic)
	if err != nil {
		return nil, err
	}
	starts, err := adm.ListStartOffsets(ctx, topic)
	if err != nil {
		return nil, err
	}
	var commits kadm.OffsetResponses
	if group != "" {
		if commits, err = adm.FetchOffsets(ctx, group); err != nil {
			return nil, err
		}
	}
	var out []partRange
	var lerr error
	ends.Each(func(e kadm.ListedOffset) {
		if e.Topic != topic {
			return
		}
		if e.Err != nil {
			lerr = e.Err
			return
		}
		from := int64(0)
		if s, ok := starts.Lookup(topic, e.Partition); ok && s.Err == nil {
			from = s.Offset
		}
		if c, ok := commits.Lookup(topic, e.Partition); ok && c.Err == nil && c.At > from {
			from = c.At
		}
		out = append(out, partRange{partition: e.Partition, from: min(from, e.Offset), end: e.Offset})
	})
	if lerr != nil {
		return nil, lerr
	}
	slices.SortFunc(out, func(a, b partRange) int { return int(a.partition - b.partition) })
	return out, nil
}

// kafkaLeft is how many records of topic lie past group's committed
// offsets, by their offsets.
func kafkaLeft(ctx context.Context, adm *kadm.Client, topic, group string) Count {
	rs, err := kafkaRanges(ctx, adm, topic, group)
	if err != nil {
		return unknown("asking Kafka for the offsets failed: " + ferry.Redact(err.Error()))
	}
	var n int64
	for _, r := range rs {
		n += r.end - r.from
	}
	return Count{N: n}
}

// hasCommits reports whether group committed an offset on topic.
func hasCommits(ctx context.Context, adm *kadm.Client, topic, group string) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	commits, err := adm.FetchOffsets(ctx, group)
	if err != nil {
		return false, err
	}
	found := false
	commits.Each(func(c kadm.OffsetResponse) {
		if c.Topic == topic && c.Err == nil && c.At >= 0 {
			found = true
		}
	})
	return found, nil
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
