package rabbit

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer/driver"
)

// delayedPublishTimeout bounds the publish of delayed retries' copies.
const delayedPublishTimeout = 10 * time.Second

// delayFor rounds delay up to the next configured delay queue.
func (d *queueDriver) delayFor(delay time.Duration) time.Duration {
	ds := d.b.cfg.retryDelays
	for _, x := range ds {
		if x >= delay {
			return x
		}
	}
	return ds[len(ds)-1]
}

// retryLater publishes a copy of each delayed delivery to its delay queue
// and says, per delivery, what to do with the original: ack it (the copy is
// confirmed), dead-letter it (its deliveries passed the queue's delivery
// limit), or requeue it now (the copy could not be published).
func (d *queueDriver) retryLater(ctx context.Context, batch []driver.Settlement, idx []int) ([]ackKind, error) {
	// A blocked publishing connection (an alarm) would hold every
	// settlement behind this one: the copies get a bounded time, and none
	// is tried while the broker blocks.
	ctx, cancel := context.WithTimeout(ctx, delayedPublishTimeout)
	defer cancel()
	kinds := make([]ackKind, len(idx))
	var items []pubItem
	var which []int
	for j, i := range idx {
		st := &batch[i]
		h := st.Handle.(*handle)
		m := d.toMessage(&h.d)
		if d.declared && d.q.DeliveryLimit > 0 && m.Deliveries > d.q.DeliveryLimit {
			kinds[j] = kindDeadLetter
			continue
		}
		delay := d.delayFor(st.Delay)
		if err := d.declareDelay(ctx, delay, false); err != nil {
			for k := range kinds {
				if kinds[k] != kindDeadLetter {
					kinds[k] = kindReject
				}
			}
			return kinds, err
		}
		hdr := make(amqp.Table, len(h.d.Headers)+3)
		for k, v := range h.d.Headers {
			switch k {
			case "x-death", "x-delivery-count", "x-first-death-exchange", "x-first-death-queue", "x-first-death-reason",
				"x-last-death-exchange", "x-last-death-queue", "x-last-death-reason":
				continue
			}
			hdr[k] = v
		}
		hdr[HeaderKey] = m.Key
		hdr[headerDeliveries] = strconv.Itoa(m.Deliveries)
		if st.History.Deliveries > 0 {
			hdr[headerHistory] = formatHistory(st.History)
		}
		pub := amqp.Publishing{
			Headers:         hdr,
			ContentType:     h.d.ContentType,
			ContentEncoding: h.d.ContentEncoding,
			DeliveryMode:    amqp.Persistent,
			MessageId:       m.ID,
			Timestamp:       h.d.Timestamp,
			Type:            h.d.Type,
			CorrelationId:   h.d.CorrelationId,
			ReplyTo:         h.d.ReplyTo,
			AppId:           h.d.AppId,
			Body:            h.d.Body,
		}
		items = append(items, pubItem{rk: delayQueueName(d.queue, delay), pub: pub})
		which = append(which, j)
	}
	if len(items) == 0 {
		return kinds, nil
	}
	var errs []error
	pubErrs := d.b.pub.publishRaw(ctx, "", "delay queues of "+d.queue, items)
	// A copy returned unroutable means its delay queue is gone (deleted
	// under the declare cache): declare it again and publish the copy once
	// more before requeueing the original at once.
	var again []pubItem
	var againAt []int
	for k, err := range pubErrs {
		if !errors.Is(err, ErrUnroutable) {
			continue
		}
		delay := d.delayFor(batch[idx[which[k]]].Delay)
		if derr := d.declareDelay(ctx, delay, true); derr != nil {
			pubErrs[k] = errors.Join(err, derr)
			continue
		}
		again = append(again, items[k])
		againAt = append(againAt, k)
	}
	if len(again) > 0 {
		for n, err := range d.b.pub.publishRaw(ctx, "", "delay queues of "+d.queue, again) {
			pubErrs[againAt[n]] = err
		}
	}
	for k, err := range pubErrs {
		if err != nil {
			kinds[which[k]] = kindReject
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return kinds, fmt.Errorf("rabbit: delayed retry on %q, requeued at once instead: %w", d.queue, errors.Join(errs...))
	}
	return kinds, nil
}

// declareDelay declares the delay queue for delay, once per connection
// unless force (the queue was found gone), on the consuming connection (an
// alarm blocks only publishing connections).
func (d *queueDriver) declareDelay(ctx context.Context, delay time.Duration, force bool) error {
	if reason, _ := d.b.pubConn.blockedWait(); reason != "" || d.b.pubConn.blocked.Load() != nil {
		return fmt.Errorf("rabbit: delay queue: %w (%s)", ErrBlocked, reason)
	}
	name := delayQueueName(d.queue, delay)
	conn, err := d.b.consConn.get(ctx)
	if err != nil {
		return err
	}
	d.delayMu.Lock()
	defer d.delayMu.Unlock()
	if d.delayDeclared[name] == conn && !force {
		return nil
	}
	delete(d.delayDeclared, name)
	// The channel's methods take no context: bounded by ctx here, the
	// declaration finishing (and its channel closing) on its own.
	err = withContext(ctx, func() error {
		ch, err := conn.Channel()
		if err != nil {
			return err
		}
		defer closeChannel(ch)
		return declareQueue(ch, delayQueue(d.queue, delay))
	})
	if err != nil {
		return fmt.Errorf("rabbit: declare delay %w", err)
	}
	d.delayDeclared[name] = conn
	return nil
}

// withContext runs f, returning early with ctx's error when ctx ends first
// (f goes on in the background and its result is dropped).
func withContext(ctx context.Context, f func() error) error {
	done := make(chan error, 1)
	go func() { done <- f() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}
