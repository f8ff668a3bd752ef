package rabbit

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
)

// DefaultPrefetch is a driver's prefetch (basic.qos: how many unacked
// deliveries the broker pushes to it at once) when its [driver.Config]
// gives no MaxInFlight.
const DefaultPrefetch = 64

// queueDriver is the driver over one queue that [Broker.Driver] returns.
type queueDriver struct {
	b        *Broker
	queue    string
	q        Queue
	declared bool // q is in the topology: declared on every channel
	prefetch int
	laneKey  bool
	log      *slog.Logger

	revoked chan driver.Revocation

	startOnce sync.Once
	stop      chan struct{}
	closeOnce sync.Once
	wg        sync.WaitGroup

	mu       sync.Mutex
	cur      *session
	changed  chan struct{} // closed and replaced when cur or err changes
	err      error         // to report from Fetch, once
	fatal    bool
	reported bool // Fetch returned an error and no session has answered since

	delayMu       sync.Mutex
	delayDeclared map[string]*amqp.Connection

	ackFrames atomic.Int64 // basic.ack frames sent, for tests
}

var (
	_ driver.Driver      = (*queueDriver)(nil)
	_ driver.Connector   = (*queueDriver)(nil)
	_ driver.Revoker     = (*queueDriver)(nil)
	_ driver.Drainer     = (*queueDriver)(nil)
	_ driver.Aser        = (*queueDriver)(nil)
	_ driver.LagReporter = (*queueDriver)(nil)
)

// handle is a delivery as the loop holds it: its channel generation and tag.
type handle struct {
	s    *session
	tag  uint64
	lane string
	d    amqp.Delivery
}

// Driver returns a driver over queue, for [consumer.NewOn] or a loop of
// your own ([driver.Opener]); NewConsumer is the usual way to get one. Its
// prefetch is cfg.MaxInFlight (at most 65535), or [DefaultPrefetch] when 0.
// It does not reach the broker (ctx is not used). When queue is in the
// Broker's topology it is declared again on every channel the driver
// opens, so a queue deleted under it comes back; otherwise it must exist.
// The driver implements [driver.Connector], [driver.Revoker],
// [driver.Drainer], [driver.Aser] (target *amqp091.Delivery) and
// [driver.LagReporter]. It consumes on a channel of the Broker's consuming
// connection, and reopens it (and the connection) when it is lost.
func (b *Broker) Driver(_ context.Context, queue string, cfg driver.Config) (driver.Driver, error) {
	if queue == "" {
		return nil, consumer.ConfigErrorf("queue", "name must not be empty")
	}
	if b.isClosed() {
		return nil, fmt.Errorf("rabbit: driver for %q: %w", queue, ErrClosed)
	}
	d := &queueDriver{
		b:             b,
		queue:         queue,
		prefetch:      DefaultPrefetch,
		log:           b.log.With("queue", queue),
		revoked:       make(chan driver.Revocation),
		stop:          make(chan struct{}),
		changed:       make(chan struct{}),
		delayDeclared: make(map[string]*amqp.Connection),
	}
	d.q, d.declared = b.cfg.topology.queue(queue)
	d.laneKey = d.declared && d.q.SingleActiveConsumer
	switch {
	case cfg.MaxInFlight < 0:
		return nil, consumer.ConfigErrorf("MaxInFlight", "must not be negative, got %d", cfg.MaxInFlight)
	case cfg.MaxInFlight > 0:
		d.prefetch = min(cfg.MaxInFlight, 65535)
	}
	b.mu.Lock()
	b.drivers[d] = struct{}{}
	b.mu.Unlock()
	return d, nil
}

// NewConsumer returns a delivery loop over queue: [consumer.NewOn] over the
// Broker with opts, the prefetch set to the loop's MaxInFlight.
func (b *Broker) NewConsumer(ctx context.Context, queue string, opts ...consumer.Option) (*consumer.Loop, error) {
	return consumer.NewOn(ctx, b, queue, opts...)
}

// Capabilities names the system "rabbitmq" and the queue as the source,
// and reports that the queue redelivers returned messages, except on a
// single-active-consumer queue (ordered: Lane is the Key): a message
// returned with a delay goes through a delay queue and comes back behind
// the rest of its key, so there the loop retries a failed message in
// place, holding its key, as on a Kafka partition.
func (d *queueDriver) Capabilities() driver.Capabilities {
	return driver.Capabilities{Redelivers: !d.laneKey, System: MessagingSystem, Source: d.queue}
}

