package rabbit

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
)

// ExchangePrefix starts a destination that names an exchange:
// Publish(ctx, ExchangePrefix+"events", …), which ToExchange("events")
// returns, publishes to the exchange events, each message's Key its routing
// key. The string form is for configuration (an environment variable, a
// command's flag), where code would call ToExchange. No queue can be named
// so: queue names starting "amq." are the broker's.
const ExchangePrefix = "amq.exchange/"

// ToExchange returns the destination that publishes to exchange, with each
// message's Key as its routing key, as the exchange's bindings (or, on a
// consistent-hash exchange such as Partitioned's, the hash of the Key)
// route it. A message no binding routes fails with [ErrUnroutable]; an
// exchange that does not exist fails the message with [ErrRefused] and the
// broker's 404. ToExchange("") is the default exchange, which routes a
// message to the queue its Key names.
func ToExchange(exchange string) string { return ExchangePrefix + exchange }

// QueuePrefix starts a destination that names a queue outright:
// QueuePrefix+"orders" is the same destination as "orders".
//
// Deprecated: a plain name is a queue; use the queue's name. (It is kept
// because configurations written when a plain name was an exchange say
// amq.default/QUEUE.)
const QueuePrefix = "amq.default/"

// ToQueue returns the destination that publishes straight to queue.
//
// Deprecated: a plain name is a queue: ToQueue(queue) publishes as queue
// does. Use the queue's name, and [ToExchange] for an exchange.
func ToQueue(queue string) string { return QueuePrefix + queue }

// route returns the exchange destination publishes to and, when it names a
// queue, the queue (the routing key of every message).
func route(destination string) (exchange, queue string, toQueue bool) {
	if ex, ok := strings.CutPrefix(destination, ExchangePrefix); ok {
		return ex, "", false
	}
	if q, ok := strings.CutPrefix(destination, QueuePrefix); ok {
		return "", q, true
	}
	return "", destination, true
}

var _ consumer.DestinationNamer = (*Broker)(nil)

// DestinationName returns the queue or exchange a destination names, as
// the user named it: the exchange of ToExchange(exchange), else the queue.
// It makes [consumer.TracePublisher]'s spans say "send events" and
// messaging.destination.name "events" for ToExchange("events"), not the
// prefix.
func (b *Broker) DestinationName(destination string) string {
	for _, prefix := range []string{ExchangePrefix, QueuePrefix} {
		if name, ok := strings.CutPrefix(destination, prefix); ok && name != "" {
			return name
		}
	}
	return destination
}

// HeaderKey carries Message.Key where the routing key cannot: on messages
// published straight to a queue (whose routing key is the queue's name) and
// on retries that went through a delay queue. Consumers read Key from it
// when present, else from the routing key of a message that came through
// an exchange (through the default exchange, a message without HeaderKey
// has no Key); it is not among the Headers they see.
const HeaderKey = "ferry-key"

// Headers the driver keeps to itself on delayed retries: the deliveries the
// message had before it was republished, and the handler runs the loop
// counted ([driver.History]).
const (
	headerDeliveries = "ferry-deliveries"
	headerHistory    = "ferry-history"
)

// pubItem is one message on its way to the broker.
type pubItem struct {
	// exchange, when delayed, is where the message goes instead of the
	// call's exchange: the top level of delayed publish (see schedule.go).
	exchange string
	delayed  bool
	rk       string // routing key
	key      string // Message.Key, for per-key order
	pub      amqp.Publishing
	refused  error // why it is not sent, found before sending
}

// publisher publishes in confirm mode over the Broker's publish connection,
// pipelined: every message of a call is sent before any confirm is awaited,
// within a window of unconfirmed messages shared by all calls.
//
// Each destination (a queue, an exchange) has a channel of its own. What
// makes the broker close a publishing channel is a refusal of the
// destination (404 no such exchange, 403 access refused) or, past
// [WithMaxMessageSize], a body over its max_message_size; a closed channel
// fails every unconfirmed message on it. (A queue that does not exist
// closes nothing: its messages come back as basic.return.) On one channel
// shared by every destination, a single publish to a missing exchange
// failed the messages in flight of every other call, which may or may not
// have been taken, so callers that retry published duplicates. A channel
// per destination confines the failure to messages the broker refuses
// anyway. (The alternative, one channel and a recovery re-sending what was
// unconfirmed, re-sends messages the broker had taken, duplicates in the
// queues of healthy destinations, each time any destination is refused;
// and it cannot tell which message was.) What closes the connection, or
// the channel for one message only, is checked before sending (see
// [LimitError]). The channels are by destination, not by exchange: every
// queue is published to through the default exchange.
type publisher struct {
	b   *Broker
	win window

	mu  sync.Mutex
	chs map[string]*pubChannel // by destination
}

