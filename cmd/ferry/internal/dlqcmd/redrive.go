package dlqcmd

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"maps"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/cmd/ferry/internal/cli"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/brokerkind"
	"github.com/ferrymq/ferry/kafka"
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
	// To is where they all go: a queue (memory, SQS), a topic (Kafka), or
	// on RabbitMQ a queue, else an exchange, of that name, or
	// amq.exchange/EXCHANGE (rabbit.ToExchange) for an exchange outright.
	// When empty, each message goes to the source its
	// consumer.HeaderDLQSource header names; one without it (or naming
	// Destination) stays where it is (Result.Unrouted), and on Kafka its
	// partition is redriven no further (Result.Stopped).
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
	// Progress, when not nil, gets the run's progress: a bar rewritten in
	// place when ProgressBar is set (a terminal), else a line every
	// ProgressEvery (none when it is 0).
	Progress      io.Writer
	ProgressBar   bool
	ProgressEvery time.Duration
}

// Count is how many messages a destination holds, as far as its broker
// tells.
type Count struct {
	N      int64  // -1: unknown
	Approx bool   // the broker counts approximately (SQS)
	Why    string // why N is unknown
}

// unknown is a Count the broker could not give.
func unknown(why string) Count { return Count{N: -1, Why: why} }

// Of formats c as the total of n messages seen, which it cannot be below:
// "43", "about 43", or "?" when unknown.
func (c Count) Of(n int) string {
	switch {
	case c.N < 0:
		return "?"
	case c.Approx:
		return fmt.Sprintf("about %d", max(c.N, int64(n)))
	}
	return strconv.FormatInt(max(c.N, int64(n)), 10)
}

// Result is how far a redrive got.
type Result struct {
	Moved    int            // published, then removed from Destination
	To       map[string]int // messages moved, by the source they went to
	Skipped  int            // not matched by the filter, left where they were
	Unrouted int            // naming no source (RedriveConfig.To), left where they were
	// Stopped says, for Kafka, where the redrive stopped short in a
	// partition: at a record that names no source.
	Stopped     []string
	Left        Count         // what the broker said was left in Destination at the end
	Elapsed     time.Duration // how long it ran
	Interrupted bool          // ctx ended before the destination was empty
	// GaveUpWaiting is set when the run ended after Idle without a message
	// although the broker said more than the filter's leftovers were left
	// (in flight elsewhere, delayed, or beyond the filter's reach).
	GaveUpWaiting bool
}

