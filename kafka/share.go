package kafka

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/ratelog"
)

// shareDriver is one member of a share group (KIP-932) over one topic:
// Kafka as a queue. The broker hands each record to one member under an
// acquisition lock, and the member acknowledges it by itself: ACCEPT
// (done), RELEASE (deliver it again, to anyone), or RENEW (keep the lock).
// There are no offsets to commit and no order.
//
// franz-go accepts, at the next poll, every record of the poll before
// that has no final acknowledgement yet (a renewed one included), so the
// driver polls again only once every record of the last poll was settled:
// it works in waves of at most the loop's in-flight bound
// (kgo.ShareMaxRecords, strictly). Fetch runs on the loop's fetcher,
// Settle on its settler, Extend on its extender; mu guards the wave they
// share, and ackMu makes Settle's and Extend's acknowledgements one flush
// at a time, so that a flush's failures are its own.
type shareDriver struct {
	membership
	maxRecords int32 // a poll's records at most: the loop's in-flight bound

	lease  atomic.Int64 // time.Duration: the group's record lock duration
	limit  atomic.Int32 // the group's delivery count limit
	deadTo atomic.Pointer[string]
	warns  *ratelog.Limiter // WARN lines, a few a minute of each kind

	mu    sync.Mutex
	cl    *kgo.Client
	ready bool           // the group is configured and the topic subscribed
	wave  []*shareHandle // the last poll's records
	stash []*shareHandle // of them, those the loop has not taken yet
	held  int            // of them, those not settled yet
	done  chan struct{}  // closed when held falls to 0

	ackMu sync.Mutex // one flush of acknowledgements at a time

	failsMu  sync.Mutex
	flushing bool                 // a Settle or Extend waits for its flush
	ackFails []kgo.ShareAckResult // what the broker refused since that flush began

	stop      chan struct{}
	closeOnce sync.Once
}

var (
	_ driver.Driver      = (*shareDriver)(nil)
	_ driver.Connector   = (*shareDriver)(nil)
	_ driver.Extender    = (*shareDriver)(nil)
	_ driver.LagReporter = (*shareDriver)(nil)
	_ driver.Aser        = (*shareDriver)(nil)
	_ driver.Drainer     = (*shareDriver)(nil)
)

// shareHandle is what the loop holds for one delivery of a share group.
type shareHandle struct {
	rec     *kgo.Record
	settled bool // d.mu
}

// Share groups' defaults, as Kafka 4.x has them, for a group whose
// configuration says nothing of them.
const (
	defaultShareLock  = 30 * time.Second
	defaultShareLimit = 5
)

func (b *Broker) newShareDriver(topic, group string, cfg driver.Config) (*shareDriver, error) {
	if topic == "" {
		return nil, consumer.ConfigErrorf("topic", "must not be empty")
	}
	if b.isClosed() {
		return nil, fmt.Errorf("kafka: consumer of %q: %w", topic, ErrClosed)
	}
	n := cfg.MaxInFlight
	if n <= 0 {
		n = 500 // franz-go's default
	}
	d := &shareDriver{
		membership: membership{b: b, topic: topic, group: group, log: b.log.With("topic", topic, "share_group", group)},
		maxRecords: int32(min(n, 1<<20)),
		warns:      ratelog.New(3, time.Minute),
		stop:       make(chan struct{}),
	}
	// The shortest lease until Connect reads the group's lock: the loop
	// sets how often it looks for leases to extend from the lease as its
	// Run starts, before Connect.
	d.lease.Store(int64(driver.MinLease))
	d.limit.Store(defaultShareLimit)
	b.mu.Lock()
	b.drivers[d] = struct{}{}
	b.mu.Unlock()
	return d, nil
}