// idlePubChannels is how many destinations' channels the publisher keeps
// before it closes those with nothing in flight when it opens another.
const idlePubChannels = 32

func newPublisher(b *Broker) *publisher {
	return &publisher{b: b, win: window{size: b.cfg.window}, chs: make(map[string]*pubChannel)}
}

// window bounds the unconfirmed messages of all calls: like a raw client's
// ring of deferred confirmations, a publish waits for the oldest confirm
// when the ring is full. (Publishers racing for the last place may exceed
// it by one message each.)
type window struct {
	size int
	mu   sync.Mutex
	ring []*amqp.DeferredConfirmation
}

// wait returns once there is room, or ctx or stop end.
func (w *window) wait(ctx context.Context, stop <-chan struct{}) error {
	for {
		w.mu.Lock()
		for len(w.ring) > 0 && isDone(w.ring[0]) {
			w.ring[0] = nil
			w.ring = w.ring[1:]
		}
		if len(w.ring) < w.size {
			w.mu.Unlock()
			return nil
		}
		oldest := w.ring[0]
		w.mu.Unlock()
		select {
		case <-oldest.Done():
		case <-ctx.Done():
			return ctx.Err()
		case <-stop:
			return ErrClosed
		}
	}
}

func (w *window) add(dc *amqp.DeferredConfirmation) {
	w.mu.Lock()
	w.ring = append(w.ring, dc)
	w.mu.Unlock()
}

func isDone(dc *amqp.DeferredConfirmation) bool {
	select {
	case <-dc.Done():
		return true
	default:
		return false
	}
}

// pubChannel is one confirm-mode channel, for one destination, and the
// goroutine that drains its returns and its close notification.
type pubChannel struct {
	ch       *amqp.Channel
	frameMax int           // the connection's negotiated frame_max
	users    int           // calls between channel and release, under publisher.mu
	closed   chan struct{} // closed once closeErr is set
	closeErr *amqp.Error
	gone     chan struct{} // closed when drain exits
	barrier  chan chan struct{}

	mu      sync.Mutex
	byRoute map[string][]*pending // by message id
}

type retKey struct{ id, exchange, rk string }

// pending is one published message waiting for its confirm.
type pending struct {
	k        retKey
	dc       *amqp.DeferredConfirmation
	returned *amqp.Return
}

// channel returns the live publishing channel of destination dest,
// opening one (and the connection, when it is lost) when there is none. The
// caller releases it once its message is sent.
func (p *publisher) channel(ctx context.Context, dest string) (*pubChannel, error) {
	p.mu.Lock()
	if pc := p.chs[dest]; pc != nil && !pc.ch.IsClosed() {
		pc.users++
		p.mu.Unlock()
		return pc, nil
	}
	p.mu.Unlock()
	// Not under p.mu: a dial is waited for with each caller's own context.
	conn, err := p.b.pubConn.get(ctx)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if pc := p.chs[dest]; pc != nil && !pc.ch.IsClosed() {
		pc.users++
		return pc, nil
	}
	p.closeIdle()
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("rabbit: open publishing channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		closeChannel(ch)
		return nil, fmt.Errorf("rabbit: confirm mode: %w", err)
	}
	pc := &pubChannel{
		ch:       ch,
		frameMax: conn.Config.FrameSize,
		users:    1,
		closed:   make(chan struct{}),
		gone:     make(chan struct{}),
		barrier:  make(chan chan struct{}),
		byRoute:  make(map[string][]*pending),
	}
	// Unbuffered: the library's reader hands a return to drain before it
	// reads the next frame, so drain holds the return before the confirm
	// of the same message resolves; a barrier then makes sure it was
	// recorded.
	returns := ch.NotifyReturn(make(chan amqp.Return))
	closes := ch.NotifyClose(make(chan *amqp.Error, 1))
	go pc.drain(returns, closes)
	p.chs[dest] = pc
	return pc, nil
}

// release ends a use of pc that channel began.
func (p *publisher) release(pc *pubChannel) {
	p.mu.Lock()
	pc.users--
	p.mu.Unlock()
}

