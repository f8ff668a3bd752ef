package rabbit

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
)

// QueuePrefix starts a destination that names a queue instead of an
// exchange: Publish(ctx, QueuePrefix+"orders", …) publishes through the
// default exchange straight to the queue orders. No exchange can be named
// so (names starting "amq." belong to the broker). See ToQueue.
const QueuePrefix = "amq.default/"

// ToQueue returns the destination that publishes straight to queue.
func ToQueue(queue string) string { return QueuePrefix + queue }

// HeaderKey carries Message.Key where the routing key cannot: on messages
// published straight to a queue (whose routing key is the queue's name) and
// on retries that went through a delay queue. Consumers read Key from it
// when present and from the routing key otherwise; it is not among the
// Headers they see.
const HeaderKey = "ferry-key"

// Headers the driver keeps to itself on delayed retries: the deliveries the
// message had before it was republished, and the handler runs the loop
// counted (driver.History).
const (
	headerDeliveries = "ferry-deliveries"
	headerHistory    = "ferry-history"
)

// pubItem is one message on its way to the broker.
type pubItem struct {
	rk  string // routing key
	key string // Message.Key, for per-key order
	pub amqp.Publishing
}

// publisher publishes in confirm mode over the Broker's publish connection,
// pipelined: every message of a call is sent before any confirm is awaited,
// within a window of unconfirmed messages shared by all calls.
type publisher struct {
	b      *Broker
	window chan struct{}

	mu sync.Mutex
	ch *pubChannel
}

func newPublisher(b *Broker) *publisher {
	return &publisher{b: b, window: make(chan struct{}, b.cfg.window)}
}

// pubChannel is one confirm-mode channel and the goroutine that drains its
// returns, confirms and close notification, in the order the broker sent
// them: a return comes before the confirm of the same message.
type pubChannel struct {
	p        *publisher
	ch       *amqp.Channel
	closed   chan struct{} // closed once closeErr is set
	closeErr *amqp.Error

	send sync.Mutex // held across taking a sequence number and publishing

	mu      sync.Mutex
	byTag   map[uint64]*pending
	byRoute map[retKey][]*pending
}

type retKey struct{ id, exchange, rk string }

// pending is one published message waiting for its confirm.
type pending struct {
	k        retKey
	tag      uint64
	done     chan struct{} // closed when resolved
	ack      bool
	returned *amqp.Return
	lost     bool // the channel closed first
}

// channel returns the live publishing channel, opening one (and the
// connection, when it is lost) when there is none.
func (p *publisher) channel(ctx context.Context) (*pubChannel, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if pc := p.ch; pc != nil && !pc.ch.IsClosed() {
		return pc, nil
	}
	conn, err := p.b.pubConn.get(ctx)
	if err != nil {
		return nil, err
	}
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("rabbit: open publishing channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		closeChannel(ch)
		return nil, fmt.Errorf("rabbit: confirm mode: %w", err)
	}
	pc := &pubChannel{
		p:       p,
		ch:      ch,
		closed:  make(chan struct{}),
		byTag:   make(map[uint64]*pending),
		byRoute: make(map[retKey][]*pending),
	}
	// Unbuffered: the library's reader hands each notification to drain
	// before it reads the next frame, so drain sees them in the broker's
	// order and always has the return in hand before the confirm.
	returns := ch.NotifyReturn(make(chan amqp.Return))
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation))
	closes := ch.NotifyClose(make(chan *amqp.Error, 1))
	go pc.drain(returns, confirms, closes)
	p.ch = pc
	return pc, nil
}

