package dlqcmd

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"regexp"
	"strings"
	"time"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/cmd/ferry/internal/cli"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
)

// HeaderRedrivenFrom is added to every redriven message: the dead-letter
// destination it was moved back from.
const HeaderRedrivenFrom = "ferry-redriven-from"

// DefaultGroup is the Kafka consumer group whose committed offsets on the
// dead-letter topic say how far redrives got.
const DefaultGroup = "ferry-redrive"

// RedriveConfig says what Redrive moves, where, and how fast.
type RedriveConfig struct {
	// Destination is the dead-letter queue or topic to move messages out of.
	Destination string
	// To is where they go: a queue (memory, SQS), a topic (Kafka), an
	// exchange or amq.default/QUEUE (RabbitMQ).
	To string
	// Group is the Kafka consumer group of the redrive (DefaultGroup when
	// empty); other brokers ignore it.
	Group string
	// Rate is the most messages moved per second; 0 is no limit.
	Rate float64
	// Filter picks the messages to move; the others stay (on Kafka, the
	// redrive's group passes over them: they stay in the topic).
	Filter Filter
	// Limit is the most messages to move; 0 moves every one.
	Limit int
	// Wait is how long a receive waits before the broker is asked whether
	// anything is left (default 2s).
	Wait time.Duration
	// Idle ends the run when no message came for this long although the
	// broker says some are left (held by another consumer, delayed, or
	// out of the filter's reach); default 40s, longer than SQS's default
	// visibility timeout, after which what a killed run held comes back.
	Idle time.Duration
	// Progress, when not nil, gets a progress bar rewritten in place (a
	// terminal).
	Progress io.Writer
}

// Result is how far a redrive got.
type Result struct {
	Moved       int           // published to To, then removed from Destination
	Skipped     int           // not matched by the filter, left where they were
	Left        int64         // what the broker said was left in Destination at the end (-1: not asked)
	Elapsed     time.Duration // how long it ran
	Interrupted bool          // ctx ended before the destination was empty
	// GaveUpWaiting is set when the run ended after Idle without a message
	// although the broker said more than the filter's leftovers were left
	// (in flight elsewhere, delayed, or beyond the filter's reach).
	GaveUpWaiting bool
}

// Filter is a conjunction of NAME=PATTERN conditions on a dead-lettered
// message. NAME is a field of its story (id, key, source, reason,
// consumer, host, error, error-kind, error-type) or any header; PATTERN
// matches the whole value, '*' standing for any run of characters.
type Filter []condition

type condition struct {
	name string
	re   *regexp.Regexp
}

// ParseFilter parses one NAME=PATTERN condition.
func ParseFilter(s string) (Filter, error) {
	name, pat, ok := strings.Cut(s, "=")
	if !ok || name == "" {
		return nil, cli.Usagef("--filter %q is not NAME=PATTERN (for example reason=permanent, error-type=*json*)", s)
	}
	parts := strings.Split(pat, "*")
	for i := range parts {
		parts[i] = regexp.QuoteMeta(parts[i])
	}
	re := regexp.MustCompile("^(?s:" + strings.Join(parts, ".*") + ")$")
	return Filter{{name: strings.ToLower(name), re: re}}, nil
}

// Match reports whether every condition holds for m.
func (f Filter) Match(m driver.Message) bool {
	for _, c := range f {
		if !c.re.MatchString(field(m, c.name)) {
			return false
		}
	}
	return true
}

func field(m driver.Message, name string) string {
	h := m.Headers
	switch name {
	case "id":
		return m.ID
	case "key":
		if m.Key != "" {
			return m.Key
		}
		return h[consumer.HeaderDLQKey]
	case "source", "reason", "consumer", "host", "error", "error-kind", "error-type":
		return h[dlqPrefix+name]
	}
	return h[name]
}

// redriven is the message Redrive publishes for a dead-lettered one: its
// body, key and own headers, without the ferry-dlq-* headers (a later
// dead-lettering writes fresh ones) and those RabbitMQ sets on delivery
// (x-delivery-count, x-death, ...), with HeaderRedrivenFrom, and with the
// original message's id followed by "~r" and a hash of the time of its
// last failure. That id is the same for every copy redrives publish of one
// dead letter (an idempotent consumer, or an SQS FIFO queue within its
// deduplication window, drops the copy a crash made) and differs from the
// original's and from that of a later dead-lettering of the same message
// (an SQS FIFO queue does not drop the redrive as a duplicate of them).
func redriven(m driver.Message, from string) consumer.Message {
	h := make(map[string]string, len(m.Headers)+1)
	for k, v := range m.Headers {
		if !strings.HasPrefix(k, dlqPrefix) && !brokerHeaders[k] && !strings.HasPrefix(k, "x-first-death-") && !strings.HasPrefix(k, "x-last-death-") {
			h[k] = v
		}
	}
	h[HeaderRedrivenFrom] = from
	id := m.Headers[consumer.HeaderDLQMessageID]
	if id == "" {
		id = m.ID
	}
	sum := sha256.Sum256([]byte(m.Headers[consumer.HeaderDLQLastFailure]))
	key := m.Key
	if key == "" {
		key = m.Headers[consumer.HeaderDLQKey]
	}
	return consumer.Message{ID: id + "~r" + hex.EncodeToString(sum[:4]), Key: key, Body: m.Body, Headers: h}
}

