package sqs

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/ferrymq/ferry/consumer"
)

// Publish sends msgs to the queue named by destination (a name or a queue
// URL) with SendMessageBatch: up to ten messages a call and at most
// [MaxBatchSize] bytes, several calls at once ([WithPublishConcurrency]). It
// returns nil only once SQS took every message.
//
// Each message is checked before any call: one larger than the queue's
// MaximumMessageSize fails with [ErrMessageTooLarge], one without a Key on
// a FIFO queue with [ErrInvalidMessage], and one whose NotBefore SQS cannot
// keep (further than [MaxDelay], or on a FIFO queue) with
// [consumer.ErrDelayTooLong] or [consumer.ErrDelayNotSupported]; none of
// them is sent, and the others are. A NotBefore still ahead is sent as the
// message's DelaySeconds, rounded up to whole seconds; it replaces the
// queue's own DelaySeconds for that message (a NotBefore nearer than the
// queue's delay shortens it), while a message without one keeps the
// queue's.
// On a FIFO queue the Key is the message group and the ID the deduplication
// id (a message without an ID gets a random one, unless the queue
// deduplicates by content). Headers, the key and bodies that are not SQS
// text travel as the package documentation describes.
//
// Messages of one key go in the order given, never two of them in one
// SendMessageBatch: a key's later message is sent only once its earlier
// one was taken, in a later batch shared with other keys. When a message fails, the later messages of its
// key in the call are not sent and fail with ErrNotSent. Failures are
// reported in a *[consumer.PublishError], by index in msgs, each an
// *EntryError for an entry SQS refused, or the call's error (or, for an
// entry the answer names neither successful nor failed, an error that
// says so: it is not taken for sent); errors.As reaches the typed AWS
// errors inside.
func (b *Broker) Publish(ctx context.Context, destination string, msgs ...consumer.Message) error {
	start := time.Now()
	err := b.publish(ctx, destination, msgs)
	if len(msgs) > 0 {
		b.metrics.Record(ctx, destination, len(msgs), start, err)
	}
	return err
}

func (b *Broker) publish(ctx context.Context, destination string, msgs []consumer.Message) error {
	if b.isClosed() {
		return fmt.Errorf("sqs: publish to %q: %w", destination, ErrClosed)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if len(msgs) == 0 {
		return nil
	}
	q, err := b.resolve(ctx, destination)
	if err != nil {
		return err
	}
	p := &publish{b: b, q: q, dest: destination, failedKeys: make(map[string]bool)}
	outs := make([]outgoing, 0, len(msgs))
	now := time.Now()
	for i := range msgs {
		m := &msgs[i]
		if m.Key != "" && p.failedKeys[m.Key] {
			p.fail(i, m.Key, ErrNotSent)
			continue
		}
		o, err := encode(q, m, b.cfg.fairQueues)
		if err != nil {
			p.fail(i, m.Key, err)
			continue
		}
		delay, err := delaySeconds(q, m, now)
		if err != nil {
			p.fail(i, m.Key, err)
			continue
		}
		o.entry.DelaySeconds = delay
		o.index = i
		outs = append(outs, o)
	}
	p.send(ctx, plan(outs))
	if len(p.failed) == 0 {
		return nil
	}
	slices.SortFunc(p.failed, func(a, b consumer.FailedMessage) int { return a.Index - b.Index })
	return &consumer.PublishError{Failed: p.failed}
}

// MaxDelay is the longest SQS holds a message before any consumer may
// receive it (DelaySeconds).
const MaxDelay = 15 * time.Minute

// delaySeconds is the DelaySeconds of m: the time to its NotBefore, rounded
// up to whole seconds (a message is never delivered early), or none when
// it has passed. A FIFO queue cannot delay a message of its own, and SQS
// cannot hold one beyond MaxDelay: both are refused, not sent at once.
func delaySeconds(q *queueInfo, m *consumer.Message, now time.Time) (int32, error) {
	d := m.NotBefore.Sub(now)
	switch {
	case m.NotBefore.IsZero() || d <= 0:
		return 0, nil
	case q.fifo:
		return 0, fmt.Errorf("sqs: NotBefore on FIFO queue %q (a FIFO queue delays the whole queue, not a message): %w", q.name, consumer.ErrDelayNotSupported)
	case d > MaxDelay:
		return 0, fmt.Errorf("sqs: NotBefore %s away, beyond the %s SQS can hold a message (DelaySeconds): %w", d.Round(time.Second), MaxDelay, consumer.ErrDelayTooLong)
	}
	return int32(min((d+time.Second-1)/time.Second, MaxDelay/time.Second)), nil
}

// publish is the state of one Publish call.
type publish struct {
	b    *Broker
	q    *queueInfo
	dest string // as the caller named the queue

	mu         sync.Mutex
	failed     []consumer.FailedMessage
	failedKeys map[string]bool
}

func (p *publish) fail(index int, key string, err error) {
	p.failed = append(p.failed, consumer.FailedMessage{Index: index, Err: err})
	if key != "" {
		p.failedKeys[key] = true
	}
}

// batch is one SendMessageBatch, and the earlier batches that hold a key
// it holds too.
type batch struct {
	outs []outgoing
	size int
	deps []int
	done chan struct{}
}

// plan packs messages, in order, into batches of at most [MaxBatch] entries
// and [MaxBatchSize] bytes, never two messages of one key in one batch: a
// key's later message goes in a later batch than its earlier one, which
// send sends only after the earlier one's batch answered (and sendBatch
// holds it back when that one failed). Messages of different keys share
// batches, so batches stay full. Each batch is linked to the last earlier
// one of each key it carries.
func plan(outs []outgoing) []*batch {
	var bs []*batch
	last := make(map[string]int) // key -> batch of its latest message
	open := 0                    // batches before this one are full by count
	for _, o := range outs {
		from := open
		if o.key != "" {
			if j, ok := last[o.key]; ok && j+1 > from {
				from = j + 1
			}
		}
		i := from
		for ; i < len(bs); i++ {
			if len(bs[i].outs) < MaxBatch && bs[i].size+o.size <= MaxBatchSize {
				break
			}
		}
		if i == len(bs) {
			bs = append(bs, &batch{done: make(chan struct{})})
		}
		b := bs[i]
		if o.key != "" {
			if j, ok := last[o.key]; ok && !slices.Contains(b.deps, j) {
				b.deps = append(b.deps, j)
			}
			last[o.key] = i
		}
		b.outs = append(b.outs, o)
		b.size += o.size
		for open < len(bs) && len(bs[open].outs) == MaxBatch {
			open++
		}
	}
	return bs
}

// send sends the batches, at most the broker's publish concurrency at
// once, each after the batches it depends on.
func (p *publish) send(ctx context.Context, bs []*batch) {
	if len(bs) == 1 {
		p.sendBatch(ctx, bs[0])
		close(bs[0].done)
		return
	}
	sem := make(chan struct{}, p.b.cfg.publishParallel)
	var wg sync.WaitGroup
	for _, b := range bs {
		for _, j := range b.deps {
			<-bs[j].done
		}
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { close(b.done); <-sem; wg.Done() }()
			p.sendBatch(ctx, b)
		}()
	}
	wg.Wait()
}

