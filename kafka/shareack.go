package kafka

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer/driver"
)

// This file is how a share group member acknowledges records: ACCEPT and
// RELEASE for Settle, RENEW for Extend, each sent and answered before the
// call returns.
//
// The broker answers a partition's acknowledgements of one request as a
// whole: when one record among them has lost its lock (it ran out; the
// broker may have handed the record to another member), it refuses them
// all, those of records still locked too. So records whose lock may have
// run out are acknowledged apart, one request each, and the others
// together; a record whose renewal was refused is lost to this member and
// renewed no more, so that it never spoils a batch again.

// lockSlack is how close to the end of its lock, as the driver reckons it,
// a record is acknowledged apart from the others: the broker's clock and
// the request's way there make the reckoning a little late.
const lockSlack = 500 * time.Millisecond

// shareAck is one acknowledgement to send.
type shareAck struct {
	h      *shareHandle
	status kgo.AckStatus
}

// send sends acks and waits for the broker's answers, and returns, by
// handle, the error of each ack that failed. Acks of records whose lock
// may have run out go one request each; the others in one request. A
// renewal that a partition refused as a whole is sent again alone, since
// the refusal may be another record's. d.ackMu is held.
func (d *shareDriver) send(ctx context.Context, acks []shareAck) map[*shareHandle]error {
	failed := map[*shareHandle]error{}
	var sure, doubtful []shareAck
	soon := time.Now().Add(lockSlack)
	for _, a := range acks {
		if a.h.lost || a.h.lockUntil.Before(soon) {
			doubtful = append(doubtful, a)
		} else {
			sure = append(sure, a)
		}
	}
	var again []shareAck
	if len(sure) > 0 {
		for a, err := range d.flushAcks(ctx, sure) {
			// franz-go lets a refused renewal be sent again (an
			// unanswered one stays pending, and would not go).
			if a.status == kgo.AckRenew && len(sure) > 1 && !errors.Is(err, errNotAnswered) {
				again = append(again, a)
			} else {
				failed[a.h] = err
			}
		}
	}
	for _, a := range append(doubtful, again...) {
		for _, err := range d.flushAcks(ctx, []shareAck{a}) {
			failed[a.h] = err
		}
	}
	return failed
}

// flushAcks marks acks, flushes them through the client of each ack's
// session (the sessions at once) and returns the acks the broker refused
// (every ack of a partition it refused) or did not answer, with the
// error.
func (d *shareDriver) flushAcks(ctx context.Context, acks []shareAck) map[shareAck]error {
	var bySession [][]shareAck
	for _, a := range acks {
		i := slices.IndexFunc(bySession, func(g []shareAck) bool { return g[0].h.s == a.h.s })
		if i < 0 {
			bySession = append(bySession, nil)
			i = len(bySession) - 1
		}
		bySession[i] = append(bySession[i], a)
	}
	var (
		mu  sync.Mutex
		wg  sync.WaitGroup
		out = map[shareAck]error{}
	)
	for _, g := range bySession {
		wg.Go(func() {
			s := g[0].h.s
			d.beginFlush(s)
			for _, a := range g {
				a.h.rec.Ack(a.status)
			}
			fctx, cancel := context.WithTimeout(ctx, flushWithin)
			err := s.cl.FlushAcks(fctx)
			cancel()
			fails := d.endFlush(s)
			if err != nil {
				err = fmt.Errorf("%w within %s: %w", errNotAnswered, flushWithin, err)
			}
			mu.Lock()
			defer mu.Unlock()
			for _, a := range g {
				if err != nil {
					out[a] = err
				} else if rerr := refusedFor(fails, a.h.rec); rerr != nil {
					out[a] = rerr
				}
			}
		})
	}
	wg.Wait()
	return out
}

// flushWithin bounds how long a Settle or Extend waits for the broker to
// answer one request of its acknowledgements.
const flushWithin = 10 * time.Second