// Connect checks, within [driver.ReportWithin] (or ctx's deadline), that the
// broker answers and the queue is there: it opens the consuming connection
// (or takes the one open) and declares the queue on a channel of its own,
// passively, or, for a queue of the Topology, as the topology says, with
// its exchanges and bindings, so that a topology queue deleted meanwhile
// comes back. Its errors wrap [consumer.ErrUnreachable] (the broker cannot
// be reached: the error names its address) or [consumer.ErrSourceNotFound]
// (no such queue: the loop tries again, and consumes once it is declared),
// or are marked [driver.Fatal] and wrap [consumer.ErrRefused] (credentials,
// the vhost, the TLS handshake, a declaration the broker rejects). That
// the user may read the queue is known only when Fetch consumes: a 403
// there ends Run the same way.
func (d *queueDriver) Connect(ctx context.Context) error {
	if d.stopped() || d.b.isClosed() {
		return driver.Fatal(fmt.Errorf("rabbit: connect to %q: %w", d.queue, ErrClosed))
	}
	ctx, cancel := context.WithTimeout(ctx, driver.ReportWithin)
	defer cancel()
	conn, err := d.b.consConn.get(ctx)
	if err == nil {
		// The channel's methods take no context: bounded by ctx here, the
		// declaration finishing (and its channel closing) on its own.
		err = withContext(ctx, func() error {
			ch, err := conn.Channel()
			if err != nil {
				return withKind(fmt.Errorf("open channel: %w", err), stageRunning, true)
			}
			defer closeChannel(ch)
			return confirmRefusal(ctx, conn, d.declareOwn(ch, true))
		})
		if err != nil && linkKind(err) == nil && errors.Is(err, ctx.Err()) {
			err = fmt.Errorf("declare queue %q: the broker did not answer: %w: %w", d.queue, consumer.ErrUnreachable, err)
		}
	}
	if err == nil {
		return nil
	}
	err = d.failure(err)
	if isFatal(err) {
		return driver.Fatal(err)
	}
	return err
}

// declareOwn declares on ch the queue, with its exchanges and bindings,
// when it is in the topology; otherwise, when passive, checks that it
// exists. Its errors carry their kind (see classify).
func (d *queueDriver) declareOwn(ch *amqp.Channel, passive bool) error {
	if !d.declared {
		if !passive {
			return nil
		}
		if _, err := ch.QueueDeclarePassive(d.queue, true, false, false, false, nil); err != nil {
			return withKind(fmt.Errorf("queue %q: %w", d.queue, err), stageDeclare, true)
		}
		return nil
	}
	t := d.b.cfg.topology
	for _, e := range t.exchangesOf(d.queue) {
		kind := e.Kind
		if kind == "" {
			kind = "topic"
		}
		if err := ch.ExchangeDeclare(e.Name, kind, true, false, false, false, e.Args); err != nil {
			return withKind(fmt.Errorf("declare exchange %q: %w", e.Name, err), stageDeclare, true)
		}
	}
	if err := declareQueue(ch, d.q); err != nil {
		return withKind(fmt.Errorf("declare %w", err), stageDeclare, true)
	}
	for _, bd := range t.bindingsOf(d.queue) {
		if err := ch.QueueBind(bd.Queue, bd.Key, bd.Exchange, false, bd.Args); err != nil {
			return withKind(fmt.Errorf("bind %q to %q: %w", bd.Queue, bd.Exchange, err), stageDeclare, true)
		}
	}
	return nil
}

// failure is err as Fetch and Connect report it: naming the queue and the
// broker (its URL without the password; a connection's error names it
// already).
func (d *queueDriver) failure(err error) error {
	if strings.Contains(err.Error(), d.b.redacted) {
		return fmt.Errorf("rabbit: consume %q: %w", d.queue, err)
	}
	return fmt.Errorf("rabbit: consume %q on %s: %w", d.queue, d.b.redacted, err)
}

// Revoked delivers a revocation whenever the channel closes: the broker
// requeued its unsettled deliveries, so the loop stops their handlers and
// settles none of them. A new channel is opened only once the loop is done
// with the old one.
func (d *queueDriver) Revoked() <-chan driver.Revocation { return d.revoked }

func (d *queueDriver) stopped() bool {
	select {
	case <-d.stop:
		return true
	default:
		return false
	}
}