// client returns the share group client, making it on first use. It
// subscribes to no topic yet: Connect configures the group first, because
// the group's share-partitions start where share.auto.offset.reset says
// when its first member fetches.
func (d *shareDriver) client() (*kgo.Client, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.cl != nil {
		return d.cl, nil
	}
	select {
	case <-d.stop:
		return nil, fmt.Errorf("kafka: consumer of %q: %w", d.topic, ErrClosed)
	default:
	}
	cl, err := kgo.NewClient(d.b.clientOpts(&d.link,
		kgo.ShareGroup(d.group),
		kgo.ShareMaxRecords(d.maxRecords),
		// At most maxRecords a poll, and no fetch ahead of a poll: a
		// record fetched ahead would sit here under its lock while other
		// members could work on it.
		kgo.ShareMaxRecordsStrict(),
		kgo.ShareAckCallback(d.acked),
	)...)
	if err != nil {
		return nil, fmt.Errorf("kafka: consumer of %q: %w", d.topic, err)
	}
	d.cl = cl
	return cl, nil
}

// Capabilities reports a queue that keeps no order: records carry no
// lane. The broker could take a record back (RELEASE), but only at once
// and with one more delivery counted, so the loop retries a failed record
// in place after its delay, renewing its lock meanwhile, and the broker's
// delivery count grows only when a member dies or stops with a record.
func (d *shareDriver) Capabilities() driver.Capabilities {
	return driver.Capabilities{Redelivers: false, Source: d.topic, System: "kafka"}
}

