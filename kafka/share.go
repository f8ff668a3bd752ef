package kafka

import (
	"context"
	"errors"
	"fmt"
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
	// startsLatest is true when the group starts at the latest records
	// (its share.auto.offset.reset says so, or could not be set), for Lag.
	startsLatest atomic.Bool
	warns        *ratelog.Limiter // WARN lines, a few a minute of each kind

	mu    sync.Mutex
	cl    *kgo.Client
	ready bool           // the group is configured and the topic subscribed
	wave  []*shareHandle // the last poll's records
	stash []*shareHandle // of them, those the loop has not taken yet
	held  int            // of them, those not settled yet
	done  chan struct{}  // closed when held falls to 0

	ackMu sync.Mutex // one flush of acknowledgements at a time; the handles' lock reckoning

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
	settled bool // d.mu: acknowledged, or being
	// lockUntil is when its lock runs out, as the driver reckons it: the
	// acquisition deadline the poll gave, then a lease from each renewal.
	// d.ackMu (set before the handle is shared).
	lockUntil time.Time
	lost      bool // d.ackMu: a renewal was refused; it is not renewed again
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
	select {
	case <-d.stop:
		return nil, fmt.Errorf("kafka: consumer of %q: %w", d.topic, ErrClosed)
	default:
	}
	if d.cl != nil {
		return d.cl, nil
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
	return driver.Capabilities{Redelivers: false, Source: d.topic, System: MessagingSystem}
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
	switch {
	case err == nil:
	case isRefusal(err):
		// A member needs READ on the group, not DESCRIBE_CONFIGS: it
		// consumes with Kafka's defaults, and learns the lock from its
		// polls.
		d.log.Warn("ferry/kafka: the share group's configuration cannot be read (not allowed); its lock, delivery limit and dead-letter topic are taken as Kafka's defaults until polls show the lock, and its start is not set", "err", err)
		gc = shareGroupConfig{lock: defaultShareLock, limit: defaultShareLimit, reset: "latest"}
	default:
		return d.requestErr(err)
	}
	if gc.resetIsDefault {
		err := alterShareGroupConfig(ctx, cl, d.group, map[string]string{shareAutoOffsetReset: "earliest"})
		switch {
		case err == nil:
			gc.reset = "earliest"
			d.log.Info("ferry/kafka: the share group had no start set; it starts at the earliest records, as Ferry's consumer groups do (set share.auto.offset.reset on the group to choose)")
		case isRefusal(err):
			d.log.Warn("ferry/kafka: the share group's start cannot be set (not allowed to alter the group's configuration); it starts at the latest records, so records produced before its first fetch are not consumed", "err", err)
		default:
			return d.requestErr(err)
		}
	}
	d.startsLatest.Store(gc.reset != "earliest")
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
func (d *shareDriver) Fetch(ctx context.Context, dst []driver.Message, room int) ([]driver.Message, error) {
	cl, err := d.client()
	if err != nil {
		return dst, driver.Fatal(err)
	}
	room = max(room, 1)
	d.mu.Lock()
	if len(d.stash) > 0 {
		n := min(room, len(d.stash))
		take := append([]*shareHandle(nil), d.stash[:n]...)
		d.stash = append(d.stash[:0], d.stash[n:]...)
		d.mu.Unlock()
		for _, h := range d.freshen(ctx, take) {
			dst = append(dst, d.message(h))
		}
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
		now := time.Now()
		d.polledAt = now
		d.mu.Lock()
		d.wave = make([]*shareHandle, len(recs))
		var lock time.Duration
		for i, r := range recs {
			until := r.AcquisitionDeadline()
			if until.IsZero() {
				until = now.Add(d.Lease())
			}
			lock = max(lock, until.Sub(now))
			d.wave[i] = &shareHandle{rec: r, lockUntil: until}
		}
		// The lock the group gives now, as the poll shows it: the
		// group's configuration may have changed since Connect read it,
		// or could not be read.
		d.lease.Store(int64(max(lock, driver.MinLease)))
		d.stash = append(d.stash[:0], d.wave...)
		d.held = len(recs)
		d.done = make(chan struct{})
		// Records polled as ctx ended still go to the loop (or, when it
		// fetches no more, to Drain): franz-go would accept them at the
		// next poll, and Close releases what nobody took.
		n := min(room, len(d.stash))
		for _, h := range d.stash[:n] {
			dst = append(dst, d.message(h))
		}
		d.stash = append(d.stash[:0], d.stash[n:]...)
		d.mu.Unlock()
	}
	if err := ctx.Err(); err != nil {
		return dst, err
	}
	return dst, d.fetchErr(ctx, cl, res)
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
func (d *shareDriver) Drain(ctx context.Context, dst []driver.Message) ([]driver.Message, error) {
	d.mu.Lock()
	take := d.stash
	d.stash = nil
	d.mu.Unlock()
	for _, h := range d.freshen(ctx, take) {
		dst = append(dst, d.message(h))
	}
	return dst, nil
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
// partition's start offset, or where the group starts (its log start,
// Ferry's default, or its end), to its end. Of
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
		if o.Err != nil {
			return fail(fmt.Sprintf("share group offsets of partition %d", p), o.Err)
		}
		if o.Lag >= 0 && o.StartOffset >= 0 {
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
		if o, ok := g.Offsets[d.topic][e.Partition]; ok && o.StartOffset >= 0 {
			from = o.StartOffset
		} else if d.startsLatest.Load() {
			from = e.Offset // the group starts at the end: nothing behind it yet
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
	return ok && sh != nil && recordAs(sh.rec, target)
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
		var back []*kgo.Record
		for _, h := range d.wave {
			if !h.settled {
				h.settled = true
				back = append(back, h.rec)
			}
		}
		d.stash, d.wave, d.held = nil, nil, 0
		if d.done != nil {
			close(d.done)
			d.done = nil
		}
		d.mu.Unlock()
		if cl == nil {
			return
		}
		d.ackMu.Lock()
		for _, r := range back {
			d.releasing(r)
			r.Ack(kgo.AckRelease)
		}
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
