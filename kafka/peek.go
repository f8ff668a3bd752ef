package kafka

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
)

var _ consumer.Peeker = (*Broker)(nil)

// Peek returns up to max records of topic from the earliest each partition
// retains, oldest first by record timestamp across partitions (ties in
// partition, then offset order), without joining a consumer group and
// without committing anything ([consumer.Peeker]). It is PeekGroup with no
// group and max records of each partition, merged and cut to max. A max
// below 1 is a *[consumer.ConfigError].
func (b *Broker) Peek(ctx context.Context, topic string, max int) ([]consumer.Message, error) {
	if max < 1 {
		return nil, consumer.ConfigErrorf("max", "must be >= 1, got %d", max)
	}
	msgs, err := b.PeekGroup(ctx, topic, "", max)
	if err != nil {
		return nil, err
	}
	// PeekGroup's messages come partition by partition, each in offset
	// order: a stable sort by time keeps that order among equal times.
	slices.SortStableFunc(msgs, func(a, b consumer.Message) int { return a.PublishedAt.Compare(b.PublishedAt) })
	if len(msgs) > max {
		msgs = msgs[:max:max]
	}
	return msgs, nil
}

// PeekGroup reads records of topic without joining a consumer group and
// without committing anything, for tools that look at a topic (a
// dead-letter topic, the backlog behind a group) and must leave it as it
// is. Each partition is read from group's committed offset, or from the
// log start when group is empty or has committed nothing there, up to the
// partition's end offset at the time of the call, at most perPartition
// messages of each (every one up to the end when perPartition is 0).
// The messages come partition by partition, in offset order, as a
// consumer would see them: Lane is the partition, Offset the record's
// offset, ID the [HeaderMessageID] header (or TOPIC/PARTITION/OFFSET), and
// Headers the record's other headers. Transaction markers take offsets but
// are not messages, and do not count in perPartition.
//
// When a partition cannot be read to its end (none of those not yet read
// to their end moves for a few seconds: a stalled broker, or records past
// an open transaction when the broker's client options read committed
// records only), PeekGroup fails with an error wrapping [ErrPeekShort] rather
// than return part of the topic. A compacted topic is the exception: its
// last offsets may hold no record any more, so there what came by then is
// the answer.
func (b *Broker) PeekGroup(ctx context.Context, topic, group string, perPartition int) ([]consumer.Message, error) {
	if topic == "" {
		return nil, consumer.ConfigErrorf("topic", "must not be empty")
	}
	if perPartition < 0 {
		return nil, consumer.ConfigErrorf("perPartition", "must not be negative, got %d", perPartition)
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
	open := map[int32]*peekPart{} // the partitions not read to their end yet
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
		if at < e.Offset {
			left := perPartition
			if left == 0 {
				left = -1
			}
			open[e.Partition] = &peekPart{next: at, end: e.Offset, left: left}
		}
	})
	if ferr != nil {
		return fail("end offsets", ferr)
	}
	if len(open) == 0 {
		return nil, nil
	}
	from := make(map[int32]kgo.Offset, len(open))
	for p, pp := range open {
		from[p] = kgo.NewOffset().At(pp.next)
	}
	// Control records (transaction markers) come too: they take offsets,
	// often the last ones of a partition, and only seeing them tells that
	// the read reached its end. The options after them override the
	// user's where the user's would stall or skip a read: a fetch that
	// waits for more bytes than there are, a reset to the end.
	cl, err := kgo.NewClient(b.clientOpts(nil,
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: from}),
		kgo.KeepControlRecords(),
		kgo.FetchMinBytes(1),
		kgo.FetchMaxWait(peekFetchWait),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
	)...)
	if err != nil {
		return fail("client", err)
	}
	defer cl.Close()
	byPart := map[int32][]consumer.Message{}
	progress := time.Now() // when a partition not yet read to its end last moved
	for len(open) > 0 {
		wait := peekIdle - time.Since(progress)
		if wait <= 0 {
			// No partition still open moved for peekIdle. Retention may
			// have removed what was left of one since the offsets were
			// listed: it is read. On a compacted topic the last offsets may
			// hold no record any more (a tombstone removed): what came is
			// all there is. Elsewhere every offset holds a record, so the
			// read stopped short, and saying so beats a short answer taken
			// for the whole topic.
			if starts, err := b.adm.ListStartOffsets(ctx, topic); err == nil {
				starts.Each(func(s kadm.ListedOffset) {
					if pp := open[s.Partition]; pp != nil && s.Topic == topic && s.Err == nil && s.Offset >= pp.end {
						delete(open, s.Partition)
					}
				})
			}
			if len(open) == 0 {
				break
			}
			compacted, err := b.compacted(ctx, topic)
			if err == nil && compacted {
				break
			}
			return nil, shortPeek(topic, open, err)
		}
		pctx, cancel := context.WithTimeout(ctx, wait)
		fs := cl.PollFetches(pctx)
		cancel()
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("kafka: peek %q: %w", topic, err)
		}
		var perr error
		fs.EachError(func(_ string, _ int32, err error) {
			// Retriable errors come only with the user's
			// KeepRetryableFetchErrors; franz-go retries them all the same.
			if !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) && !kerr.IsRetriable(err) {
				perr = err
			}
		})
		if perr != nil {
			return fail("fetch", perr)
		}
		var done []int32
		fs.EachRecord(func(r *kgo.Record) {
			pp := open[r.Partition]
			if pp == nil || r.Offset < pp.next {
				return
			}
			pp.next = r.Offset + 1
			progress = time.Now()
			if r.Offset < pp.end && !r.Attrs.IsControl() {
				byPart[r.Partition] = append(byPart[r.Partition], peeked(r))
				pp.left--
			}
			if pp.next >= pp.end || pp.left == 0 {
				delete(open, r.Partition)
				done = append(done, r.Partition)
			}
		})
		if len(done) > 0 {
			// Read: fetching it on would only cost fetches.
			cl.PauseFetchPartitions(map[string][]int32{topic: done})
		}
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

