package consumer

import (
	"context"
	"math/rand/v2"
	"runtime/debug"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
)

// This file holds the goroutines around the dispatcher: the fetcher, the
// workers and the I/O goroutine. None of them touches a delivery's state
// while the dispatcher owns it; they hand deliveries over on channels.

// worker runs handlers.
func (r *run) worker() {
	atMostOnce := r.l.cfg.mode == AtMostOnce
	for d := range r.work {
		switch {
		case atMostOnce:
			// Already acked: it runs whatever happens, or it is lost.
			d.err = r.call(d)
		case r.stopping.Load():
			// Shutdown began while it sat in the work queue: do not start it.
			d.err = errNotStarted
		case d.ctx.Err() != nil:
			// Its lane was revoked while it queued: do not start it.
			d.err = d.ctx.Err()
		default:
			d.err = r.call(d)
		}
		select {
		case r.done <- d:
		case <-r.abandon:
			return
		}
	}
}

func (r *run) call(d *delivery) (err error) {
	s := &r.l.stats
	s.running.Add(1)
	defer func() {
		s.running.Add(-1)
		if v := recover(); v != nil {
			err = &PanicError{Value: v, Stack: debug.Stack()}
		}
	}()
	return r.h.Handle(d.ctx, &d.msg)
}

// fetchLoop takes batches from the driver whenever there is room in flight
// and fetching is not paused, and hands them to the dispatcher. A batch
// fetched as Run stops is handed over all the same: the dispatcher returns
// it to the broker, so that only one goroutine ever settles.
func (r *run) fetchLoop(ctx context.Context) {
	l := r.l
	var (
		buf      []driver.Message
		batch    = make([]*delivery, 0, l.cfg.fetchBatch)
		failures int
	)
	for ctx.Err() == nil {
		if p := l.paused.Load(); p > 0 {
			if wait := time.Until(time.Unix(0, p)); wait > 0 {
				if !sleep(ctx, wait) {
					return
				}
				continue
			}
		}
		room := l.cfg.maxInFlight - int(l.inflight.Load())
		if room <= 0 {
			select {
			case <-l.space:
				continue
			case <-ctx.Done():
				return
			}
		}
		var err error
		buf, err = l.drv.Fetch(ctx, buf[:0], min(room, l.cfg.fetchBatch))
		if len(buf) > 0 {
			l.inflight.Add(int64(len(buf)))
			l.stats.fetched.Add(int64(len(buf)))
			for i := range buf {
				batch = append(batch, newDelivery(&buf[i]))
				buf[i] = driver.Message{}
			}
			select {
			case r.fetched <- batch:
				batch = <-r.back
			case <-r.abandon:
				return // Run gave up on stuck handlers; the broker redelivers these after their lease
			}
		}
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			if driver.IsFatal(err) {
				r.fatal <- err
				return
			}
			failures++
			l.stats.fetchErrors.Add(1)
			wait := fetchDelay(failures, l.cfg.fetchBackoff)
			r.log.Warn("ferry: fetch failed; retrying", "err", err, "retry_in", wait, "failures", failures)
			if !sleep(ctx, wait) {
				return
			}
			continue
		}
		failures = 0
	}
}

func newDelivery(m *driver.Message) *delivery {
	d := &delivery{handle: m.Handle, heapIdx: -1}
	d.msg = Message{
		ID: m.ID, Key: m.Key, Body: m.Body, Headers: m.Headers, Source: m.Source,
		Lane: m.Lane, Offset: m.Offset, Attempt: max(m.Attempt, 1), PublishedAt: m.PublishedAt,
		as: m.As,
	}
	return d
}

// ioTimeout bounds one Extend or Settle call.
const ioTimeout = 30 * time.Second

// ioLoop makes the broker calls the dispatcher decided, one job at a time
// and in order: lease extensions, then settlements. Keeping them on one
// goroutine keeps Settle from running concurrently with itself, as the
// driver contract promises, and an extension from landing after a return.
func (r *run) ioLoop() {
	l := r.l
	for job := range r.ioCh {
		if len(job.extend) > 0 {
			ctx, cancel := withLazyDeadline(r.ioCtx, ioTimeout)
			if err := l.extender.Extend(ctx, job.extend, l.extender.Lease()); err != nil {
				l.stats.settleErrors.Add(1)
				r.log.Warn("ferry: extending leases failed", "err", err, "count", len(job.extend))
			}
			cancel()
		}
		if len(job.settle) > 0 {
			ctx, cancel := withLazyDeadline(r.ioCtx, ioTimeout)
			if err := l.drv.Settle(ctx, job.settle); err != nil {
				l.stats.settleErrors.Add(1)
				r.log.Warn("ferry: settling failed; the broker redelivers those messages after their lease", "err", err, "count", len(job.settle))
			}
			cancel()
		}
		if job.release > 0 {
			l.inflight.Add(-int64(job.release))
			select {
			case l.space <- struct{}{}:
			default:
			}
		}
		clear(job.extend)
		clear(job.settle)
		r.ioBack <- ioJob{extend: job.extend[:0], settle: job.settle[:0]}
	}
}

func fetchDelay(failures int, cap time.Duration) time.Duration {
	d := 100 * time.Millisecond
	for i := 1; i < failures && d < cap; i++ {
		d *= 2
	}
	d = min(d, cap)
	// Half fixed, half jitter: spread reconnecting consumers apart.
	return d/2 + rand.N(d/2+1)
}

func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