// Fetch appends up to max deliveries to dst, waiting for at least one. An
// error the supervisor met since the last Fetch (a lost connection or
// channel, a queue that does not exist) is returned once, so the loop
// reports it, wrapping [consumer.ErrUnreachable] or ErrSourceNotFound; a
// refusal (wrapping [consumer.ErrRefused]: access refused, the vhost, the
// credentials) and a closed Broker or Driver are marked [driver.Fatal].
// After an error, Fetch returns with no delivery as soon as a new channel
// consumes, so that the loop knows the broker answers again even while the
// queue is empty.
func (d *queueDriver) Fetch(ctx context.Context, dst []driver.Message, max int) ([]driver.Message, error) {
	d.startOnce.Do(func() {
		// Under d.mu, as Close closes d.stop: either supervise is added
		// before Close waits for it, or it is never started. (An Add
		// concurrent with the Wait was a race.)
		d.mu.Lock()
		if !d.stopped() {
			d.wg.Add(1)
			go d.supervise()
		}
		d.mu.Unlock()
	})
	if max <= 0 {
		max = 1
	}
	for {
		if d.stopped() || d.b.isClosed() {
			return dst, driver.Fatal(fmt.Errorf("rabbit: fetch from %q: %w", d.queue, ErrClosed))
		}
		d.mu.Lock()
		s, changed, err, fatal := d.cur, d.changed, d.err, d.fatal
		if err != nil && !fatal {
			d.err = nil
			d.reported = true
		}
		answered := false
		if err == nil && d.reported && s != nil && !s.isDead() && !s.stopped.Load() {
			d.reported, answered = false, true
		}
		d.mu.Unlock()
		if err != nil {
			if fatal {
				return dst, driver.Fatal(err)
			}
			return dst, err
		}
		if answered {
			return dst, nil
		}
		if s != nil && s.stopped.Load() && !s.isDead() {
			// Fetch cancelled the consumer when the loop stopped; fetching
			// again needs a new channel.
			go closeChannel(s.ch)
			s = nil
		}
		if s == nil || s.isDead() {
			select {
			case <-changed:
			case <-ctx.Done():
				return dst, ctx.Err()
			case <-d.stop:
			case <-d.b.closed:
			}
			continue
		}
		select {
		case dv, ok := <-s.deliveries:
			if !ok {
				select {
				case <-s.dead:
				case <-changed:
				case <-ctx.Done():
					return dst, ctx.Err()
				case <-d.stop:
				}
				continue
			}
			dst = d.take(s, dst, &dv)
			for len(dst) < max {
				select {
				case dv, ok := <-s.deliveries:
					if !ok {
						return dst, nil
					}
					dst = d.take(s, dst, &dv)
					continue
				default:
				}
				break
			}
			return dst, nil
		case <-changed:
		case <-ctx.Done():
			return dst, ctx.Err() // what was pushed meanwhile is the loop's Drain's
		case <-d.stop:
		case <-d.b.closed:
		}
	}
}

// Drain implements [driver.Drainer]: when the loop stops fetching (its
// shutdown), the broker has pushed deliveries the loop has not taken yet,
// and handing them back would count a delivery against each. So the
// consumer is cancelled (nothing more comes after basic.cancel-ok) and
// what was pushed is returned, for the loop to run in its drain. The
// prefetch bounds what was pushed, so all of it fits the loop. A later
// Fetch opens a new channel.
func (d *queueDriver) Drain(_ context.Context, dst []driver.Message) ([]driver.Message, error) {
	d.mu.Lock()
	s := d.cur
	d.mu.Unlock()
	if s == nil || s.isDead() || !s.stopped.CompareAndSwap(false, true) {
		return dst, nil
	}
	// amqp091-go closes the deliveries channel on basic.cancel-ok; the
	// timer bounds the wait for a broker that does not answer.
	go func() { _ = s.ch.Cancel(s.tag, false) }()
	t := time.NewTimer(2 * time.Second)
	defer t.Stop()
	for {
		select {
		case dv, ok := <-s.deliveries:
			if !ok {
				return dst, nil
			}
			dst = d.take(s, dst, &dv)
		case <-s.dead:
			return dst, nil
		case <-t.C:
			return dst, nil
		}
	}
}

// take converts one delivery and tracks its tag. The handle holds the
// delivery itself (for As and delayed retries): one allocation each.
func (d *queueDriver) take(s *session, dst []driver.Message, dv *amqp.Delivery) []driver.Message {
	h := &handle{s: s, tag: dv.DeliveryTag, d: *dv}
	m := d.toMessage(&h.d)
	h.lane = m.Lane
	s.mu.Lock()
	if s.isDead() {
		// Buffered when the channel died: the broker requeued it, and the
		// revocation (counted under s.mu after dead closed) did not
		// include it. Handing it over would run it after its revocation.
		s.mu.Unlock()
		return dst
	}
	if s.base == 0 {
		s.base = dv.DeliveryTag
	}
	// Tags of a channel count up by one per delivery.
	for s.base+uint64(len(s.settled)) <= dv.DeliveryTag {
		s.settled = append(s.settled, false)
	}
	s.open++
	if d.laneKey {
		s.lanes[m.Lane]++
	}
	s.mu.Unlock()
	m.Handle = h
	return append(dst, m)
}