// Settle acknowledges: Ack is ACCEPT, Return is RELEASE (the loop returns
// records only as it stops: the broker delivers them again, to any
// member, counting one more delivery). It returns once the broker
// answered. A settlement the broker refused (the record's lock ran out,
// and the broker may have handed it to another member) fails, in a
// *[driver.SettleError], and so does one of a delivery already settled
// (Close gave it back as the Broker closed).
func (d *shareDriver) Settle(ctx context.Context, batch []driver.Settlement) error {
	var (
		acks   []shareAck
		failed []int
		why    error
	)
	// Claim the deliveries first, so that Close gives back none of them.
	d.mu.Lock()
	for i, s := range batch {
		h, _ := s.Handle.(*shareHandle)
		if h == nil || h.settled {
			failed = append(failed, i)
			why = errors.New("not a delivery this consumer holds (given back as it closed, or settled before)")
			continue
		}
		h.settled = true
		status := kgo.AckAccept
		if s.Action != driver.Ack {
			status = kgo.AckRelease
		}
		acks = append(acks, shareAck{h: h, status: status})
	}
	d.mu.Unlock()

	d.ackMu.Lock()
	for _, a := range acks {
		if a.status == kgo.AckRelease {
			d.releasing(a.h.rec)
		}
	}
	refused := d.send(ctx, acks)
	d.ackMu.Unlock()

	d.unhold(acks)

	for i, s := range batch {
		h, _ := s.Handle.(*shareHandle)
		if err, ok := refused[h]; ok && h != nil {
			failed = append(failed, i)
			why = err
		}
	}
	if len(failed) == 0 {
		return nil
	}
	slices.Sort(failed)
	return &driver.SettleError{Failed: failed, Err: fmt.Errorf("kafka: acknowledge records of %q in share group %q: %w", d.topic, d.group, why)}
}

// unhold counts the records of acks as settled in their sessions, and
// wakes Fetch when a session's records are all settled: it may poll again.
func (d *shareDriver) unhold(acks []shareAck) {
	idle := false
	d.mu.Lock()
	for _, a := range acks {
		if a.h.s.held > 0 {
			a.h.s.held--
			idle = idle || a.h.s.held == 0
		}
	}
	d.mu.Unlock()
	if idle {
		d.wakeFetch()
	}
}

// releasing warns when r goes back on the last delivery the group allows:
// the broker archives it instead of delivering it again.
func (d *shareDriver) releasing(r *kgo.Record) {
	limit := d.limit.Load()
	if limit <= 0 || r.DeliveryCount() < limit {
		return
	}
	to := "dropped: the group has no errors.deadletterqueue.topic.name"
	if t := d.deadTo.Load(); t != nil && *t != "" {
		to = "moved to the group's dead-letter topic " + *t
	}
	if ok, left := d.warns.Allow("last delivery"); ok {
		d.log.Warn("ferry/kafka: a record given back on its last delivery is archived by the broker, not delivered again",
			"partition", r.Partition, "offset", r.Offset, "deliveries", r.DeliveryCount(), "limit", limit, "archived", to, "unlogged", left)
	}
}

// Lease is the record lock the group gives, as the last poll showed it
// (as Connect read it before the first poll; [driver.MinLease] until
// then).
func (d *shareDriver) Lease() time.Duration { return time.Duration(d.lease.Load()) }

// Extend renews the locks of the records behind handles (RENEW, KIP-1222),
// and of the records of the last poll the loop has not taken yet whose
// lock is a third gone: each gets the group's lock afresh, whatever d is.
// A record whose renewal the broker refused lost its lock (it ran out, and
// the broker may hand the record to another member): Extend logs it at
// WARN, fails, and renews it no more.
func (d *shareDriver) Extend(ctx context.Context, handles []any, _ time.Duration) error {
	lease := d.Lease()
	var acks []shareAck
	d.mu.Lock()
	for _, x := range handles {
		if h, ok := x.(*shareHandle); ok && !h.settled {
			acks = append(acks, shareAck{h: h, status: kgo.AckRenew})
		}
	}
	stashed := slices.Clone(d.stash)
	d.mu.Unlock()

	d.ackMu.Lock()
	defer d.ackMu.Unlock()
	// A stashed record goes once a third of its lock is gone, as the
	// loop's own do; a lost record goes no more.
	renewBy := time.Now().Add(lease * 2 / 3)
	for _, h := range stashed {
		if h.lockUntil.Before(renewBy) {
			acks = append(acks, shareAck{h: h, status: kgo.AckRenew})
		}
	}
	acks = slices.DeleteFunc(acks, func(a shareAck) bool { return a.h.lost })
	if len(acks) == 0 {
		return nil
	}
	// The broker renews a lock when the renewal reaches it: reckoned
	// from before it went, never after the lock really ends (the answer
	// may take up to flushWithin).
	sent := time.Now()
	refused := d.send(ctx, acks)
	var lost int
	var why error
	for _, a := range acks {
		err, ok := refused[a.h]
		if !ok {
			a.h.lockUntil = sent.Add(lease)
			continue
		}
		why = err
		if errors.Is(err, errNotAnswered) {
			continue // tried again at the loop's next round
		}
		a.h.lost = true
		lost++
		if ok, left := d.warns.Allow("lock lost"); ok {
			d.log.Warn("ferry/kafka: a record lost its lock before its handler finished; the broker may hand it to another member, and its acknowledgement will fail",
				"partition", a.h.rec.Partition, "offset", a.h.rec.Offset, "err", err, "unlogged", left)
		}
	}
	if why != nil {
		return fmt.Errorf("kafka: renew the locks of %d record(s) of %q in share group %q (%d lost): %w", len(refused), d.topic, d.group, lost, why)
	}
	return nil
}