// Summary is the line a redrive of dest ends with; to is --to.
func (r Result) Summary(dest, to string) string {
	where := to
	if where == "" {
		where = "their sources"
		if len(r.To) > 0 {
			names := slices.Sorted(maps.Keys(r.To))
			parts := make([]string, len(names))
			for i, n := range names {
				parts[i] = fmt.Sprintf("%s: %d", n, r.To[n])
			}
			where += " (" + strings.Join(parts, ", ") + ")"
		}
	}
	left := ""
	switch {
	case r.Left.N < 0:
		left = fmt.Sprintf("what is left in %s is unknown: %s", dest, r.Left.Why)
	case r.Left.Approx:
		left = fmt.Sprintf("about %d left in %s, as SQS counts", r.Left.N, dest)
	default:
		left = fmt.Sprintf("%d left in %s", r.Left.N, dest)
	}
	unrouted := ""
	if r.Unrouted > 0 {
		unrouted = fmt.Sprintf(", %d naming no source", r.Unrouted)
	}
	return fmt.Sprintf("moved %d messages from %s to %s in %s (%d skipped by the filter%s; %s)",
		r.Moved, dest, where, r.Elapsed.Round(time.Millisecond), r.Skipped, unrouted, left)
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

// Redrive moves messages from cfg.Destination back to their source (or
// cfg.To), one at a time: each is published, its publish confirmed by the
// broker, and only then removed from the destination (acked, deleted; on
// Kafka the offset past it committed for the redrive's group before the
// next is read). A crash between the two leaves that one message in both
// places: run again, it is published a second time, the only duplicate a
// crash can make. Messages the filter does not match, and those that name
// no source, stay: on SQS, RabbitMQ and memory they are held (invisible,
// unacked) until the run ends and then given back at once; on Kafka the
// group passes over the filter's and stops at the others.
//
// When ctx ends, the message in flight is finished (published and
// removed), the others are given back, and Result.Interrupted is set.
func Redrive(ctx context.Context, b ferry.Broker, cfg RedriveConfig) (Result, error) {
	start := time.Now()
	res := Result{Left: unknown("the run ended before the broker was asked"), To: map[string]int{}}
	if cfg.Group == "" {
		cfg.Group = DefaultGroup
	}
	if cfg.Wait <= 0 {
		cfg.Wait = 2 * time.Second
	}
	if cfg.Idle <= 0 {
		cfg.Idle = 40 * time.Second
	}
	rt := &router{b: b, kind: cli.Kind(b), dest: cfg.Destination, to: cfg.To}
	if cfg.To != "" {
		// Where everything goes is known at once: a name that reaches
		// nothing fails now, before anything moves.
		if _, err := rt.target(ctx, cfg.To); err != nil {
			return res, err
		}
	}
	if kb, ok := b.(*kafka.Broker); ok {
		left := kafkaLeft(ctx, kb.Admin(), cfg.Destination, cfg.Group)
		bar := newProgress(cfg, left)
		err := redriveKafka(ctx, kb, cfg, rt, &res, bar)
		bar.done()
		res.Left = kafkaLeft(ctx, kb.Admin(), cfg.Destination, cfg.Group)
		res.Elapsed = time.Since(start)
		return res, err
	}
	d, err := cli.Driver(ctx, b, cfg.Destination, cfg.Group, rabbitPrefetch)
	if err != nil {
		return res, err
	}
	defer d.Close()
	lr, canCount := d.(driver.LagReporter)
	count := func() Count {
		if !canCount {
			return unknown(fmt.Sprintf("a %s broker does not count its messages", rt.kind))
		}
		lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), opTimeout)
		defer cancel()
		l, err := lr.Lag(lctx)
		if err != nil {
			return unknown("asking the broker failed: " + ferry.Redact(err.Error()))
		}
		// The waiting messages and those taken and not settled: on
		// RabbitMQ the ready ones and this driver's unacked deliveries
		// (another consumer's are not counted: AMQP does not tell them).
		return Count{N: l.Messages + max(l.InFlight, 0), Approx: l.Approximate}
	}
	bar := newProgress(cfg, count())
	defer bar.done()

	held := map[string]any{} // messages left where they are, by id: their latest handle
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
		if dr, ok := d.(driver.Drainer); ok {
			// RabbitMQ pushed deliveries ahead of Fetch (the prefetch):
			// unacked, the broker counts them as neither ready nor
			// anyone's until the driver takes them. Taken now, they count
			// in the driver's in flight, and go back with the rest.
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), opTimeout)
			rest, _ = dr.Drain(dctx, rest)
			cancel()
		}
		// Counted before the give back: what goes back is in the count
		// either way (held, or waiting again), and a broker may take a
		// moment to count a message given back as waiting.
		res.Left = count()
		err = errors.Join(err, giveBack(rest))
		res.Elapsed = time.Since(start)
		return res, err
	}

	var next time.Time // when the next read may go, by the rate
	// keepHeld extends the leases of the messages left where they are,
	// where leases run out (SQS, memory), before a third of them is left.
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
			src, to, err := rt.route(ctx, m)
			if err != nil {
				return finish(err, batch[i:])
			}
			if to == "" {
				res.Unrouted++
				held[m.ID] = m.Handle
				bar.show(res)
				continue
			}
			pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), opTimeout)
			err = b.Publish(pctx, to, redriven(m, cfg.Destination))
			cancel()
			if err != nil {
				return finish(fmt.Errorf("publishing %s to %s (it stays in %s): %w", m.ID, src, cfg.Destination, err), batch[i:])
			}
			if err := settle(driver.Settlement{Handle: m.Handle, Action: driver.Ack, BeforeRun: true}); err != nil {
				res.Moved++
				res.To[src]++
				return finish(fmt.Errorf("message %s was published to %s but not removed from %s: a later redrive publishes it again: %w",
					m.ID, src, cfg.Destination, err), batch[i+1:])
			}
			res.Moved++
			res.To[src]++
			bar.show(res)
		}
		if fresh {
			lastFresh = time.Now()
			continue
		}
		// Nothing new came: done when the broker holds nothing but what
		// the run leaves where it is.
		if !canCount {
			return finish(nil, nil)
		}
		left := count()
		if left.N < 0 {
			return finish(fmt.Errorf("asking how much is left in %s: %s", cfg.Destination, left.Why), nil)
		}
		if left.N <= int64(len(held)) {
			return finish(nil, nil)
		}
		if time.Since(lastFresh) >= cfg.Idle {
			res.GaveUpWaiting = true
			return finish(nil, nil)
		}
	}
}