// drain resolves pending messages until the channel's notifications end.
// It never blocks on anything but them.
func (pc *pubChannel) drain(returns chan amqp.Return, confirms chan amqp.Confirmation, closes chan *amqp.Error) {
	for returns != nil || confirms != nil || closes != nil {
		select {
		case r, ok := <-returns:
			if !ok {
				returns = nil
				continue
			}
			pc.markReturned(r)
		case c, ok := <-confirms:
			if !ok {
				confirms = nil
				continue
			}
			pc.resolve(c.DeliveryTag, c.Ack)
		case e, ok := <-closes:
			if !ok {
				closes = nil
				continue
			}
			pc.closeErr = e
			close(pc.closed)
		}
	}
	select {
	case <-pc.closed:
	default:
		close(pc.closed)
	}
	// Whatever is left was not confirmed before the channel closed.
	pc.mu.Lock()
	left := make([]*pending, 0, len(pc.byTag))
	for _, pd := range pc.byTag {
		left = append(left, pd)
	}
	pc.mu.Unlock()
	for _, pd := range left {
		pc.finish(pd, false, true)
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
	for _, pd := range pc.byRoute[k] {
		if pd.returned == nil {
			ret := r
			pd.returned = &ret
			return
		}
	}
}

func (pc *pubChannel) resolve(tag uint64, ack bool) {
	pc.mu.Lock()
	pd := pc.byTag[tag]
	pc.mu.Unlock()
	if pd != nil {
		pc.finish(pd, ack, false)
	}
}

// finish resolves pd, once, and gives its place in the window back.
func (pc *pubChannel) finish(pd *pending, ack, lost bool) {
	pc.mu.Lock()
	if _, ok := pc.byTag[pd.tag]; !ok {
		pc.mu.Unlock()
		return
	}
	delete(pc.byTag, pd.tag)
	l := pc.byRoute[pd.k]
	for i, x := range l {
		if x == pd {
			l = append(l[:i], l[i+1:]...)
			break
		}
	}
	if len(l) == 0 {
		delete(pc.byRoute, pd.k)
	} else {
		pc.byRoute[pd.k] = l
	}
	pd.ack, pd.lost = ack, lost
	pc.mu.Unlock()
	close(pd.done)
	<-pc.p.window
}

// publish sends one message and registers it under the sequence number the
// channel gives it.
func (pc *pubChannel) publish(exchange string, it *pubItem) (*pending, error) {
	pd := &pending{k: retKey{it.pub.MessageId, exchange, it.rk}, done: make(chan struct{})}
	pc.send.Lock()
	defer pc.send.Unlock()
	pd.tag = pc.ch.GetNextPublishSeqNo()
	pc.mu.Lock()
	pc.byTag[pd.tag] = pd
	pc.byRoute[pd.k] = append(pc.byRoute[pd.k], pd)
	pc.mu.Unlock()
	if err := pc.ch.Publish(exchange, it.rk, true, false, it.pub); err != nil {
		pc.mu.Lock()
		delete(pc.byTag, pd.tag)
		l := pc.byRoute[pd.k]
		if n := len(l); n > 0 && l[n-1] == pd {
			l = l[:n-1]
		}
		if len(l) == 0 {
			delete(pc.byRoute, pd.k)
		} else {
			pc.byRoute[pd.k] = l
		}
		pc.mu.Unlock()
		return nil, err
	}
	return pd, nil
}

// ctxErr is the error of a publish whose context ended: ErrBlocked too when
// the broker blocks the connection.
func (p *publisher) ctxErr(ctx context.Context, dest string) error {
	if reason, _ := p.b.pubConn.blockedWait(); reason != "" || p.b.pubConn.blocked.Load() != nil {
		return fmt.Errorf("rabbit: publish to %q: %w (%s): %w", dest, ErrBlocked, reason, ctx.Err())
	}
	return fmt.Errorf("rabbit: publish to %q: %w", dest, ctx.Err())
}

// publishRaw publishes items to exchange, pipelined, and returns each
// item's error (nil once the broker confirmed it and did not return it).
func (p *publisher) publishRaw(ctx context.Context, exchange, dest string, items []pubItem) []error {
	errs := make([]error, len(items))
	pends := make([]*pending, len(items))
	pcs := make([]*pubChannel, len(items))
	sent := 0
	for i := range items {
		if err := p.b.closedErr(); err != nil {
			errs[i] = err
			continue
		}
		select {
		case p.window <- struct{}{}:
		case <-ctx.Done():
			errs[i] = p.ctxErr(ctx, dest)
			continue
		case <-p.b.closed:
			errs[i] = ErrClosed
			continue
		}
		if _, unblocked := p.b.pubConn.blockedWait(); unblocked != nil {
			select {
			case <-unblocked:
			case <-ctx.Done():
				<-p.window
				errs[i] = p.ctxErr(ctx, dest)
				continue
			case <-p.b.closed:
				<-p.window
				errs[i] = ErrClosed
				continue
			}
		}
		pc, err := p.channel(ctx)
		if err != nil {
			<-p.window
			errs[i] = err
			continue
		}
		pd, err := pc.publish(exchange, &items[i])
		if err != nil {
			<-p.window
			errs[i] = fmt.Errorf("rabbit: publish to %q: %w", dest, err)
			continue
		}
		pends[i], pcs[i] = pd, pc
		sent++
	}
	if sent == 0 {
		return errs
	}
	var stop bool
	for i, pd := range pends {
		if pd == nil {
			continue
		}
		if !stop {
			select {
			case <-pd.done:
			case <-ctx.Done():
				stop = true
			case <-p.b.closed:
				stop = true
			}
		}
		select {
		case <-pd.done:
		default:
			// The confirm comes later, or the channel closes: either
			// resolves it and frees its place in the window.
			if p.b.isClosed() {
				errs[i] = fmt.Errorf("rabbit: publish to %q: %w", dest, ErrClosed)
			} else {
				errs[i] = p.ctxErr(ctx, dest)
			}
			continue
		}
		pc := pcs[i]
		switch {
		case pd.returned != nil:
			errs[i] = fmt.Errorf("rabbit: publish to %q with routing key %q: %w: %d %s", dest, items[i].rk, ErrUnroutable, pd.returned.ReplyCode, pd.returned.ReplyText)
		case pd.ack:
		case pd.lost:
			errs[i] = fmt.Errorf("rabbit: publish to %q: %w", dest, ErrNotConfirmed)
			select {
			case <-pc.closed:
				if pc.closeErr != nil {
					errs[i] = fmt.Errorf("rabbit: publish to %q: %w: %w", dest, ErrNotConfirmed, pc.closeErr)
				}
			case <-time.After(100 * time.Millisecond):
			}
		default:
			errs[i] = fmt.Errorf("rabbit: publish to %q: %w", dest, ErrNacked)
		}
	}
	return errs
}

func (b *Broker) closedErr() error {
	if b.isClosed() {
		return ErrClosed
	}
	return nil
}

// Publish sends msgs to destination and returns nil once the broker has
// confirmed every one of them (publisher confirms; on a quorum queue, once
// a majority wrote it). destination is an exchange, and each message's Key
// is its routing key; a destination made by ToQueue publishes straight to a
// queue, with the Key in the HeaderKey header. Messages are published
// persistent and mandatory: one that no queue takes (unroutable) fails with
// ErrUnroutable, one the broker refuses with ErrNacked, each in a
// *consumer.PublishError naming it, while the others are published.
//
// The messages of a call go out pipelined, within the Broker's confirm
// window, except that a message waits for the confirm of the message of the
// same Key before it in the call: when that one fails, it fails too with
// ErrEarlierFailed and is never sent, so a key's messages never overtake
// one another. Messages without a Key are not ordered.
//
// The message's ID travels as the AMQP message-id (a unique one is made when
// it is empty) and its Headers as string header values. While the broker
// blocks the connection (a memory or disk alarm), Publish waits; when ctx
// ends first, the messages not confirmed fail with an error matching both
// ErrBlocked and ctx's error.
func (b *Broker) Publish(ctx context.Context, destination string, msgs ...consumer.Message) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if b.isClosed() {
		return fmt.Errorf("rabbit: publish to %q: %w", destination, ErrClosed)
	}
	if len(msgs) == 0 {
		return nil
	}
	exchange, toQueue := destination, ""
	if q, ok := strings.CutPrefix(destination, QueuePrefix); ok {
		exchange, toQueue = "", q
	}
	now := time.Now()
	items := make([]pubItem, len(msgs))
	wave := make([]int, len(msgs))
	seen := map[string]int{}
	waves := 1
	for i := range msgs {
		m := &msgs[i]
		it := &items[i]
		it.key = m.Key
		it.rk = m.Key
		var h amqp.Table
		if len(m.Headers) > 0 || (toQueue != "" && m.Key != "") {
			h = make(amqp.Table, len(m.Headers)+1)
			for k, v := range m.Headers {
				h[k] = v
			}
		}
		if toQueue != "" {
			it.rk = toQueue
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
		if m.Key != "" {
			wave[i] = seen[m.Key]
			seen[m.Key]++
			waves = max(waves, wave[i]+1)
		}
	}

	var perr *consumer.PublishError
	fail := func(i int, err error) {
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
