package memory

import (
	"context"
	"fmt"
	"maps"
	"strconv"
	"time"

	"github.com/ferrymq/ferry/consumer"
)

// Publish adds msgs to the queue named destination, in order. It copies Body
// and Headers, so the caller may reuse them; gives each message with an
// empty ID a unique one; and sets the time it was published. Once it returns
// nil the messages can be fetched (those with a NotBefore ahead, from then).
//
// On a FIFO queue, Key is the message group and must not be empty, and a
// message whose ID the queue took within the deduplication window is
// dropped (Publish still succeeds, as on SQS). Messages the queue cannot take
// are reported in a *consumer.PublishError wrapping ErrInvalidMessage (or
// consumer.ErrDelayNotSupported, below), with the later messages of their
// key in the call, unsent, wrapping ErrNotSent; the others are published.
//
// A message whose NotBefore is still ahead is held until then, however
// far: no consumer receives it before (on a standard queue; a FIFO queue
// refuses it with consumer.ErrDelayNotSupported, as SQS does).
func (b *Broker) Publish(ctx context.Context, destination string, msgs ...consumer.Message) error {
	start := time.Now()
	err := b.publish(ctx, destination, msgs)
	b.metrics.Record(ctx, destination, len(msgs), start, err)
	return err
}

func (b *Broker) publish(ctx context.Context, destination string, msgs []consumer.Message) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if b.isClosed() {
		return fmt.Errorf("memory: publish to %q: %w", destination, ErrClosed)
	}
	q, err := b.queue(destination)
	if err != nil {
		return err
	}
	if len(msgs) == 0 {
		return nil
	}

	// Build the entries outside the lock: one slice of entries, one buffer
	// for all bodies and one string for all new IDs per call.
	var (
		perr        *consumer.PublishError
		refusedKeys map[string]bool // keys with a refused message: their later ones are not sent
	)
	refuse := func(i int, err error) {
		if perr == nil {
			perr = &consumer.PublishError{}
		}
		perr.Failed = append(perr.Failed, consumer.FailedMessage{Index: i, Err: err})
		if k := msgs[i].Key; k != "" {
			if refusedKeys == nil {
				refusedKeys = make(map[string]bool)
			}
			refusedKeys[k] = true
		}
	}
	bodies, newIDs, delayed := 0, 0, false
	wall := time.Now()
	for i := range msgs {
		bodies += len(msgs[i].Body)
		if msgs[i].ID == "" {
			newIDs++
		}
		switch {
		case msgs[i].Key != "" && refusedKeys[msgs[i].Key]:
			refuse(i, fmt.Errorf("publish to %q: %w", destination, ErrNotSent))
		case q.cfg.FIFO && msgs[i].Key == "":
			refuse(i, fmt.Errorf("%w: Key (the message group) must not be empty on FIFO queue %q", ErrInvalidMessage, destination))
		case !msgs[i].NotBefore.After(wall):
		case q.cfg.FIFO:
			// As on SQS: a FIFO queue delays a whole queue, not a message.
			refuse(i, fmt.Errorf("memory: NotBefore on FIFO queue %q: %w", destination, consumer.ErrDelayNotSupported))
		default:
			delayed = true
		}
	}
	var ids string
	var idEnds []int
	if newIDs > 0 {
		last := b.idSeq.Add(uint64(newIDs))
		buf := make([]byte, 0, newIDs*(len(b.idPrefix)+8))
		idEnds = make([]int, 0, newIDs)
		for n := last - uint64(newIDs) + 1; n <= last; n++ {
			buf = append(buf, b.idPrefix...)
			buf = strconv.AppendUint(buf, n, 10)
			idEnds = append(idEnds, len(buf))
		}
		ids = string(buf)
	}
	ents := make([]entry, len(msgs))
	var arena []byte
	if bodies > 0 {
		arena = make([]byte, bodies)
	}
	pub := time.Now().UnixNano()
	idStart, idn := 0, 0
	for i := range msgs {
		m, e := &msgs[i], &ents[i]
		e.id, e.key, e.pub = m.ID, m.Key, pub
		if e.id == "" {
			e.id = ids[idStart:idEnds[idn]]
			idStart = idEnds[idn]
			idn++
		}
		if m.Body != nil {
			n := copy(arena, m.Body)
			e.body = arena[:n:n]
			arena = arena[n:]
		}
		if m.Headers != nil {
			e.headers = maps.Clone(m.Headers)
		}
	}

	q.mu.Lock()
	now := b.now()
	dedup := q.cfg.FIFO && b.dedupWindow > 0
	f := 0
	for i := range ents {
		if perr != nil && f < len(perr.Failed) && perr.Failed[f].Index == i {
			f++
			continue
		}
		if dedup && msgs[i].ID != "" && q.isDuplicate(msgs[i].ID, now) {
			continue
		}
		if delayed {
			if d := msgs[i].NotBefore.Sub(wall); d > 0 {
				q.enqueueDelayed(&ents[i], now, int64(d))
				continue
			}
		}
		q.enqueue(&ents[i], now)
	}
	q.notify()
	q.mu.Unlock()
	if perr != nil {
		return perr
	}
	return nil
}