// peekIdle is how long Peek waits for a partition it has not read to its
// end to move before it takes the read as stopped: done on a compacted
// topic, short ([ErrPeekShort]) on any other.
const peekIdle = 5 * time.Second

// peekFetchWait is how long a fetch of Peek's waits on the broker for
// records: well under peekIdle, so that an empty fetch is not a stall.
const peekFetchWait = time.Second

// peekPart is a partition Peek is reading.
type peekPart struct {
	next int64 // the offset after the last record read
	end  int64 // the end offset as the call began
	left int   // messages still wanted (perPartition); below 0 when all are
}

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

// compacted reports whether topic's cleanup.policy includes compact.
func (b *Broker) compacted(ctx context.Context, topic string) (bool, error) {
	rcs, err := b.adm.DescribeTopicConfigs(ctx, topic)
	if err != nil {
		return false, err
	}
	rc, err := rcs.On(topic, nil)
	if err != nil {
		return false, err
	}
	if rc.Err != nil {
		return false, rc.Err
	}
	for _, c := range rc.Configs {
		if c.Key == "cleanup.policy" {
			return strings.Contains(c.MaybeValue(), "compact"), nil
		}
	}
	return false, nil
}

// shortPeek is Peek's error for the partitions it could not read to their
// end: where each got to and where it should have, and cfgErr, when the
// topic's config (is it compacted?) could not be read.
func shortPeek(topic string, open map[int32]*peekPart, cfgErr error) error {
	var b strings.Builder
	for i, p := range slices.Sorted(maps.Keys(open)) {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "partition %d at offset %d, end %d", p, open[p].next, open[p].end)
	}
	if cfgErr != nil {
		fmt.Fprintf(&b, "; whether the topic is compacted is not known either (%v)", cfgErr)
	}
	return fmt.Errorf("kafka: peek %q: %s; nothing fetched for %s (a stalled broker, or records past an open transaction for a client that reads committed records only): %w",
		topic, b.String(), peekIdle, ErrPeekShort)
}
