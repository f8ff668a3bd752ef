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

// Peek fetches up to want messages through d, then hands every one back
// unattempted (a Return with NotAttempted and the message's History), so
// that they are delivered again as they were, and returns them in the order
// they came, once each (a broker may deliver a message twice in one read).
// It stops early when a fetch brings nothing new within idle: someone
// else holds the rest, or the count want came from was approximate. It
// answers the revocations of a driver that takes lanes away, as a loop
// would, and leaves d open: the caller closes it.
func Peek(ctx context.Context, d driver.Driver, want int, idle time.Duration) ([]consumer.Message, error) {
	defer answerRevocations(d)()
	var (
		got []driver.Message
		err error
	)
	seen := map[string]bool{}
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
		for _, m := range got[n:] {
			if m.ID != "" && seen[m.ID] {
				continue
			}
			seen[m.ID] = true
			out = append(out, Message(m))
			quiet = time.Now().Add(idle)
		}
		if err != nil {
			break
		}
	}
	if len(got) > 0 {
		back := make([]driver.Settlement, len(got))
		for i, m := range got {
			back[i] = driver.Settlement{Handle: m.Handle, Action: driver.Return, NotAttempted: true, History: m.Known}
		}
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
		serr := d.Settle(sctx, back)
		cancel()
		if serr != nil {
			err = errors.Join(err, fmt.Errorf("handing the messages back (they come back after their lease): %w", serr))
		}
	}
	if err != nil {
		return nil, fmt.Errorf("read %d of %d messages: %w", len(out), want, err)
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