// Connect makes the client, asks the cluster for the topic, reads the
// group's lock duration, delivery limit and dead-letter topic, makes a
// group whose start is not configured start at the earliest records (as
// Ferry's consumer groups do), and then subscribes. Its errors are those
// of the consumer group driver's Connect.
func (d *shareDriver) Connect(ctx context.Context) error {
	cl, err := d.client()
	if err != nil {
		return driver.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(ctx, connectWithin)
	defer cancel()
	d.askedAt = time.Now()
	if _, err = d.lookUp(ctx, cl); err == nil {
		err = d.configure(ctx, cl)
	}
	d.failed = failureOf(err)
	return err
}

// configure reads the group's configuration and subscribes, once.
func (d *shareDriver) configure(ctx context.Context, cl *kgo.Client) error {
	d.mu.Lock()
	ready := d.ready
	d.mu.Unlock()
	if ready {
		return nil
	}
	gc, err := readShareGroupConfig(ctx, cl, d.group)
	if err != nil {
		return d.requestErr(err)
	}
	if gc.resetIsDefault {
		err := alterShareGroupConfig(ctx, cl, d.group, map[string]string{shareAutoOffsetReset: "earliest"})
		switch {
		case err == nil:
			d.log.Info("ferry/kafka: the share group had no start set; it starts at the earliest records, as Ferry's consumer groups do (set share.auto.offset.reset on the group to choose)")
		case isRefusal(err):
			d.log.Warn("ferry/kafka: the share group's start cannot be set (not allowed to alter the group's configuration); it starts at the latest records, so records produced before its first fetch are not consumed", "err", err)
		default:
			return d.requestErr(err)
		}
	}
	d.lease.Store(int64(gc.lock))
	d.limit.Store(int32(gc.limit))
	d.deadTo.Store(&gc.deadLetterTopic)
	dlq := gc.deadLetterTopic
	if dlq == "" {
		dlq = "none (records the broker archives are dropped)"
	}
	d.log.Info("ferry/kafka: share group", "lock", gc.lock, "delivery_limit", gc.limit, "broker_dead_letter_topic", dlq)
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.ready {
		cl.AddConsumeTopics(d.topic)
		d.ready = true
	}
	return nil
}

// Fetch hands out what the last poll brought and the loop has not taken
// yet; once every record of that poll is settled it polls again, up to
// the loop's in-flight bound. Until then it waits.
func (d *shareDriver) Fetch(ctx context.Context, dst []driver.Message, max int) ([]driver.Message, error) {
	cl, err := d.client()
	if err != nil {
		return dst, driver.Fatal(err)
	}
	if max <= 0 {
		max = 1
	}
	d.mu.Lock()
	if len(d.stash) > 0 {
		dst = d.handOut(dst, max)
		d.mu.Unlock()
		return dst, nil
	}
	if d.held > 0 && d.done != nil {
		done := d.done
		d.mu.Unlock()
		select {
		case <-done:
		case <-ctx.Done():
			return dst, ctx.Err()
		case <-d.stop:
			return dst, driver.Fatal(fmt.Errorf("kafka: fetch %q: %w", d.topic, ErrClosed))
		}
		d.mu.Lock()
	}
	ready := d.ready
	d.mu.Unlock()
	if !ready {
		// Connect has not got through yet; it configures the group.
		if err := d.Connect(ctx); err != nil {
			return dst, err
		}
	}
	res := d.poll(ctx, cl, int(d.maxRecords))
	var recs []*kgo.Record
	res.fs.EachRecord(func(r *kgo.Record) {
		if r.Topic == d.topic {
			recs = append(recs, r)
		} else {
			r.Ack(kgo.AckRelease) // not ours: another subscription of the client's (never, today)
		}
	})
	if len(recs) > 0 {
		d.polledAt = time.Now()
		d.mu.Lock()
		d.wave = make([]*shareHandle, len(recs))
		for i, r := range recs {
			d.wave[i] = &shareHandle{rec: r}
		}
		d.stash = append(d.stash[:0], d.wave...)
		d.held = len(recs)
		d.done = make(chan struct{})
		// Records polled as ctx ended still go to the loop (or, when it
		// fetches no more, to Drain): franz-go would accept them at the
		// next poll, and Close releases what nobody took.
		dst = d.handOut(dst, max)
		d.mu.Unlock()
	}
	if err := ctx.Err(); err != nil {
		return dst, err
	}
	ferr := res.err
	if errors.Is(ferr, kgo.ErrClientClosed) {
		return dst, driver.Fatal(fmt.Errorf("kafka: fetch %q: %w", d.topic, ErrClosed))
	}
	err = d.linkErr()
	switch {
	case err != nil:
	case ferr != nil && refusedBy(&d.link, ferr):
		addr, _ := d.link.last()
		err = driver.Fatal(fmt.Errorf("kafka: consumer of %q: %w", d.topic, refused(d.b.addrOr(addr), ferr)))
	case ferr != nil && isDialErr(ferr):
		addr, _ := d.link.last()
		err = fmt.Errorf("kafka: consumer of %q: %w", d.topic, unreachable(d.b.addrOr(addr), ferr))
	case ferr != nil:
		err = fmt.Errorf("kafka: fetch %q: %w", d.topic, ferr)
	case res.ask:
		err = d.lookAgain(ctx, cl, res.staleID)
	}
	d.failed = failureOf(err)
	return dst, err
}

// handOut moves up to max stashed records to dst. d.mu is held.
func (d *shareDriver) handOut(dst []driver.Message, max int) []driver.Message {
	n := min(max, len(d.stash))
	for _, h := range d.stash[:n] {
		dst = append(dst, d.message(h))
	}
	d.stash = append(d.stash[:0], d.stash[n:]...)
	return dst
}

// message is the record of h as the loop takes it: no lane (a share group
// keeps no order), and the broker's delivery count.
func (d *shareDriver) message(h *shareHandle) driver.Message {
	r := h.rec
	id, headers := readHeaders(r)
	if id == "" {
		id = d.topic + "/" + strconv.Itoa(int(r.Partition)) + "/" + strconv.FormatInt(r.Offset, 10)
	}
	return driver.Message{
		ID:          id,
		Key:         string(r.Key),
		Body:        r.Value,
		Headers:     headers,
		Source:      d.topic,
		Offset:      r.Offset,
		PublishedAt: r.Timestamp,
		Deliveries:  int(max(r.DeliveryCount(), 1)),
		Handle:      h,
	}
}

// Drain hands the loop, when it stops fetching, the records of the last
// poll it has not taken, to run within its grace: given back, each would
// count one more delivery.
func (d *shareDriver) Drain(_ context.Context, dst []driver.Message) ([]driver.Message, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.handOut(dst, len(d.stash)), nil
}

// Settle acknowledges: Ack is ACCEPT, Return is RELEASE (the loop returns
// records only as it stops: the broker delivers them again, to any
// member, counting one more delivery). It returns once the broker
// answered; a partition whose acknowledgements it refused fails every
// settlement of it in the batch, in a *[driver.SettleError] (the broker
// then delivers those records again when their locks run out). The
// settlements that finish the last poll's records are the exception: the
// next poll carries them (one round trip fewer a poll), and a refusal
// of them is logged at WARN when the broker answers.
func (d *shareDriver) Settle(ctx context.Context, batch []driver.Settlement) error {
	hs := make([]*shareHandle, len(batch))
	beforeRun := false
	for i := range batch {
		h, _ := batch[i].Handle.(*shareHandle)
		hs[i] = h
		beforeRun = beforeRun || batch[i].BeforeRun
	}
	d.ackMu.Lock()
	for i, s := range batch {
		h := hs[i]
		if h == nil {
			continue
		}
		switch s.Action {
		case driver.Ack:
			h.rec.Ack(kgo.AckAccept)
		default:
			d.releasing(h.rec)
			h.rec.Ack(kgo.AckRelease)
		}
	}
	d.mu.Lock()
	for _, h := range hs {
		if h != nil && !h.settled {
			h.settled = true
			d.held--
		}
	}
	var done chan struct{}
	if d.held == 0 && d.done != nil {
		done, d.done = d.done, nil
	}
	d.mu.Unlock()
	var (
		err   error
		fails []kgo.ShareAckResult
	)
	if done == nil || beforeRun {
		d.resetFails()
		err = d.flush(ctx)
		fails = d.fails()
	}
	d.ackMu.Unlock()
	if done != nil {
		close(done) // Fetch polls, and the poll carries what was not flushed
	}

	var failed []int
	for i, h := range hs {
		switch {
		case h == nil:
			failed = append(failed, i)
		case err != nil || refusedFor(fails, h.rec) != nil:
			failed = append(failed, i)
		}
	}
	if len(failed) == 0 {
		return nil
	}
	if err == nil {
		err = refusedFor(fails, hs[failed[0]].rec)
	}
	if err == nil {
		err = errors.New("not a delivery of this consumer")
	}
	return &driver.SettleError{Failed: failed, Err: fmt.Errorf("kafka: acknowledge records of %q in share group %q: %w", d.topic, d.group, err)}
}

// releasing warns when r goes back on the last delivery the group allows:
// the broker archives it instead of delivering it again.
func (d *shareDriver) releasing(r *kgo.Record) {
	limit := d.limit.Load()
	if limit <= 0 || r.DeliveryCount() < limit {
		return
	}
	to := "dropped: the group has no errors.deadletterqueue.topic.name"
	if t := d.deadTo.Load(); t != nil && *t != "" {
		to = "moved to the group's dead-letter topic " + *t
	}
	if ok, left := d.warns.Allow("last delivery"); ok {
		d.log.Warn("ferry/kafka: a record given back on its last delivery is archived by the broker, not delivered again",
			"partition", r.Partition, "offset", r.Offset, "deliveries", r.DeliveryCount(), "limit", limit, "archived", to, "unlogged", left)
	}
}

// flush sends the acknowledgements marked so far and waits for the broker's
// answer, at most flushWithin. d.ackMu is held.
func (d *shareDriver) flush(ctx context.Context) error {
	d.mu.Lock()
	cl := d.cl
	d.mu.Unlock()
	if cl == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, flushWithin)
	defer cancel()
	if err := cl.FlushAcks(ctx); err != nil {
		return fmt.Errorf("no answer within %s: %w", flushWithin, err)
	}
	return nil
}