// closeIdle, under p.mu, forgets closed channels and, while
// idlePubChannels or more are left, closes those that no call uses and
// that have nothing in flight.
func (p *publisher) closeIdle() {
	if len(p.chs) < idlePubChannels {
		return
	}
	for d, pc := range p.chs {
		if pc.ch.IsClosed() {
			delete(p.chs, d)
		}
	}
	for d, pc := range p.chs {
		if len(p.chs) < idlePubChannels {
			return
		}
		if pc.users == 0 && pc.idle() {
			delete(p.chs, d)
			go closeChannel(pc.ch)
		}
	}
}

// idle reports whether no message on pc waits for its confirm.
func (pc *pubChannel) idle() bool {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	return len(pc.byRoute) == 0
}

// lostErr is the error of a message whose channel closed before its
// confirm: [ErrRefused] with the broker's reason when the broker closed the
// channel (a channel exception: 403, 404, 406), [ErrNotConfirmed] otherwise
// (the connection was lost or closed: it may or may not have been taken).
func (pc *pubChannel) lostErr(dest string) error {
	var e *amqp.Error
	select {
	case <-pc.closed:
		e = pc.closeErr
	case <-time.After(100 * time.Millisecond):
	}
	switch {
	case e != nil && e.Server && e.Recover:
		return fmt.Errorf("rabbit: publish to %q: %w: %w", dest, ErrRefused, e)
	case e != nil:
		return fmt.Errorf("rabbit: publish to %q: %w: %w", dest, ErrNotConfirmed, e)
	}
	return fmt.Errorf("rabbit: publish to %q: %w", dest, ErrNotConfirmed)
}

// drain records returns until the channel's notifications end, and answers
// barriers. It never blocks on anything else.
func (pc *pubChannel) drain(returns chan amqp.Return, closes chan *amqp.Error) {
	defer close(pc.gone)
	for returns != nil || closes != nil {
		select {
		case r, ok := <-returns:
			if !ok {
				returns = nil
				continue
			}
			pc.markReturned(r)
		case e, ok := <-closes:
			if !ok {
				closes = nil
				select {
				case <-pc.closed:
				default:
					close(pc.closed)
				}
				continue
			}
			pc.closeErr = e
			close(pc.closed)
		case reply := <-pc.barrier:
			close(reply)
		}
	}
}

// sync waits until every return handed to drain so far is recorded.
func (pc *pubChannel) sync() {
	reply := make(chan struct{})
	select {
	case pc.barrier <- reply:
		<-reply
	case <-pc.gone:
	}
}

// markReturned marks the earliest message not yet returned with the
// return's id, exchange and routing key: the broker returns messages in
// publish order. (Two messages of one id, exchange and routing key in
// flight at once, of which only the later is unroutable, would be told
// apart wrongly; routing the same way, both are returned.)
func (pc *pubChannel) markReturned(r amqp.Return) {
	k := retKey{r.MessageId, r.Exchange, r.RoutingKey}
	pc.mu.Lock()
	defer pc.mu.Unlock()
	for _, pd := range pc.byRoute[k.id] {
		if pd.k == k && pd.returned == nil {
			ret := r
			pd.returned = &ret
			return
		}
	}
}

func (pc *pubChannel) forget(pd *pending) {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	l := pc.byRoute[pd.k.id]
	for i, x := range l {
		if x == pd {
			l = append(l[:i], l[i+1:]...)
			break
		}
	}
	if len(l) == 0 {
		delete(pc.byRoute, pd.k.id)
	} else {
		pc.byRoute[pd.k.id] = l
	}
}

// publish sends one message, registered for its return before it goes.
func (pc *pubChannel) publish(exchange string, it *pubItem) (*pending, error) {
	pd := &pending{k: retKey{it.pub.MessageId, exchange, it.rk}}
	pc.mu.Lock()
	pc.byRoute[pd.k.id] = append(pc.byRoute[pd.k.id], pd)
	pc.mu.Unlock()
	dc, err := pc.ch.PublishWithDeferredConfirm(exchange, it.rk, true, false, it.pub)
	if err == nil && dc == nil {
		err = fmt.Errorf("channel not in confirm mode")
	}
	if err != nil {
		pc.forget(pd)
		return nil, err
	}
	pd.dc = dc
	return pd, nil
}