// router says where each message of a redrive goes.
type router struct {
	b    ferry.Broker
	kind string
	dest string // the dead-letter destination
	to   string // --to; "" for each message's own source

	targets map[string]string // a source's name, and the destination Publish takes for it
}

// route returns the source m goes back to and the destination Publish
// takes for it, or "", "" when m names no source: it has no
// consumer.HeaderDLQSource header, or that names the dead-letter
// destination itself.
func (r *router) route(ctx context.Context, m driver.Message) (src, to string, err error) {
	src = r.to
	if src == "" {
		src = m.Headers[consumer.HeaderDLQSource]
	}
	if src == "" || src == r.dest {
		return "", "", nil
	}
	to, err = r.target(ctx, src)
	if err != nil {
		return "", "", err
	}
	if r.kind == brokerkind.RabbitMQ && to == r.dest {
		return "", "", nil
	}
	return src, to, nil
}

// target is the destination Publish takes for the source name: the name
// itself, but on RabbitMQ the exchange of that name when no queue has it
// (see rabbitTarget).
func (r *router) target(ctx context.Context, name string) (string, error) {
	if r.kind != brokerkind.RabbitMQ {
		return name, nil
	}
	if t, ok := r.targets[name]; ok {
		return t, nil
	}
	t, err := rabbitTarget(ctx, r.b, name)
	if err != nil {
		return "", err
	}
	if r.targets == nil {
		r.targets = map[string]string{}
	}
	r.targets[name] = t
	return t, nil
}

// progress shows how a redrive goes: a bar rewritten in place on a
// terminal; elsewhere (a Job's log) a line every few seconds, also while
// nothing moves, so that a log tells a slow run from a stuck one.
type progress struct {
	w     io.Writer
	bar   bool
	total Count
	start time.Time

	mu    sync.Mutex
	r     Result
	shown bool

	stop chan struct{}
	wg   sync.WaitGroup
}

func newProgress(cfg RedriveConfig, total Count) *progress {
	p := &progress{w: cfg.Progress, bar: cfg.ProgressBar, total: total, start: time.Now()}
	if p.w != nil && !p.bar && cfg.ProgressEvery > 0 {
		p.stop = make(chan struct{})
		p.wg.Go(func() {
			t := time.NewTicker(cfg.ProgressEvery)
			defer t.Stop()
			for {
				select {
				case <-t.C:
					p.line()
				case <-p.stop:
					return
				}
			}
		})
	}
	return p
}

// show takes the run's latest counts, and redraws the bar.
func (p *progress) show(r Result) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.r = r
	if p.w == nil || !p.bar {
		return
	}
	p.shown = true
	done := int64(r.Moved + r.Skipped + r.Unrouted)
	const width = 30
	bar := strings.Repeat(" ", width)
	if p.total.N > 0 {
		n := int(min(done*width/p.total.N, width))
		bar = strings.Repeat("=", n) + strings.Repeat(" ", width-n)
	}
	fmt.Fprintf(p.w, "\r[%s] %d/%s moved %d skipped %d %.0f/s ", bar, done, p.total.Of(int(done)), r.Moved, r.Skipped+r.Unrouted, p.rate(r))
}

func (p *progress) rate(r Result) float64 {
	return float64(r.Moved) / max(time.Since(p.start).Seconds(), 1e-3)
}

// line prints one progress line.
func (p *progress) line() {
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.r
	done := r.Moved + r.Skipped + r.Unrouted
	fmt.Fprintf(p.w, "ferry dlq redrive: %d of %s read: moved %d, skipped %d, %.1f/s, %s so far\n",
		done, p.total.Of(done), r.Moved, r.Skipped+r.Unrouted, p.rate(r), time.Since(p.start).Round(time.Second))
}

// done stops the lines and erases the bar.
func (p *progress) done() {
	if p.stop != nil {
		close(p.stop)
		p.wg.Wait()
		p.stop = nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.w != nil && p.bar && p.shown {
		fmt.Fprint(p.w, "\r\033[K")
	}
}