// flushWithin bounds how long a Settle or Extend waits for the broker to
// answer its acknowledgements.
const flushWithin = 10 * time.Second

// acked is franz-go's ShareAckCallback: it keeps what the broker refused,
// for the flush under way (FlushAcks returns after the callbacks of what
// it sent), and logs a refusal of acknowledgements no flush waits for (a
// poll carried them).
func (d *shareDriver) acked(_ *kgo.Client, rs kgo.ShareAckResults) {
	d.failsMu.Lock()
	defer d.failsMu.Unlock()
	for _, r := range rs {
		if r.Err == nil || r.Topic != d.topic {
			continue
		}
		if d.flushing {
			d.ackFails = append(d.ackFails, r)
		} else if ok, left := d.warns.Allow("ack refused"); ok {
			d.log.Warn("ferry/kafka: the broker refused acknowledgements; their records are delivered again when their locks run out",
				"partition", r.Partition, "err", r.Err, "unlogged", left)
		}
	}
}

// resetFails forgets earlier refusals, as a flush begins.
func (d *shareDriver) resetFails() {
	d.failsMu.Lock()
	d.ackFails = d.ackFails[:0]
	d.flushing = true
	d.failsMu.Unlock()
}

// fails returns the refusals since the last resetFails, as its flush ends.
func (d *shareDriver) fails() []kgo.ShareAckResult {
	d.failsMu.Lock()
	defer d.failsMu.Unlock()
	d.flushing = false
	return slices.Clone(d.ackFails)
}

