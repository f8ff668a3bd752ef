// Package driverpeek reads a queue through a driver without consuming it:
// the one way the adapters that have no reading without a lease (SQS,
// RabbitMQ) peek, and the one conversion of a driver.Message to the
// consumer.Message a handler would see outside a loop.
package driverpeek

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
)

// Message is the consumer.Message a handler would see for m, outside a
// loop: no lease, nothing to settle, m.As not reachable.
func Message(m driver.Message) consumer.Message {
	return consumer.Message{
		ID: m.ID, Key: m.Key, Body: m.Body, Headers: m.Headers, Source: m.Source,
		Lane: m.Lane, Offset: m.Offset, Deliveries: m.Deliveries, PublishedAt: m.PublishedAt,
	}
}

// settleTimeout bounds handing the messages back, even when the caller's
// context ended: messages not handed back wait out their lease.
const settleTimeout = 10 * time.Second

// ErrNotHandedBack is wrapped by Peek's error when it read the messages but
// could not hand them all back: those come back by themselves after their
// lease (an SQS visibility timeout), so the read itself stands, and Peek
// returns its messages with this error.
var ErrNotHandedBack = errors.New("the peeked messages were not all handed back; they come back after their lease")

// Peek fetches up to want messages through d, then hands every one back
// unattempted (a Return with NotAttempted and the message's History), so
// that they are delivered again as they were, and returns them in the order
// they came, once each (a broker may deliver a message twice in one read:
// when its lease ran out during the read, as an SQS visibility timeout
// shorter than the read does; only its latest delivery is handed back, the
// earlier one's handle being stale). It stops early when a fetch brings
// nothing new within idle: someone else holds the rest, or the count want
// came from was approximate. It answers the revocations of a driver that
// takes lanes away, as a loop would, and leaves d open: the caller closes
// it. When the read succeeded and only the hand-back failed, it returns the
// messages with an error wrapping ErrNotHandedBack.
func Peek(ctx context.Context, d driver.Driver, want int, idle time.Duration) ([]consumer.Message, error) {
	defer answerRevocations(d)()
	var (
		got []driver.Message
		err error
	)
	latest := map[string]int{} // a message's ID: the index in got of its latest delivery
	var out []consumer.Message
	quiet := time.Now().Add(idle) // when the read is taken as done
	for len(out) < want && time.Now().Before(quiet) {
		fctx, cancel := context.WithDeadline(ctx, quiet)
		n := len(got)
		got, err = d.Fetch(fctx, got, want-len(out))
		cancel()
		if err != nil && ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
			err = nil // nothing came within idle
		}
		for i, m := range got[n:] {
			if m.ID != "" {
				_, seen := latest[m.ID]
				latest[m.ID] = n + i
				if seen {
					continue
				}
			}
			out = append(out, Message(m))
			quiet = time.Now().Add(idle)
		}
		if err != nil {
			break
		}
	}
	if err != nil {
		err = fmt.Errorf("read %d of %d messages: %w", len(out), want, err)
	}
	var back []driver.Settlement
	for i, m := range got {
		if m.ID != "" && latest[m.ID] != i {
			continue // delivered again since: this handle is stale
		}
		back = append(back, driver.Settlement{Handle: m.Handle, Action: driver.Return, NotAttempted: true, History: m.Known})
	}
	if len(back) > 0 {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
		serr := d.Settle(sctx, back)
		cancel()
		if serr != nil {
			if err == nil {
				return out, fmt.Errorf("%w: %w", ErrNotHandedBack, serr)
			}
			err = errors.Join(err, fmt.Errorf("%w: %w", ErrNotHandedBack, serr))
		}
	}
	if err != nil {
		return nil, err
	}
	return out, nil
}

// answerRevocations lets a driver that takes lanes away go on without a
// loop, until the returned function is called.
func answerRevocations(d driver.Driver) (stop func()) {
	r, ok := d.(driver.Revoker)
	if !ok {
		return func() {}
	}
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		for {
			select {
			case rev := <-r.Revoked():
				if rev.Done != nil {
					close(rev.Done)
				}
			case <-done:
				return
			}
		}
	}()
	return func() { close(done); <-stopped }
}
