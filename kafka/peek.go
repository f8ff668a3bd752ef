package kafka

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
)

// Peek reads records of topic without joining a consumer group and
// without committing anything, for tools that look at a topic (a
// dead-letter topic, the backlog behind a group) and must leave it as it
// is. Each partition is read from group's committed offset, or from the
// log start when group is empty or has committed nothing there, up to the
// partition's end offset at the time of the call, at most perPartition
// records of each (every record up to the end when perPartition is 0).
// The messages come partition by partition, in offset order, as a
// consumer would see them: Lane is the partition, Offset the record's
// offset, ID the HeaderMessageID header (or TOPIC/PARTITION/OFFSET), and
// Headers the record's other headers.
func (b *Broker) Peek(ctx context.Context, topic, group string, perPartition int) ([]consumer.Message, error) {
	if topic == "" {
		return nil, configErr("topic", "must not be empty")
	}
	if perPartition < 0 {
		return nil, configErr("perPartition", "must not be negative, got %d", perPartition)
	}
	if b.isClosed() {
		return nil, fmt.Errorf("kafka: peek %q: %w", topic, ErrClosed)
	}
	fail := func(what string, err error) ([]consumer.Message, error) {
		return nil, fmt.Errorf("kafka: peek %q: %s: %w", topic, what, wrapAuth(err))
	}
	starts, err := b.adm.ListStartOffsets(ctx, topic)
	if err != nil {
		return fail("start offsets", err)
	}
	ends, err := b.adm.ListEndOffsets(ctx, topic)
	if err != nil {
		return fail("end offsets", err)
	}
	var commits kadm.OffsetResponses
	if group != "" {
		if commits, err = b.adm.FetchOffsets(ctx, group); err != nil {
			return fail("committed offsets of group "+strconv.Quote(group), err)
		}
	}
	from := map[int32]kgo.Offset{}
	until := map[int32]int64{}
	var ferr error
	ends.Each(func(e kadm.ListedOffset) {
		if e.Topic != topic {
			return
		}
		if e.Err != nil {
			ferr = e.Err
			return
		}
		at := int64(0)
		if s, ok := starts.Lookup(topic, e.Partition); ok && s.Err == nil {
			at = s.Offset
		}
		if c, ok := commits.Lookup(topic, e.Partition); ok && c.Err == nil && c.At > at {
			at = c.At
		}
		stop := e.Offset
		if perPartition > 0 {
			stop = min(stop, at+int64(perPartition))
		}
		if at < stop {
			from[e.Partition] = kgo.NewOffset().At(at)
			until[e.Partition] = stop
		}
	})
	if ferr != nil {
		return fail("end offsets", ferr)
	}
	if len(from) == 0 {
		return nil, nil
	}
	cl, err := kgo.NewClient(b.clientOpts(kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: from}))...)
	if err != nil {
		return fail("client", err)
	}
	defer cl.Close()
	byPart := map[int32][]consumer.Message{}
	for len(until) > 0 {
		// A partition whose last offsets hold no record (transaction
		// markers) never reaches its end: a poll that brings nothing for
		// a while ends the read.
		pctx, cancel := context.WithTimeout(ctx, peekIdle)
		fs := cl.PollFetches(pctx)
		cancel()
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("kafka: peek %q: %w", topic, err)
		}
		if fs.NumRecords() == 0 && pctx.Err() != nil {
			break
		}
		var perr error
		fs.EachError(func(_ string, _ int32, err error) {
			if !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
				perr = err
			}
		})
		if perr != nil {
			return fail("fetch", perr)
		}
		fs.EachRecord(func(r *kgo.Record) {
			stop, ok := until[r.Partition]
			if !ok || r.Offset >= stop {
				return
			}
			byPart[r.Partition] = append(byPart[r.Partition], peeked(r))
			if r.Offset+1 >= stop {
				delete(until, r.Partition)
			}
		})
	}
	parts := make([]int32, 0, len(byPart))
	for p := range byPart {
		parts = append(parts, p)
	}
	slices.Sort(parts)
	var out []consumer.Message
	for _, p := range parts {
		out = append(out, byPart[p]...)
	}
	return out, nil
}

// peekIdle is how long Peek waits for a record before it takes a
// partition's read as done.
const peekIdle = 5 * time.Second

// peeked is a record as Peek returns it.
func peeked(r *kgo.Record) consumer.Message {
	lane := strconv.Itoa(int(r.Partition))
	m := consumer.Message{
		Key: string(r.Key), Body: r.Value, Source: r.Topic, Lane: lane,
		Offset: r.Offset, PublishedAt: r.Timestamp,
	}
	m.ID, m.Headers = readHeaders(r)
	if m.ID == "" {
		m.ID = r.Topic + "/" + lane + "/" + strconv.FormatInt(r.Offset, 10)
	}
	return m
}