// As serves [consumer.Message.As]: a *amqp091.Delivery target gets a copy of
// the delivery as the library received it.
func (d *queueDriver) As(h, target any) bool {
	hd, ok := h.(*handle)
	t, ok2 := target.(*amqp.Delivery)
	if !ok || !ok2 || hd == nil {
		return false
	}
	*t = hd.d
	return true
}

// ackKind is what Settle does with one delivery on the broker.
type ackKind uint8

const (
	kindAck ackKind = iota
	kindReject
	kindNack
	kindDeadLetter
	// kindKeep leaves a returned delivery of an ordered queue unacked: the
	// broker gives it back at its place when the channel closes. A delay
	// queue would put it behind the rest of its key, and so would a
	// requeue on a quorum queue (RabbitMQ 3.10 requeues at the back; a
	// closed channel's deliveries go back to the head, in order).
	kindKeep
)

// Settle acks or returns each delivery of the current channel. Acks of the
// lowest tags not yet settled go out as one basic.ack with multiple set; a
// Return with no delay is a basic.reject with requeue (basic.nack when the
// handler never ran, which RabbitMQ 4.3 does not count as a delivery); a
// Return with a delay publishes a copy to the delay queue (see the package
// documentation), waits for its confirm, then acks the original. On a
// single-active-consumer queue a Return (which the loop makes only when it
// stops: it retries in place there) sends nothing: the delivery stays
// unacked until the channel closes (Close), and the broker then puts it
// back at its place, ahead of the rest of its key, with its delay given up
// (a requeue would put it behind them on a quorum queue). A delivery of a
// closed channel is never settled on another: it is reported with
// [ErrStaleDelivery] in a *[driver.SettleError], as the broker requeued it.
func (d *queueDriver) Settle(ctx context.Context, batch []driver.Settlement) error {
	d.mu.Lock()
	cur := d.cur
	d.mu.Unlock()
	var stale, invalid []int
	var failed []int
	var failErr error
	type op struct {
		i    int
		h    *handle
		kind ackKind
	}
	ops := make([]op, 0, len(batch))
	var delayed []int
	for i := range batch {
		st := &batch[i]
		h, ok := st.Handle.(*handle)
		if !ok || h == nil {
			invalid = append(invalid, i)
			continue
		}
		if h.s != cur || h.s.isDead() {
			stale = append(stale, i)
			d.forget(h)
			continue
		}
		switch {
		case st.Action == driver.Ack:
			ops = append(ops, op{i, h, kindAck})
		case d.laneKey:
			ops = append(ops, op{i, h, kindKeep})
		case st.Delay <= 0 && st.NotAttempted:
			ops = append(ops, op{i, h, kindNack})
		case st.Delay <= 0:
			ops = append(ops, op{i, h, kindReject})
		default:
			delayed = append(delayed, i)
		}
	}

	// Delayed returns: a copy through the delay queue, then an ack.
	if len(delayed) > 0 {
		kinds, err := d.retryLater(ctx, batch, delayed)
		for j, i := range delayed {
			h := batch[i].Handle.(*handle)
			ops = append(ops, op{i, h, kinds[j]})
		}
		if err != nil {
			failErr = err
			for j, i := range delayed {
				if kinds[j] == kindReject {
					failed = append(failed, i)
				}
			}
		}
	}

	if cur != nil && len(ops) > 0 {
		ch := cur.ch
		var chErr error
		// Rejects and nacks first, then the acks, so a multiple ack covers
		// only what is settled.
		for _, o := range ops {
			if chErr != nil {
				break
			}
			switch o.kind {
			case kindReject:
				chErr = ch.Reject(o.h.tag, true)
			case kindNack:
				chErr = ch.Nack(o.h.tag, false, true)
			case kindDeadLetter:
				chErr = ch.Reject(o.h.tag, false)
			}
		}
		var acks []uint64
		for _, o := range ops {
			if o.kind == kindAck {
				acks = append(acks, o.h.tag)
			}
		}
		if chErr == nil {
			chErr = d.ack(cur, acks, func(yield func(uint64) bool) {
				for _, o := range ops {
					// A kept delivery stays unsettled on the channel, so
					// no multiple ack ever covers it.
					if o.kind != kindKeep && !yield(o.h.tag) {
						return
					}
				}
			})
		}
		var syncErr error
		if chErr == nil && len(acks) > 0 && beforeRun(batch) {
			syncErr = d.ackSync(ctx, cur)
		}
		for _, o := range ops {
			d.forget(o.h)
		}
		if syncErr != nil {
			for _, o := range ops {
				failed = append(failed, o.i)
			}
			failErr = errors.Join(failErr, fmt.Errorf("rabbit: settle on %q: %w", d.queue, syncErr))
		}
		if chErr != nil {
			for _, o := range ops {
				failed = append(failed, o.i)
			}
			failErr = errors.Join(failErr, fmt.Errorf("rabbit: settle on %q: %w: %w", d.queue, ErrStaleDelivery, chErr))
		}
	}
	if len(stale) > 0 {
		failErr = errors.Join(failErr, fmt.Errorf("rabbit: settle on %q: %d of %d deliveries: %w", d.queue, len(stale), len(batch), ErrStaleDelivery))
	}
	if len(invalid) > 0 {
		failErr = errors.Join(failErr, fmt.Errorf("rabbit: settle on %q: %d of %d handles: %w", d.queue, len(invalid), len(batch), ErrInvalidHandle))
	}
	all := slices.Concat(stale, invalid, failed)
	if len(all) > 0 {
		slices.Sort(all)
		all = slices.Compact(all)
		return &driver.SettleError{Failed: all, Err: failErr}
	}
	return nil
}