// refusedFor is the error the broker gave for r's partition, if any.
func refusedFor(fails []kgo.ShareAckResult, r *kgo.Record) error {
	for _, f := range fails {
		if f.Partition == r.Partition {
			return fmt.Errorf("partition %d: %w", f.Partition, f.Err)
		}
	}
	return nil
}

// Lease is the group's record lock duration, as Connect read it
// ([driver.MinLease] until then).
func (d *shareDriver) Lease() time.Duration { return time.Duration(d.lease.Load()) }

// Extend renews the locks of the records behind handles (RENEW, KIP-1222):
// each gets the group's lock duration afresh, whatever d is.
func (d *shareDriver) Extend(ctx context.Context, handles []any, _ time.Duration) error {
	d.ackMu.Lock()
	defer d.ackMu.Unlock()
	d.resetFails()
	var recs []*kgo.Record
	for _, h := range handles {
		if sh, ok := h.(*shareHandle); ok {
			sh.rec.Ack(kgo.AckRenew)
			recs = append(recs, sh.rec)
		}
	}
	if err := d.flush(ctx); err != nil {
		return fmt.Errorf("kafka: renew the locks of %d record(s) of %q in share group %q: %w", len(recs), d.topic, d.group, err)
	}
	fails := d.fails()
	for _, r := range recs {
		if err := refusedFor(fails, r); err != nil {
			return fmt.Errorf("kafka: renew the locks of records of %q in share group %q: %w", d.topic, d.group, err)
		}
	}
	return nil
}