// freshen readies stashed records for the loop, which reckons a lease
// from when it takes a record: a record whose lock is a third gone is
// renewed first, and one whose renewal is refused (its lock ran out while
// it waited here: the broker may have handed it to another member) is
// released, dropped, and counted as settled. One whose renewal was not
// answered goes to the loop.
func (d *shareDriver) freshen(ctx context.Context, hs []*shareHandle) []*shareHandle {
	d.ackMu.Lock()
	defer d.ackMu.Unlock()
	lease := d.Lease()
	renewBy := time.Now().Add(lease * 2 / 3)
	var acks []shareAck
	for _, h := range hs {
		if h.lost || h.lockUntil.Before(renewBy) {
			acks = append(acks, shareAck{h: h, status: kgo.AckRenew})
		}
	}
	if len(acks) == 0 {
		return hs
	}
	// The broker renews a lock when the renewal reaches it: reckoned
	// from before it went, never after the lock really ends (the answer
	// may take up to flushWithin).
	sent := time.Now()
	refused := d.send(ctx, acks)
	var (
		gone     []*shareHandle
		releases []shareAck
	)
	for _, a := range acks {
		err, ok := refused[a.h]
		switch {
		case !ok:
			a.h.lockUntil = sent.Add(lease)
		case errors.Is(err, errNotAnswered):
			// The record may still be locked: the loop takes it, and
			// its renewals go on from there.
		default:
			gone = append(gone, a.h)
			releases = append(releases, shareAck{h: a.h, status: kgo.AckRelease})
		}
	}
	if len(gone) == 0 {
		return hs
	}
	if ok, left := d.warns.Allow("lock lost"); ok {
		d.log.Warn("ferry/kafka: records lost their locks while they waited for room in the consumer; the broker delivers them again",
			"count", len(gone), "unlogged", left)
	}
	// A dropped record must have a final acknowledgement before its
	// session polls again, or franz-go accepts it then: the release goes
	// now (the broker refuses it, the lock being gone; that is all).
	d.flushAcks(ctx, releases)
	d.mu.Lock()
	var dropped []shareAck
	for _, h := range gone {
		if !h.settled {
			h.settled = true
			dropped = append(dropped, shareAck{h: h})
		}
	}
	d.mu.Unlock()
	d.unhold(dropped)
	return slices.DeleteFunc(hs, func(h *shareHandle) bool { return slices.Contains(gone, h) })
}

// errNotAnswered is why an acknowledgement failed when the broker did not
// answer it (the request timed out, the client closed): the record may
// still be locked.
var errNotAnswered = errors.New("the broker did not answer")

// acked is franz-go's ShareAckCallback of session s: it keeps what the
// broker refused, for the flush of s under way (FlushAcks returns after
// the callbacks of what it sent), and logs a refusal of acknowledgements
// no flush waits for (those Close sends, and a poll's acknowledgement of
// records freshen dropped).
func (d *shareDriver) acked(s *shareSession, rs kgo.ShareAckResults) {
	d.failsMu.Lock()
	defer d.failsMu.Unlock()
	for _, r := range rs {
		if r.Err == nil || r.Topic != d.topic {
			continue
		}
		if fails, ok := d.flushing[s]; ok {
			d.flushing[s] = append(fails, r)
		} else if ok, left := d.warns.Allow("shareAck refused"); ok {
			d.log.Warn("ferry/kafka: the broker refused acknowledgements; their records are delivered again when their locks run out",
				"partition", r.Partition, "err", r.Err, "unlogged", left)
		}
	}
}

// beginFlush forgets earlier refusals of s, as a flush of s begins.
func (d *shareDriver) beginFlush(s *shareSession) {
	d.failsMu.Lock()
	d.flushing[s] = []kgo.ShareAckResult{}
	d.failsMu.Unlock()
}

// endFlush returns the refusals of s since beginFlush, as its flush ends.
func (d *shareDriver) endFlush(s *shareSession) []kgo.ShareAckResult {
	d.failsMu.Lock()
	defer d.failsMu.Unlock()
	fails := d.flushing[s]
	delete(d.flushing, s)
	return fails
}

// refusedFor is the error the broker gave for r's partition, if any.
func refusedFor(fails []kgo.ShareAckResult, r *kgo.Record) error {
	for _, f := range fails {
		if f.Partition == r.Partition {
			return fmt.Errorf("partition %d: %w", f.Partition, f.Err)
		}
	}
	return nil
}