// ctxErr is the error of a publish whose context ended: [ErrBlocked] too when
// the broker blocks the connection.
func (p *publisher) ctxErr(ctx context.Context, dest string) error {
	if reason, _ := p.b.pubConn.blockedWait(); reason != "" || p.b.pubConn.blocked.Load() != nil {
		return fmt.Errorf("rabbit: publish to %q: %w (%s): %w", dest, ErrBlocked, reason, ctx.Err())
	}
	return fmt.Errorf("rabbit: publish to %q: %w", dest, ctx.Err())
}

// publishRaw publishes items to exchange, pipelined, on the channel of
// destination dest, and returns each item's error (nil once the broker
// confirmed it and did not return it).
func (p *publisher) publishRaw(ctx context.Context, exchange, dest string, items []pubItem) []error {
	errs := make([]error, len(items))
	pends := make([]*pending, len(items))
	pcs := make([]*pubChannel, len(items))
	sent := 0
	maxBody := p.b.maxMessageSize()
	for i := range items {
		if p.b.isClosed() {
			errs[i] = fmt.Errorf("rabbit: publish to %q: %w", dest, ErrClosed)
			continue
		}
		if err := items[i].refused; err != nil {
			errs[i] = fmt.Errorf("rabbit: publish to %q: %w", dest, err)
			continue
		}
		ex := exchange
		if items[i].delayed {
			ex = items[i].exchange
		}
		props, err := checkLimits(ex, &items[i], maxBody)
		if err != nil {
			errs[i] = fmt.Errorf("rabbit: publish to %q: %w", dest, err)
			continue
		}
		if err := p.win.wait(ctx, p.b.closed); err != nil {
			errs[i] = p.waitErr(ctx, dest)
			continue
		}
		if _, unblocked := p.b.pubConn.blockedWait(); unblocked != nil {
			select {
			case <-unblocked:
			case <-ctx.Done():
				errs[i] = p.waitErr(ctx, dest)
				continue
			case <-p.b.closed:
				errs[i] = p.waitErr(ctx, dest)
				continue
			}
		}
		pc, err := p.channel(ctx, dest)
		if err != nil {
			// One dial per call: the messages left fail with its error
			// (the next call dials again, after the shared backoff).
			for j := i; j < len(items); j++ {
				errs[j] = err
			}
			break
		}
		if err := checkFrame(props, pc.frameMax); err != nil {
			p.release(pc)
			errs[i] = fmt.Errorf("rabbit: publish to %q: %w", dest, err)
			continue
		}
		pd, err := pc.publish(ex, &items[i])
		p.release(pc)
		if err != nil {
			errs[i] = fmt.Errorf("rabbit: publish to %q: %w", dest, err)
			continue
		}
		p.win.add(pd.dc)
		pends[i], pcs[i] = pd, pc
		sent++
	}
	if sent == 0 {
		return errs
	}
	// First every confirm (or the end of the wait), then one barrier per
	// channel: the library hands a message's basic.return to drain before
	// it resolves the message's confirm, so a barrier passed after the last
	// confirm resolved covers the returns of every message confirmed
	// before it. (One barrier after the first confirm did not: the returns
	// of later messages could still be on their way to markReturned.)
	var stop bool
	for _, pd := range pends {
		if pd == nil || stop {
			continue
		}
		select {
		case <-pd.dc.Done():
		case <-ctx.Done():
			stop = true
		case <-p.b.closed:
			stop = true
		}
	}
	// Which confirms are in is fixed before the barriers: a confirm that
	// resolves after its channel's barrier is treated as not in.
	done := make([]bool, len(pends))
	for i, pd := range pends {
		done[i] = pd != nil && isDone(pd.dc)
	}
	synced := map[*pubChannel]bool{}
	for i := range pends {
		if done[i] && !synced[pcs[i]] {
			pcs[i].sync()
			synced[pcs[i]] = true
		}
	}
	for i, pd := range pends {
		if pd == nil {
			continue
		}
		pc := pcs[i]
		if !done[i] {
			errs[i] = p.waitErr(ctx, dest)
			// Forget it once the confirm comes, or the channel closes.
			go func() {
				<-pd.dc.Done()
				pc.forget(pd)
			}()
			continue
		}
		pc.mu.Lock()
		ret := pd.returned
		pc.mu.Unlock()
		switch {
		case ret != nil:
			errs[i] = p.unroutableErr(exchange, dest, items[i].rk, ret)
		case pd.dc.Acked():
		case pc.ch.IsClosed():
			errs[i] = pc.lostErr(dest)
		default:
			errs[i] = fmt.Errorf("rabbit: publish to %q: %w", dest, ErrNacked)
		}
		// Forgotten only now: a channel with nothing in flight may be
		// closed as idle, which must not read as this message's loss.
		pc.forget(pd)
	}
	return errs
}

