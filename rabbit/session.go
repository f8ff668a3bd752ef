package rabbit

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
)

// session is one consuming channel: a generation of delivery tags.
type session struct {
	gen uint64
	tag string
	ch  *amqp.Channel
	// deliveries holds what the broker pushed and Fetch has not taken, up
	// to the prefetch: a pump moves them from the library as they come,
	// so that Lag can count them.
	deliveries <-chan amqp.Delivery
	dead       chan struct{}
	stopped    atomic.Bool // the consumer was cancelled by Fetch

	mu      sync.Mutex
	base    uint64 // lowest tag not settled
	settled []bool // tag base+i settled?
	lanes   map[string]int
	open    int
}

func (s *session) isDead() bool {
	select {
	case <-s.dead:
		return true
	default:
		return false
	}
}

// setState replaces the current session and the error to report, waking a
// waiting Fetch.
func (d *queueDriver) setState(s *session, err error, fatal bool) {
	d.mu.Lock()
	d.cur = s
	if err != nil {
		d.err, d.fatal = err, fatal
	}
	close(d.changed)
	d.changed = make(chan struct{})
	d.mu.Unlock()
}

// supervise keeps a consuming channel open until the driver stops.
func (d *queueDriver) supervise() {
	defer d.wg.Done()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-d.stop:
		case <-d.b.closed:
		case <-ctx.Done():
		}
		cancel()
	}()
	var gen uint64
	failures := 0
	for !d.stopped() && !d.b.isClosed() {
		gen++
		s, closes, cancels, err := d.open(ctx, gen)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			err = d.failure(err)
			fatal := isFatal(err)
			d.setState(nil, err, fatal)
			if fatal {
				d.log.Error("rabbit: cannot consume", "err", err)
				return
			}
			wait := d.b.backoff(failures)
			failures++
			// Fetch reports it, and the loop logs it, rate-limited.
			d.log.Debug("rabbit: cannot consume; retrying", "err", err, "in", wait)
			d.b.sleep(ctx, wait, d.stop)
			continue
		}
		failures = 0
		d.setState(s, nil, false)

		var reason error
		select {
		case e, ok := <-closes:
			switch {
			case !ok || e == nil:
				// Closed by us (Fetch after a shutdown's hand-over): no
				// error to report, only a channel to reopen.
				d.log.Debug("rabbit: consuming channel closed by the client; reopening")
			case e.Code == amqp.PreconditionFailed && strings.Contains(e.Reason, "acknowledgement"):
				reason = d.failure(fmt.Errorf("channel closed for an ack timeout: %w", e))
				d.log.Warn("rabbit: the broker closed the channel because a delivery was not acked within its consumer_timeout; its handlers are cancelled and the channel reopened (raise consumer_timeout for longer work)", "err", e)
			default:
				reason = d.failure(withKind(fmt.Errorf("consuming channel closed: %w", e), stageRunning, true))
				if !d.b.isClosed() && !d.stopped() {
					d.log.Warn("rabbit: consuming channel closed; reopening", "err", e)
				}
			}
		case tag := <-cancels:
			reason = d.failure(fmt.Errorf("%w: %w (tag %s: was the queue deleted?)", consumer.ErrSourceNotFound, ErrConsumerCancelled, tag))
			d.log.Warn("rabbit: the broker cancelled the consumer; resuming once the queue exists again", "err", reason)
			go closeChannel(s.ch)
		case <-ctx.Done():
		}
		close(s.dead)
		if ctx.Err() != nil {
			return // Close closes the channel
		}
		d.setState(nil, reason, false)
		d.revoke(ctx, s)
		if !d.b.sleep(ctx, d.b.backoff(0), d.stop) {
			return
		}
	}
}

// closeChannel closes ch without waiting more than closeWait for the
// broker.
func closeChannel(ch *amqp.Channel) {
	done := make(chan struct{})
	go func() {
		_ = ch.Close()
		close(done)
	}()
	t := time.NewTimer(closeWait)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	}
}

// revoke tells the loop that every delivery of s is gone, and waits until
// the loop is done with them.
func (d *queueDriver) revoke(ctx context.Context, s *session) {
	s.mu.Lock()
	var lanes []string
	if d.laneKey {
		for l, n := range s.lanes {
			if n > 0 {
				lanes = append(lanes, l)
			}
		}
	} else if s.open > 0 {
		lanes = []string{""}
	}
	s.mu.Unlock()
	if len(lanes) == 0 {
		return
	}
	slices.Sort(lanes)
	r := driver.Revocation{Lanes: lanes, Done: make(chan struct{})}
	select {
	case d.revoked <- r:
	case <-ctx.Done():
		return
	}
	select {
	case <-r.Done:
	case <-ctx.Done():
	}
}

