package memory

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"sync"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
)

// memDriver is the driver.Driver over one queue. Fetch is never called
// concurrently with itself (the driver contract), so the scratch slices and
// the timer belong to the Fetch in progress.
type memDriver struct {
	q         *queue
	done      chan struct{}
	closeOnce sync.Once

	picked []picked
	dead   []*entry
	timer  *time.Timer
}

// picked is what Fetch read from an entry under the lock.
type picked struct {
	r        *receipt
	id, key  string
	body     []byte
	headers  map[string]string
	pub      int64
	receives int32
	known    *driver.History
}

var (
	_ driver.Driver      = (*memDriver)(nil)
	_ driver.Extender    = (*memDriver)(nil)
	_ driver.Connector   = (*memDriver)(nil)
	_ driver.LagReporter = (*memDriver)(nil)
	_ driver.Aser        = (*memDriver)(nil)
)

func (d *memDriver) closedErr(op string) error {
	select {
	case <-d.q.b.closed:
	case <-d.done:
	default:
		return nil
	}
	return fmt.Errorf("memory: %s %q: %w", op, d.q.name, ErrClosed)
}

// Fetch appends up to max deliveries to dst. It waits until at least one
// message is visible, ctx ends, or the broker or driver is closed (an error
// wrapping ErrClosed, marked driver.Fatal).
// Connect answers at once: the queue is in this process and was found (or
// made) when the driver was built. A closed broker is fatal.
func (d *memDriver) Connect(context.Context) error {
	if err := d.closedErr("connect"); err != nil {
		return driver.Fatal(err)
	}
	return nil
}

func (d *memDriver) Fetch(ctx context.Context, dst []driver.Message, max int) ([]driver.Message, error) {
	q := d.q
	if max <= 0 {
		max = 1
	}
	for {
		if err := d.closedErr("fetch"); err != nil {
			return dst, driver.Fatal(err)
		}
		if err := ctx.Err(); err != nil {
			return dst, err
		}

		q.mu.Lock()
		now := q.b.now()
		q.advance(now)
		ps, dead := d.picked[:0], d.dead[:0]
		bodies := 0
		for len(ps) < max {
			e := q.popVisible()
			if e == nil {
				break
			}
			if q.cfg.MaxReceiveCount > 0 && int(e.receives) >= q.cfg.MaxReceiveCount {
				dead = append(dead, q.deadLetter(e))
				q.remove(e)
				q.deadLettered++
				continue
			}
			r := q.deliver(e, now)
			bodies += len(e.body)
			ps = append(ps, picked{r: r, id: e.id, key: e.key, body: e.body, headers: e.headers, pub: e.pub, receives: e.receives, known: e.known})
		}
		var wake <-chan struct{}
		var sleep int64 = -1
		if len(ps) == 0 && len(dead) == 0 {
			q.waiting++
			wake = q.wake
			if len(q.heap) > 0 {
				due := q.heap[0].due
				sleep = due - now
				q.sleepUntil = min(q.sleepUntil, due)
			}
		} else {
			// Deliveries add deadlines; dead-lettering may unblock a group.
			q.notify()
		}
		if len(dead) > 0 {
			// Moved while the source is still locked, so that two fetches
			// dead-lettering one group's messages keep their order in the
			// dead-letter queue. Locks go source, then dead-letter queue;
			// CreateQueue refuses cycles, so no fetch takes them the other way.
			dlq := q.dlq
			dlq.mu.Lock()
			dnow := q.b.now()
			for _, e := range dead {
				dlq.enqueue(e, dnow)
			}
			dlq.notify()
			dlq.mu.Unlock()
			clear(dead)
			d.dead = dead[:0]
		}
		q.mu.Unlock()

		if len(ps) > 0 {
			var arena []byte
			if bodies > 0 {
				arena = make([]byte, bodies)
			}
			lane := ""
			for i := range ps {
				p := &ps[i]
				m := driver.Message{
					ID:          p.id,
					Key:         p.key,
					Source:      q.name,
					Offset:      -1,
					Deliveries:  int(p.receives),
					PublishedAt: time.Unix(0, p.pub),
					Handle:      p.r,
				}
				if p.known != nil {
					m.Known = *p.known
				}
				if q.cfg.FIFO {
					lane = p.key
				}
				m.Lane = lane
				if p.body != nil {
					n := copy(arena, p.body)
					m.Body = arena[:n:n]
					arena = arena[n:]
				}
				if p.headers != nil {
					m.Headers = maps.Clone(p.headers)
				}
				dst = append(dst, m)
			}
			clear(ps)
			d.picked = ps[:0]
			return dst, nil
		}
		d.picked = ps[:0]
		if wake == nil {
			continue // only dead-lettered; look again
		}

		var timeout <-chan time.Time
		if sleep >= 0 {
			if d.timer == nil {
				d.timer = time.NewTimer(time.Duration(sleep))
			} else {
				d.timer.Reset(time.Duration(sleep))
			}
			timeout = d.timer.C
		}
		var err error
		woken := false
		select {
		case <-wake:
			woken = true
		case <-timeout:
		case <-ctx.Done():
			err = ctx.Err()
		case <-q.b.closed:
		case <-d.done:
		}
		if d.timer != nil {
			d.timer.Stop()
		}
		q.mu.Lock()
		q.leave(woken)
		q.mu.Unlock()
		if err != nil {
			return dst, err
		}
	}
}