// unroutableErr is the error of a message the broker returned. Through the
// default exchange the routing key is a queue's name, and a return means no
// queue has it: the error names the queue, and when it is the destination
// the user gave, says how to name an exchange instead (an exchange's name
// given as a plain destination is taken for a queue's).
func (p *publisher) unroutableErr(exchange, dest, rk string, ret *amqp.Return) error {
	if exchange != "" {
		return fmt.Errorf("rabbit: publish to %q with routing key %q: %w: %d %s", dest, rk, ErrUnroutable, ret.ReplyCode, ret.ReplyText)
	}
	if rk != p.b.DestinationName(dest) {
		return fmt.Errorf("rabbit: publish to %q: no queue %q: %w: %d %s", dest, rk, ErrUnroutable, ret.ReplyCode, ret.ReplyText)
	}
	hint := "a plain destination names a queue; rabbit.ToExchange names an exchange"
	if p.b.cfg.topology.hasExchange(rk) {
		hint = fmt.Sprintf("the Topology declares an exchange %q: publish to rabbit.ToExchange(%q) to use it", rk, rk)
	}
	return fmt.Errorf("rabbit: publish to queue %q: no such queue (%s): %w: %d %s", rk, hint, ErrUnroutable, ret.ReplyCode, ret.ReplyText)
}

// waitErr is the error of a message whose wait ended early.
func (p *publisher) waitErr(ctx context.Context, dest string) error {
	if p.b.isClosed() {
		return fmt.Errorf("rabbit: publish to %q: %w", dest, ErrClosed)
	}
	return p.ctxErr(ctx, dest)
}

// Publish sends msgs to destination and returns nil once the broker has
// confirmed every one of them (publisher confirms; on a quorum queue, once
// a majority wrote it). destination is a queue, as on every broker: the
// message goes through the default exchange with the queue's name as
// routing key, and its Key travels in the [HeaderKey] header, from which
// consumers read it. ToExchange(exchange) publishes to an exchange instead,
// each message's Key its routing key. Messages are published persistent
// and mandatory: one that no queue takes fails with [ErrUnroutable] (for a
// queue: there is no queue of that name; the error names it), one the
// broker nacks with [ErrNacked], one it refuses by closing the destination's
// channel (no such exchange) with [ErrRefused] and its reason, one over a
// limit of AMQP or the broker with a *LimitError ([ErrTooLong], [ErrTooLarge])
// without being sent, each in a *[consumer.PublishError] naming it, while
// the others are published. Each destination has a channel of its own, so
// a refused message never fails the messages of other destinations (see
// the package documentation), and an unroutable one fails no other.
//
// The messages of a call go out pipelined, within the Broker's confirm
// window, except that a message waits for the confirm of the message of the
// same Key before it in the call: when that one fails, it fails too with
// [ErrEarlierFailed] and is never sent, so a key's messages never overtake
// one another. Messages without a Key are not ordered.
//
// The message's ID travels as the AMQP message-id (a unique one is made when
// it is empty) and its Headers as string header values. While the broker
// blocks the connection (a memory or disk alarm), Publish waits; when ctx
// ends first, the messages not confirmed fail with an error matching both
// [ErrBlocked] and ctx's error.
//
// A message to a queue with a NotBefore still ahead is held until then, to
// the second (its delay is rounded up to whole seconds), through the delay
// levels (see the package documentation, "Delayed publish"); nil means the
// broker holds it durably. Its queue must exist: the first delayed message
// of a queue binds it, and a queue that does not exist fails the messages
// held for it. A delay past [MaxDelay] fails with
// [consumer.ErrDelayTooLong], and one to an exchange (ToExchange) with
// [consumer.ErrDelayNotSupported], unsent.
func (b *Broker) Publish(ctx context.Context, destination string, msgs ...consumer.Message) error {
	start := time.Now()
	err := b.publish(ctx, destination, msgs)
	if len(msgs) > 0 {
		b.metrics.Record(ctx, b.DestinationName(destination), len(msgs), start, err)
	}
	return err
}