// isFatal reports whether err ends consuming: a refusal (see classify; a
// vhost refused is one at the first connect only, a wrong URL, and on a
// reconnect what a restarting node answers before its vhosts are up), or
// a closed Broker or Driver.
func isFatal(err error) bool {
	return errors.Is(err, consumer.ErrRefused) || errors.Is(err, ErrClosed)
}

// open opens a consuming channel: the queue (and its exchanges and
// bindings) declared again when it is in the topology, the prefetch set,
// the consumer started. Waiting for the connection is bounded by
// [driver.ReportWithin], so that Fetch reports a broker that does not answer
// in time (the dial goes on, and the next open waits for it again). Its
// errors carry their kind (see classify).
func (d *queueDriver) open(ctx context.Context, gen uint64) (*session, chan *amqp.Error, chan string, error) {
	gctx, cancel := context.WithTimeout(ctx, driver.ReportWithin)
	conn, err := d.b.consConn.get(gctx)
	cancel()
	if err != nil {
		return nil, nil, nil, err
	}
	ch, err := conn.Channel()
	if err != nil {
		return nil, nil, nil, withKind(fmt.Errorf("open channel: %w", err), stageRunning, true)
	}
	fail := func(err error) (*session, chan *amqp.Error, chan string, error) {
		if !ch.IsClosed() {
			closeChannel(ch)
		}
		return nil, nil, nil, err
	}
	// A queue of no topology is checked by Consume itself (404).
	if err := d.declareOwn(ch, false); err != nil {
		return fail(confirmRefusal(ctx, conn, err))
	}
	if d.declared {
		d.b.warnDrops(d.q, conn)
	}
	if err := ch.Qos(d.prefetch, 0, false); err != nil {
		return fail(withKind(fmt.Errorf("prefetch %d: %w", d.prefetch, err), stageRunning, true))
	}
	closes := ch.NotifyClose(make(chan *amqp.Error, 1))
	cancels := ch.NotifyCancel(make(chan string, 4))
	tag := fmt.Sprintf("ferry-%s-%d", d.b.idPrefix, gen)
	deliveries, err := ch.Consume(d.queue, tag, false, false, false, false, nil)
	if err != nil {
		return fail(confirmRefusal(ctx, conn, withKind(fmt.Errorf("consume: %w", err), stageRunning, true)))
	}
	s := &session{
		gen:   gen,
		tag:   tag,
		ch:    ch,
		dead:  make(chan struct{}),
		lanes: make(map[string]int),
	}
	pushed := make(chan amqp.Delivery, d.prefetch)
	s.deliveries = pushed
	go pump(deliveries, pushed, s.dead)
	return s, closes, cancels, nil
}

// refusalGrace is how long a refusal met on a channel waits for its
// connection to close before it is taken for one.
const refusalGrace = time.Second

// confirmRefusal returns err, unless it is a refusal (403) met on a channel
// of conn and conn closes within refusalGrace: a vhost being deleted loses
// its permissions first, then its queues (the consumer is cancelled and
// opens a new channel), and only then its connections. That 403 refused
// nobody for good: it is reported as the connection lost, and retried.
func confirmRefusal(ctx context.Context, conn *amqp.Connection, err error) error {
	var ae *amqp.Error
	if !errors.Is(err, consumer.ErrRefused) || !errors.As(err, &ae) {
		return err
	}
	closed := conn.NotifyClose(make(chan *amqp.Error, 1))
	t := time.NewTimer(refusalGrace)
	defer t.Stop()
	select {
	case <-closed:
		return fmt.Errorf("%w: the connection closed right after a refusal: %w", consumer.ErrUnreachable, ae)
	case <-t.C:
	case <-ctx.Done():
	}
	return err
}

// pump moves the deliveries the library received into out, which the
// prefetch bounds (the broker pushes no more unacked deliveries than it),
// and closes out when the library closes in (the channel closed, or the
// consumer was cancelled). Once dead (nobody takes them any more: the
// broker requeues them with the channel) it drops them, so that the
// library's reader never waits.
func pump(in <-chan amqp.Delivery, out chan<- amqp.Delivery, dead <-chan struct{}) {
	defer close(out)
	for dv := range in {
		select {
		case out <- dv:
		case <-dead:
			for range in {
			}
			return
		}
	}
}