// beforeRun reports whether batch holds an at-most-once ack.
func beforeRun(batch []driver.Settlement) bool {
	for i := range batch {
		if batch[i].BeforeRun && batch[i].Action == driver.Ack {
			return true
		}
	}
	return false
}

// ackSync returns once the broker has processed the acks sent on s's
// channel before it. AMQP does not confirm a basic.ack; a synchronous
// method on the same channel (basic.qos, with the prefetch unchanged) is
// answered only after the broker's channel handled every frame before it.
// It fails when ctx ends or the channel closes first: the loop then does
// not run the message.
func (d *queueDriver) ackSync(ctx context.Context, s *session) error {
	done := make(chan error, 1)
	go func() { done <- s.ch.Qos(d.prefetch, 0, false) }()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("at-most-once ack not confirmed: %w", err)
		}
		return nil
	case <-ctx.Done():
		return fmt.Errorf("at-most-once ack not confirmed: %w", ctx.Err())
	case <-s.dead:
		return errors.New("at-most-once ack not confirmed: the channel closed")
	}
}

// forget drops a settled delivery from its lane count.
func (d *queueDriver) forget(h *handle) {
	s := h.s
	s.mu.Lock()
	s.open--
	if d.laneKey {
		if s.lanes[h.lane]--; s.lanes[h.lane] <= 0 {
			delete(s.lanes, h.lane)
		}
	}
	s.mu.Unlock()
}

// ack marks the tags of settled as settled and acks those in acks: the ones
// now below the lowest unsettled tag with one multiple ack, the others one
// by one.
func (d *queueDriver) ack(s *session, acks []uint64, settled func(func(uint64) bool)) error {
	s.mu.Lock()
	for t := range settled {
		if i := t - s.base; t >= s.base && i < uint64(len(s.settled)) {
			s.settled[i] = true
		}
	}
	n := 0
	for n < len(s.settled) && s.settled[n] {
		n++
	}
	s.settled = s.settled[n:]
	s.base += uint64(n)
	base := s.base
	s.mu.Unlock()
	if len(acks) == 0 {
		return nil
	}
	var below uint64
	var rest []uint64
	for _, t := range acks {
		if t < base {
			below = max(below, t)
		} else {
			rest = append(rest, t)
		}
	}
	if below > 0 {
		d.ackFrames.Add(1)
		if err := s.ch.Ack(below, true); err != nil {
			return err
		}
	}
	for _, t := range rest {
		d.ackFrames.Add(1)
		if err := s.ch.Ack(t, false); err != nil {
			return err
		}
	}
	return nil
}

// Close stops the driver: its channel is closed, so the broker requeues
// what was delivered and not settled, and a Fetch waiting returns. Calling
// it again does nothing.
func (d *queueDriver) Close() error {
	d.close(true)
	return nil
}

func (d *queueDriver) close(closeCh bool) {
	d.closeOnce.Do(func() {
		d.mu.Lock()
		close(d.stop)
		d.mu.Unlock()
		d.wg.Wait()
		d.mu.Lock()
		s := d.cur
		d.cur = nil
		d.mu.Unlock()
		if closeCh && s != nil && !s.ch.IsClosed() {
			closeChannel(s.ch)
		}
		d.b.mu.Lock()
		delete(d.b.drivers, d)
		d.b.mu.Unlock()
	})
}