func (b *Broker) publish(ctx context.Context, destination string, msgs []consumer.Message) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if b.isClosed() {
		return fmt.Errorf("rabbit: publish to %q: %w", destination, ErrClosed)
	}
	if len(msgs) == 0 {
		return nil
	}
	exchange, queue, toQueue := route(destination)
	now := time.Now()
	items := make([]pubItem, len(msgs))
	wave := make([]int, len(msgs))
	seen := map[string]int{}
	waves := 1
	delayed := false // some message goes through the delay levels
	for i := range msgs {
		m := &msgs[i]
		it := &items[i]
		it.key = m.Key
		it.rk = m.Key
		var h amqp.Table
		if len(m.Headers) > 0 || (toQueue && m.Key != "") {
			h = make(amqp.Table, len(m.Headers)+1)
			for k, v := range m.Headers {
				h[k] = v
			}
		}
		if toQueue {
			it.rk = queue
			if m.Key != "" {
				h[HeaderKey] = m.Key
			}
		}
		id := m.ID
		if id == "" {
			id = b.newID()
		}
		it.pub = amqp.Publishing{
			Headers:      h,
			DeliveryMode: amqp.Persistent,
			MessageId:    id,
			Timestamp:    now,
			Body:         m.Body,
		}
		fitDeadLetter(it, toQueue)
		if m.NotBefore.After(now) {
			delay := scheduleDelay(m.NotBefore, now)
			switch {
			case m.NotBefore.Sub(now) > MaxDelay:
				// Before rounding: Sub saturates for a time centuries
				// ahead, and rounding the largest Duration up overflows.
				it.refused = fmt.Errorf("NotBefore %s ahead, beyond the %s the delay levels hold: %w", m.NotBefore.Sub(now).Round(time.Second), MaxDelay, consumer.ErrDelayTooLong)
			case !toQueue:
				it.refused = fmt.Errorf("NotBefore %s ahead on exchange %q: a delayed message goes to a queue (its routing key spells the delay), so an exchange's own routing is lost: %w",
					m.NotBefore.Sub(now).Round(time.Millisecond), exchange, consumer.ErrDelayNotSupported)
			default:
				it.delayed = true
				it.exchange, it.rk = scheduleRoute(delay, queue)
				delayed = true
			}
		}
		if m.Key != "" {
			wave[i] = seen[m.Key]
			seen[m.Key]++
			waves = max(waves, wave[i]+1)
		}
	}

	if delayed {
		if err := b.prepareSchedule(ctx, queue); err != nil {
			for i := range items {
				if items[i].delayed && items[i].refused == nil {
					items[i].refused = err
				}
			}
		}
	}

	var perr *consumer.PublishError
	fail := func(i int, err error) {
		if items[i].delayed && errors.Is(err, ErrUnroutable) {
			// A level is gone (deleted by hand): declare them again.
			b.sched.forget()
			err = fmt.Errorf("rabbit: publish to %q: a delay level is missing (the levels are declared again at the next call): %w", destination, err)
		}
		if perr == nil {
			perr = &consumer.PublishError{}
		}
		perr.Failed = append(perr.Failed, consumer.FailedMessage{Index: i, Err: err})
	}
	if waves == 1 {
		for i, err := range b.pub.publishRaw(ctx, exchange, destination, items) {
			if err != nil {
				fail(i, err)
			}
		}
		return publishResult(perr)
	}
	failedKeys := map[string]bool{}
	for w := range waves {
		var idx []int
		var batch []pubItem
		for i := range items {
			if wave[i] != w {
				continue
			}
			if failedKeys[items[i].key] {
				fail(i, fmt.Errorf("rabbit: publish to %q: %w", destination, ErrEarlierFailed))
				continue
			}
			idx = append(idx, i)
			batch = append(batch, items[i])
		}
		for j, err := range b.pub.publishRaw(ctx, exchange, destination, batch) {
			if err != nil {
				fail(idx[j], err)
				if k := batch[j].key; k != "" {
					failedKeys[k] = true
				}
			}
		}
	}
	if perr != nil {
		sortFailed(perr)
	}
	return publishResult(perr)
}

func publishResult(perr *consumer.PublishError) error {
	if perr == nil {
		return nil
	}
	return perr
}

func sortFailed(perr *consumer.PublishError) {
	f := perr.Failed
	for i := 1; i < len(f); i++ {
		for j := i; j > 0 && f[j].Index < f[j-1].Index; j-- {
			f[j], f[j-1] = f[j-1], f[j]
		}
	}
}