// Lag reports, per partition (Lanes), the share-partition lag the group
// coordinator keeps (KIP-1226: the records from the share-partition's
// start offset on that are not acknowledged yet). A lane's position is
// the partition's end offset less its lag: it moves as records are
// acknowledged, and not as records are produced, as a consumer group's
// committed offset does. (The start offset itself is no position: the
// coordinator moves it past acknowledged records seldom, not at once.)
// Until the coordinator has written a partition's state (at its first
// acknowledgement) it reports no lag there; Lag then counts from the
// partition's start offset, or its log start, to its end, which is right
// for a group that starts at the earliest records (Ferry's default). Of
// the sum, InFlight is what this member holds (the unsettled records of
// its last poll) and Messages the rest; OldestAge is the age of the
// oldest record this member holds: the broker tells no age of a share
// group's backlog.
func (d *shareDriver) Lag(ctx context.Context) (driver.Lag, error) {
	fail := func(what string, err error) (driver.Lag, error) {
		return driver.Lag{}, fmt.Errorf("kafka: lag of share group %q on %q: %s: %w", d.group, d.topic, what, wrapAuth(err))
	}
	described, err := d.b.adm.DescribeShareGroupOffsets(ctx, d.group)
	if err != nil {
		return fail("share group offsets", err)
	}
	g, ok := described[d.group]
	if ok && g.Err != nil && !errors.Is(g.Err, kerr.GroupIDNotFound) {
		return fail("share group offsets", g.Err)
	}
	known := map[int32]kadm.ShareOffset{}
	for p, o := range g.Offsets[d.topic] {
		if o.Err == nil && o.Lag >= 0 && o.StartOffset >= 0 {
			known[p] = o
		}
	}
	ends, err := d.b.adm.ListEndOffsets(ctx, d.topic)
	if err != nil {
		return fail("end offsets", err)
	}
	var starts kadm.ListedOffsets
	out := driver.Lag{Lanes: make(map[string]int64), Positions: make(map[string]int64)}
	var ferr error
	ends.Each(func(e kadm.ListedOffset) {
		if e.Topic != d.topic || ferr != nil {
			return
		}
		if e.Err != nil {
			ferr = e.Err
			return
		}
		lane := strconv.Itoa(int(e.Partition))
		if o, ok := known[e.Partition]; ok {
			out.Lanes[lane], out.Positions[lane] = o.Lag, max(e.Offset-o.Lag, 0)
			out.Messages += o.Lag
			return
		}
		from := int64(-1)
		if o, ok := g.Offsets[d.topic][e.Partition]; ok && o.Err == nil && o.StartOffset >= 0 {
			from = o.StartOffset
		} else {
			if starts == nil {
				if starts, ferr = d.b.adm.ListStartOffsets(ctx, d.topic); ferr != nil {
					return
				}
			}
			if s, ok := starts.Lookup(d.topic, e.Partition); ok && s.Err == nil {
				from = s.Offset
			}
		}
		if from < 0 {
			return
		}
		lag := max(e.Offset-from, 0)
		out.Lanes[lane], out.Positions[lane] = lag, e.Offset-lag
		out.Messages += lag
	})
	if ferr != nil {
		return fail("start and end offsets", ferr)
	}
	d.mu.Lock()
	var oldest time.Time
	for _, h := range d.wave {
		if !h.settled {
			out.InFlight++
			if ts := h.rec.Timestamp; oldest.IsZero() || ts.Before(oldest) {
				oldest = ts
			}
		}
	}
	d.mu.Unlock()
	out.Messages = max(out.Messages-out.InFlight, 0)
	if !oldest.IsZero() {
		out.OldestAge = time.Since(oldest)
	}
	return out, nil
}

// As gives a handler the record: target is a **kgo.Record (set to the
// record itself) or a *kgo.Record (a copy).
func (d *shareDriver) As(h, target any) bool {
	sh, ok := h.(*shareHandle)
	if !ok || sh == nil {
		return false
	}
	switch t := target.(type) {
	case **kgo.Record:
		if t == nil {
			return false
		}
		*t = sh.rec
		return true
	case *kgo.Record:
		if t == nil {
			return false
		}
		*t = *sh.rec
		return true
	}
	return false
}

// Close gives back the records of the last poll nobody took, sends every
// acknowledgement still pending, and leaves the group (franz-go releases
// what is still only renewed). The loop calls it when Run ends.
func (d *shareDriver) Close() error {
	d.closeOnce.Do(func() {
		close(d.stop)
		d.b.forget(d)
		d.mu.Lock()
		cl := d.cl
		for _, h := range d.wave {
			if !h.settled {
				h.settled = true
				h.rec.Ack(kgo.AckRelease)
			}
		}
		d.stash, d.wave, d.held = nil, nil, 0
		d.mu.Unlock()
		if cl == nil {
			return
		}
		d.ackMu.Lock()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if err := cl.FlushAcks(ctx); err != nil {
			d.log.Warn("ferry/kafka: acknowledgements not sent as the consumer stopped; their records come back when their locks run out", "err", err)
		}
		cancel()
		d.ackMu.Unlock()
		cl.Close()
	})
	return nil
}
