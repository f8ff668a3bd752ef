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
// returns and its close notification.
type pubChannel struct {
	ch       *amqp.Channel
	closed   chan struct{} // closed once closeErr is set
	closeErr *amqp.Error
	gone     chan struct{} // closed when the drain goroutine exits
	barrier  chan chan struct{}

	mu    sync.Mutex
	index map[retKey][]*pending
}

type retKey struct{ id, exchange, rk string }

// pending is one published message waiting for its confirm.
type pending struct {
	k        retKey
	dc       *amqp.DeferredConfirmation
	returned *amqp.Return
}

func isDone(dc *amqp.DeferredConfirmation) bool {
	select {
	case <-dc.Done():
		return true
	default:
		return false
	}
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
		_ = ch.Close()
		return nil, fmt.Errorf("rabbit: confirm mode: %w", err)
	}
	pc := &pubChannel{
		ch:      ch,
		closed:  make(chan struct{}),
		gone:    make(chan struct{}),
		barrier: make(chan chan struct{}),
		index:   make(map[retKey][]*pending),
	}
	// Unbuffered: the library's reader hands a return over before it
	// dispatches the confirm of the same message, so the drain goroutine has
	// the return in hand before that confirm resolves; the barrier then
	// makes sure it was recorded.
	returns := ch.NotifyReturn(make(chan amqp.Return))
	closes := ch.NotifyClose(make(chan *amqp.Error, 1))
	go pc.drain(returns, closes)
	p.ch = pc
	return pc, nil
}

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

// sync waits until every return the library handed over so far is recorded.
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
	for _, pd := range pc.index[k] {
		if pd.returned != nil {
			continue
		}
		ret := r
		pd.returned = &ret
		return
	}
}

func (pc *pubChannel) register(k retKey) *pending {
	pd := &pending{k: k}
	pc.mu.Lock()
	pc.index[k] = append(pc.index[k], pd)
	pc.mu.Unlock()
	return pd
}

func (pc *pubChannel) setDC(pd *pending, dc *amqp.DeferredConfirmation) {
	pc.mu.Lock()
	pd.dc = dc
	pc.mu.Unlock()
}

func (pc *pubChannel) unregister(pd *pending) {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	l := pc.index[pd.k]
	for i, x := range l {
		if x == pd {
			l = append(l[:i], l[i+1:]...)
			break
		}
	}
	if len(l) == 0 {
		delete(pc.index, pd.k)
	} else {
		pc.index[pd.k] = l
	}
}

// blockedErr says the broker blocks the connection, when it does.
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
		it := &items[i]
		pd := pc.register(retKey{it.pub.MessageId, exchange, it.rk})
		dc, err := pc.ch.PublishWithDeferredConfirm(exchange, it.rk, true, false, it.pub)
		if err != nil || dc == nil {
			pc.unregister(pd)
			<-p.window
			if err == nil {
				err = errors.New("channel not in confirm mode")
			}
			errs[i] = fmt.Errorf("rabbit: publish to %q: %w", dest, err)
			continue
		}
		pc.setDC(pd, dc)
		pends[i], pcs[i] = pd, pc
		sent++
	}
	if sent == 0 {
		return errs
	}

	// Wait for the confirms, in order.
	cut := len(items)
wait:
	for i, pd := range pends {
		if pd == nil {
			continue
		}
		select {
		case <-pd.dc.Done():
		case <-ctx.Done():
			cut = i
			break wait
		case <-p.b.closed:
			cut = i
			break wait
		}
	}
	synced := map[*pubChannel]bool{}
	for i, pd := range pends {
		if pd == nil {
			continue
		}
		pc := pcs[i]
		if i >= cut && !isDone(pd.dc) {
			if p.b.isClosed() {
				errs[i] = ErrClosed
			} else {
				errs[i] = p.ctxErr(ctx, dest)
			}
			// The confirm comes later, or the channel closes: either
			// resolves it and frees its place in the window.
			go func() {
				<-pd.dc.Done()
				pc.unregister(pd)
				<-p.window
			}()
			continue
		}
		if !synced[pc] {
			pc.sync()
			synced[pc] = true
		}
		pc.mu.Lock()
		ret := pd.returned
		pc.mu.Unlock()
		ack := pd.dc.Acked()
		pc.unregister(pd)
		<-p.window
		switch {
		case ret != nil:
			errs[i] = fmt.Errorf("rabbit: publish to %q with routing key %q: %w: %d %s", dest, items[i].rk, ErrUnroutable, ret.ReplyCode, ret.ReplyText)
		case ack:
		case pc.ch.IsClosed():
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
