package rabbit

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
)

// DefaultPrefetch is a driver's prefetch (basic.qos: how many unacked
// deliveries the broker pushes to it at once) when its driver.Config
// gives no MaxInFlight.
const DefaultPrefetch = 64

// queueDriver is the driver over one queue that Broker.Driver returns.
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

// handle is a delivery as the loop holds it: its channel generation and tag.
type handle struct {
	s    *session
	tag  uint64
	lane string
	d    amqp.Delivery
}

// Driver returns a driver over queue, for consumer.NewOn or a loop of
// your own (driver.Opener); NewConsumer is the usual way to get one. Its
// prefetch is cfg.MaxInFlight (at most 65535), or DefaultPrefetch when 0.
// It does not reach the broker (ctx is not used). When queue is in the
// Broker's topology it is declared again on every channel the driver
// opens, so a queue deleted under it comes back; otherwise it must exist.
// The driver implements driver.Connector, driver.Revoker,
// driver.Drainer, driver.Aser (target *amqp091.Delivery) and
// driver.LagReporter. It consumes on a channel of the Broker's consuming
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

// NewConsumer returns a delivery loop over queue: consumer.NewOn over the
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
	return driver.Capabilities{Redelivers: !d.laneKey, System: "rabbitmq", Source: d.queue}
}

// Connect checks, within driver.ReportWithin (or ctx's deadline), that the
// broker answers and the queue is there: it opens the consuming connection
// (or takes the one open) and declares the queue on a channel of its own,
// passively, or, for a queue of the Topology, as the topology says, with
// its exchanges and bindings, so that a topology queue deleted meanwhile
// comes back. Its errors wrap consumer.ErrUnreachable (the broker cannot
// be reached: the error names its address) or consumer.ErrSourceNotFound
// (no such queue: the loop tries again, and consumes once it is declared),
// or are marked driver.Fatal and wrap consumer.ErrRefused (credentials,
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
// driver.ReportWithin, so that Fetch reports a broker that does not answer
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

// Fetch appends up to max deliveries to dst, waiting for at least one. An
// error the supervisor met since the last Fetch (a lost connection or
// channel, a queue that does not exist) is returned once, so the loop
// reports it, wrapping consumer.ErrUnreachable or ErrSourceNotFound; a
// refusal (wrapping consumer.ErrRefused: access refused, the vhost, the
// credentials) and a closed Broker or Driver are marked driver.Fatal.
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

// Drain implements driver.Drainer: when the loop stops fetching (its
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

// toMessage turns a delivery into the loop's message.
func (d *queueDriver) toMessage(dv *amqp.Delivery) driver.Message {
	m := driver.Message{
		ID:     dv.MessageId,
		Key:    dv.RoutingKey,
		Body:   dv.Body,
		Source: d.queue,
		Offset: -1,
	}
	if dv.Exchange == "" {
		// Through the default exchange the routing key is the queue's
		// name, not a key: a keyed message has its Key in HeaderKey.
		m.Key = ""
	}
	if !dv.Timestamp.IsZero() {
		m.PublishedAt = dv.Timestamp
	}
	carried := 0
	var xdc int64 = -1
	if len(dv.Headers) > 0 {
		m.Headers = make(map[string]string, len(dv.Headers))
		for k, v := range dv.Headers {
			switch k {
			case HeaderKey:
				if s, ok := v.(string); ok {
					m.Key = s
				}
				continue
			case headerDeliveries:
				if s, ok := v.(string); ok {
					carried, _ = strconv.Atoi(s)
				}
				continue
			case headerHistory:
				if s, ok := v.(string); ok {
					m.Known = parseHistory(s)
				}
				continue
			case "x-delivery-count":
				xdc = toInt64(v)
			}
			if s, ok := headerString(v); ok {
				m.Headers[k] = s
			}
		}
		if len(m.Headers) == 0 {
			m.Headers = nil
		}
	}
	switch {
	case xdc >= 0: // a quorum queue, after the first delivery
		m.Deliveries = carried + int(xdc) + 1
	case dv.Redelivered: // a classic queue counts no further
		m.Deliveries = carried + 2
	default:
		m.Deliveries = carried + 1
	}
	if m.ID == "" {
		// No message id: a stable one from what the message is.
		h := sha256.New()
		h.Write([]byte(dv.Exchange))
		h.Write([]byte{0})
		h.Write([]byte(dv.RoutingKey))
		h.Write([]byte{0})
		h.Write(dv.Body)
		m.ID = "sha256:" + hex.EncodeToString(h.Sum(nil)[:16])
	}
	if d.laneKey {
		m.Lane = m.Key
	}
	return m
}