func (p *publish) sendBatch(ctx context.Context, b *batch) {
	const op = "SendMessageBatch"
	entries := make([]types.SendMessageBatchRequestEntry, 0, len(b.outs))
	byID := make(map[string]outgoing, len(b.outs))
	p.mu.Lock()
	for _, o := range b.outs {
		if o.key != "" && p.failedKeys[o.key] {
			p.fail(o.index, o.key, ErrNotSent)
			continue
		}
		id := strconv.Itoa(o.index)
		e := o.entry
		e.Id = aws.String(id)
		entries = append(entries, e)
		byID[id] = o
	}
	p.mu.Unlock()
	if len(entries) == 0 {
		return
	}
	out, err := p.b.client.SendMessageBatch(ctx, &awssqs.SendMessageBatchInput{QueueUrl: aws.String(p.q.url), Entries: entries})
	p.mu.Lock()
	defer p.mu.Unlock()
	if err != nil {
		if isQueueGone(err) {
			p.b.forget(p.dest)
		}
		err = p.b.callErr(op, p.q.name, err, nil)
		for _, e := range entries {
			o := byID[*e.Id]
			p.fail(o.index, o.key, err)
		}
		return
	}
	for _, f := range out.Failed {
		o, ok := byID[aws.ToString(f.Id)]
		if !ok {
			continue
		}
		delete(byID, aws.ToString(f.Id))
		p.fail(o.index, o.key, entryError(op, p.q.name, f))
	}
	for _, r := range out.Successful {
		delete(byID, aws.ToString(r.Id))
	}
	// An entry the answer names neither way was not confirmed taken: it
	// fails rather than pass for sent (the caller publishes it again).
	for _, e := range entries {
		if o, ok := byID[*e.Id]; ok {
			p.fail(o.index, o.key, fmt.Errorf("sqs: %s to queue %q: the answer names entry %s neither successful nor failed: %w", op, p.q.name, *e.Id, errUnconfirmed))
		}
	}
}

// errUnconfirmed is the error of a message a SendMessageBatch answer did
// not say it took.
var errUnconfirmed = errors.New("not confirmed")