// Settle acks or returns each delivery, under one lock for the batch. A
// handle whose lease ran out, or that was settled already, is skipped; so is
// one that did not come from this queue. The rest of the batch is applied,
// and the skipped ones are reported in a *driver.SettleError wrapping
// ErrStaleHandle or ErrInvalidHandle. A return keeps the consumer's count of
// the message's runs (Settlement.History) with the message, to hand back on
// its next delivery. Settle does not block, so ctx is not consulted.
func (d *memDriver) Settle(_ context.Context, batch []driver.Settlement) error {
	if err := d.closedErr("settle"); err != nil {
		return err
	}
	q := d.q
	var stale, invalid []int
	q.mu.Lock()
	now := q.b.now()
	for i := range batch {
		s := &batch[i]
		r, ok := s.Handle.(*receipt)
		if !ok || r == nil || r.e.q != q {
			invalid = append(invalid, i)
			continue
		}
		if !q.valid(r, now) {
			stale = append(stale, i)
			continue
		}
		switch s.Action {
		case driver.Ack:
			q.remove(r.e)
			q.acked++
		default:
			if s.History.Deliveries > 0 {
				h := s.History
				r.e.known = &h
			}
			q.ret(r.e, int64(s.Delay), now)
		}
	}
	q.notify()
	q.mu.Unlock()
	if err := handleErr("settle", q.name, len(batch), len(stale), len(invalid)); err != nil {
		return &driver.SettleError{Failed: append(stale, invalid...), Err: err}
	}
	return nil
}

func handleErr(op, queue string, n, stale, invalid int) error {
	var errs []error
	if stale > 0 {
		errs = append(errs, fmt.Errorf("memory: %s on %q: %d of %d deliveries: %w", op, queue, stale, n, ErrStaleHandle))
	}
	if invalid > 0 {
		errs = append(errs, fmt.Errorf("memory: %s on %q: %d of %d handles: %w", op, queue, invalid, n, ErrInvalidHandle))
	}
	return errors.Join(errs...)
}

// Capabilities reports that the queue redelivers returned messages, and
// names the system in traces "ferry_memory".
func (d *memDriver) Capabilities() driver.Capabilities {
	return driver.Capabilities{Redelivers: true, System: MessagingSystem, Source: d.q.name}
}

// As serves consumer.Message.As: a *Delivery target gets the delivery as
// the queue sees it.
func (d *memDriver) As(handle, target any) bool {
	r, ok := handle.(*receipt)
	t, ok2 := target.(*Delivery)
	if !ok || !ok2 || r == nil {
		return false
	}
	q := d.q
	q.mu.Lock()
	defer q.mu.Unlock()
	e := r.e
	*t = Delivery{Queue: q.name, MessageID: e.id, ReceiveCount: int(e.receives), Current: q.valid(r, q.b.now())}
	if q.cfg.FIFO {
		t.Group = e.key
	}
	return true
}

// Lease is the queue's visibility timeout.
func (d *memDriver) Lease() time.Duration { return d.q.cfg.VisibilityTimeout }

// Extend gives each delivery a lease of dur from now. Handles whose lease
// already ran out are reported with an error wrapping ErrStaleHandle; the
// others are extended.
func (d *memDriver) Extend(_ context.Context, handles []any, dur time.Duration) error {
	if err := d.closedErr("extend"); err != nil {
		return err
	}
	q := d.q
	var stale, invalid int
	q.mu.Lock()
	now := q.b.now()
	for _, h := range handles {
		r, ok := h.(*receipt)
		if !ok || r == nil || r.e.q != q {
			invalid++
			continue
		}
		if !q.valid(r, now) {
			stale++
			continue
		}
		r.e.due = now + int64(dur)
		q.heapFix(r.e)
	}
	q.notify()
	q.mu.Unlock()
	return handleErr("extend", q.name, len(handles), stale, invalid)
}

// Lag reports the queue's depth: Messages counts visible and delayed
// messages (Delayed the latter), InFlight those fetched and not settled, and OldestAge is how long
// the oldest message not yet acked has been in the queue.
func (d *memDriver) Lag(ctx context.Context) (driver.Lag, error) {
	if err := ctx.Err(); err != nil {
		return driver.Lag{}, err
	}
	q := d.q
	q.mu.Lock()
	defer q.mu.Unlock()
	now := q.b.now()
	q.advance(now)
	q.notify()
	q.trimOrder()
	l := driver.Lag{Messages: q.visible + q.delayed, Delayed: q.delayed, InFlight: q.inflight}
	if q.order.len() > 0 {
		l.OldestAge = time.Duration(now - q.order.front().enq)
	}
	return l, nil
}

// Close ends this driver: a Fetch waiting on it returns, and later calls
// fail with ErrClosed. The broker and its queues stay; messages this driver
// fetched and did not settle are delivered again when their lease runs out.
func (d *memDriver) Close() error {
	d.closeOnce.Do(func() { close(d.done) })
	return nil
}