// brokerHeaders are headers a broker sets on delivery (RabbitMQ's count of
// deliveries and dead-letterings), which a redriven message must not carry
// to its source as if they were its own.
var brokerHeaders = map[string]bool{"x-delivery-count": true, "x-death": true}

// opTimeout bounds the publish and the removal of the message in flight,
// which go on after an interrupt.
const opTimeout = 30 * time.Second

// rabbitPrefetch is the prefetch of a redrive on RabbitMQ: messages the
// filter leaves are held until the end of the run (nacked back then), and
// the broker pushes more past them only within this bound.
const rabbitPrefetch = 1000

// Redrive moves messages from cfg.Destination back to cfg.To, one at a
// time: each is published, its publish confirmed by the broker, and only
// then removed from the destination (acked, deleted; on Kafka the offset
// past it committed for the redrive's group before the next is read). A
// crash between the two leaves that one message in both places: run again,
// it is published a second time, the only duplicate a crash can make.
// Messages the filter does not match stay: on SQS, RabbitMQ and memory
// they are held (invisible, unacked) until the run ends and then given
// back at once; on Kafka the group passes over them.
//
// When ctx ends, the message in flight is finished (published and
// removed), the others are given back, and Result.Interrupted is set.
func Redrive(ctx context.Context, b ferry.Broker, cfg RedriveConfig) (Result, error) {
	start := time.Now()
	res := Result{Left: -1}
	if cfg.Group == "" {
		cfg.Group = DefaultGroup
	}
	if cfg.Wait <= 0 {
		cfg.Wait = 2 * time.Second
	}
	if cfg.Idle <= 0 {
		cfg.Idle = 40 * time.Second
	}
	if kb, ok := b.(kafkaBroker); ok {
		left, _ := kafkaLeft(ctx, kb.Admin(), cfg.Destination, cfg.Group)
		bar := newProgress(cfg.Progress, left)
		err := redriveKafka(ctx, kb, cfg, &res, bar)
		bar.done()
		if left, lerr := kafkaLeft(ctx, kb.Admin(), cfg.Destination, cfg.Group); lerr == nil {
			res.Left = left
		}
		res.Elapsed = time.Since(start)
		return res, err
	}
	d, err := cli.Driver(ctx, b, cfg.Destination, cfg.Group, rabbitPrefetch)
	if err != nil {
		return res, err
	}
	defer d.Close()
	lagOf := func() (int64, error) {
		r, ok := d.(driver.LagReporter)
		if !ok {
			return -1, nil
		}
		lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), opTimeout)
		defer cancel()
		l, err := r.Lag(lctx)
		if err != nil {
			return -1, err
		}
		return l.Messages + max(l.InFlight, 0), nil
	}
	total, _ := lagOf()
	bar := newProgress(cfg.Progress, total)
	defer bar.done()

	held := map[string]any{} // messages the filter left, by id: their latest handle
	settle := func(s ...driver.Settlement) error {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), opTimeout)
		defer cancel()
		return d.Settle(sctx, s)
	}
	giveBack := func(ms []driver.Message) error {
		var back []driver.Settlement
		for _, h := range held {
			back = append(back, driver.Settlement{Handle: h, Action: driver.Return, NotAttempted: true})
		}
		clear(held)
		for _, m := range ms {
			back = append(back, driver.Settlement{Handle: m.Handle, Action: driver.Return, NotAttempted: true})
		}
		if len(back) == 0 {
			return nil
		}
		if err := settle(back...); err != nil {
			return fmt.Errorf("giving back %d messages (they come back after their lease): %w", len(back), err)
		}
		return nil
	}
	finish := func(err error, rest []driver.Message) (Result, error) {
		err = errors.Join(err, giveBack(rest))
		if left, lerr := lagOf(); lerr == nil {
			res.Left = left
		}
		res.Elapsed = time.Since(start)
		return res, err
	}

	var next time.Time // when the next read may go, by the rate
	// keepHeld extends the leases of the messages the filter left, where
	// they run out (SQS, memory), before a third of them is left.
	ext, _ := d.(driver.Extender)
	extended := time.Now()
	keepHeld := func() {
		if ext == nil || len(held) == 0 || time.Since(extended) < ext.Lease()/3 {
			return
		}
		hs := make([]any, 0, len(held))
		for _, h := range held {
			hs = append(hs, h)
		}
		ectx, cancel := context.WithTimeout(ctx, opTimeout)
		_ = ext.Extend(ectx, hs, ext.Lease()) // one that ran out comes back, and is held again
		cancel()
		extended = time.Now()
	}
	lastFresh := time.Now()
	for {
		if ctx.Err() != nil {
			res.Interrupted = true
			return finish(nil, nil)
		}
		if cfg.Limit > 0 && res.Moved >= cfg.Limit {
			return finish(nil, nil)
		}
		// Paced before the read, so that no message waits out the pace
		// with its lease running.
		if !pace(ctx, cfg.Rate, &next) {
			res.Interrupted = true
			return finish(nil, nil)
		}
		keepHeld()
		fctx, cancel := context.WithTimeout(ctx, cfg.Wait)
		batch, err := d.Fetch(fctx, nil, 1)
		cancel()
		if err != nil && !errors.Is(err, context.DeadlineExceeded) && !(errors.Is(err, context.Canceled) && ctx.Err() != nil) {
			return finish(fmt.Errorf("receiving from %s: %w", cfg.Destination, err), batch)
		}
		fresh := false
		for i, m := range batch {
			if _, ok := held[m.ID]; ok {
				held[m.ID] = m.Handle // seen again (its lease ran out): keep the live handle
				continue
			}
			if ctx.Err() != nil {
				res.Interrupted = true
				return finish(nil, batch[i:])
			}
			fresh = true
			if !cfg.Filter.Match(m) {
				res.Skipped++
				held[m.ID] = m.Handle
				bar.show(res)
				continue
			}
			pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), opTimeout)
			err := b.Publish(pctx, cfg.To, redriven(m, cfg.Destination))
			cancel()
			if err != nil {
				return finish(fmt.Errorf("publishing %s to %s (it stays in %s): %w", m.ID, cfg.To, cfg.Destination, err), batch[i:])
			}
			if err := settle(driver.Settlement{Handle: m.Handle, Action: driver.Ack, BeforeRun: true}); err != nil {
				res.Moved++
				return finish(fmt.Errorf("message %s was published to %s but not removed from %s: a later redrive publishes it again: %w",
					m.ID, cfg.To, cfg.Destination, err), batch[i+1:])
			}
			res.Moved++
			bar.show(res)
		}
		if fresh {
			lastFresh = time.Now()
			continue
		}
		// Nothing new came: done when the broker holds nothing but what
		// the filter left.
		left, err := lagOf()
		if err != nil {
			return finish(fmt.Errorf("asking how much is left in %s: %w", cfg.Destination, err), nil)
		}
		if left <= int64(len(held)) && left >= 0 {
			return finish(nil, nil)
		}
		if left < 0 {
			return finish(nil, nil)
		}
		if time.Since(lastFresh) >= cfg.Idle {
			res.GaveUpWaiting = true
			return finish(nil, nil)
		}
	}
}

// progress is a progress bar on a terminal, rewritten in place.
type progress struct {
	w     io.Writer
	total int64
	start time.Time
	shown bool
}

func newProgress(w io.Writer, total int64) *progress {
	return &progress{w: w, total: total, start: time.Now()}
}

func (p *progress) show(r Result) {
	if p.w == nil {
		return
	}
	p.shown = true
	done := int64(r.Moved + r.Skipped)
	rate := float64(r.Moved) / max(time.Since(p.start).Seconds(), 1e-3)
	const width = 30
	bar := strings.Repeat(" ", width)
	if p.total > 0 {
		n := int(min(done*width/p.total, width))
		bar = strings.Repeat("=", n) + strings.Repeat(" ", width-n)
	}
	of := "?"
	if p.total >= 0 {
		of = fmt.Sprint(max(p.total, done))
	}
	fmt.Fprintf(p.w, "\r[%s] %d/%s moved %d skipped %d %.0f/s ", bar, done, of, r.Moved, r.Skipped, rate)
}

func (p *progress) done() {
	if p.w != nil && p.shown {
		fmt.Fprint(p.w, "\r\033[K")
	}
}