func toInt64(v any) int64 {
	switch n := v.(type) {
	case int64:
		return n
	case int32:
		return int64(n)
	case int16:
		return int64(n)
	case int8:
		return int64(n)
	case int:
		return int64(n)
	case uint8:
		return int64(n)
	case uint16:
		return int64(n)
	case uint32:
		return int64(n)
	}
	return -1
}

// headerString turns a header value into a string header, where it is a
// scalar; tables and arrays (x-death) are left to Message.As.
func headerString(v any) (string, bool) {
	switch x := v.(type) {
	case string:
		return x, true
	case []byte:
		return string(x), true
	case bool:
		return strconv.FormatBool(x), true
	case time.Time:
		return x.UTC().Format(time.RFC3339), true
	case float32:
		return strconv.FormatFloat(float64(x), 'g', -1, 32), true
	case float64:
		return strconv.FormatFloat(x, 'g', -1, 64), true
	}
	switch v.(type) {
	case int64, int32, int16, int8, int, uint8, uint16, uint32:
		return strconv.FormatInt(toInt64(v), 10), true
	}
	return "", false
}

func formatHistory(h driver.History) string {
	ff := int64(0)
	if !h.FirstFailure.IsZero() {
		ff = h.FirstFailure.UnixNano()
	}
	return fmt.Sprintf("%d,%d,%d,%d", h.Runs, h.Deliveries, h.Unseen, ff)
}

func parseHistory(s string) driver.History {
	f := strings.Split(s, ",")
	if len(f) != 4 {
		return driver.History{}
	}
	var n [4]int64
	for i, x := range f {
		v, err := strconv.ParseInt(x, 10, 64)
		if err != nil || v < 0 {
			return driver.History{}
		}
		n[i] = v
	}
	h := driver.History{Runs: int(n[0]), Deliveries: int(n[1]), Unseen: int(n[2])}
	if n[3] > 0 {
		h.FirstFailure = time.Unix(0, n[3])
	}
	return h
}

// As serves consumer.Message.As: a *amqp091.Delivery target gets a copy of
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
// ErrStaleDelivery in a *driver.SettleError, as the broker requeued it.
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

// lagTimeout bounds Lag when its context has no deadline.
const lagTimeout = 10 * time.Second

// Lag reports the queue's ready messages (Messages, from a passive declare)
// and this driver's deliveries not yet settled (InFlight): those the broker
// pushed ahead that Fetch has not taken yet (the prefetch) and those the
// loop holds (running, queued behind their key, waiting for their
// settlement). Messages plus InFlight, the loop's Health.Lag, is what is
// not yet done: the queue's ready and unacked messages when this is its
// only consumer. The broker's AMQP interface tells neither the other
// consumers' unacked count nor the age of the oldest message.
func (d *queueDriver) Lag(ctx context.Context) (driver.Lag, error) {
	ready, _, err := d.b.queueDepth(ctx, d.queue)
	if err != nil {
		return driver.Lag{}, err
	}
	l := driver.Lag{Messages: int64(ready), InFlight: 0}
	d.mu.Lock()
	s := d.cur
	d.mu.Unlock()
	if s != nil {
		s.mu.Lock()
		l.InFlight = int64(s.open)
		s.mu.Unlock()
		l.InFlight += int64(len(s.deliveries))
	}
	return l, nil
}

// queueDepth returns the ready messages and consumers of queue, asked on
// the consuming connection (an alarm blocks only publishing connections).
// Bounded by ctx (or lagTimeout when ctx has no deadline): the channel's
// methods take no context.
func (b *Broker) queueDepth(ctx context.Context, queue string) (int, int, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, lagTimeout)
		defer cancel()
	}
	conn, err := b.consConn.get(ctx)
	if err != nil {
		return 0, 0, err
	}
	var q amqp.Queue
	err = withContext(ctx, func() error {
		ch, err := conn.Channel()
		if err != nil {
			return err
		}
		defer closeChannel(ch)
		q, err = ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		return err
	})
	if err != nil {
		return 0, 0, fmt.Errorf("rabbit: depth of %q: %w", queue, err)
	}
	return q.Messages, q.Consumers, nil
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
