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

// shareDriver is a consumer of one topic in a share group (KIP-932):
// Kafka as a queue. The broker hands each record to one member under an
// acquisition lock, and the member acknowledges it by itself: ACCEPT
// (done), RELEASE (deliver it again, to anyone), or RENEW (keep the lock).
// There are no offsets to commit and no order.
//
// The driver polls through up to shareSessions clients, each a member of
// the group (sharesession.go says why and how). Fetch runs on the loop's
// fetcher, Settle on its settler, Extend on its extender, and the
// sessions' polls in goroutines of their own; mu guards the sessions and
// the stash they share, and ackMu makes Settle's and Extend's
// acknowledgements one flush at a time, so that a flush's failures are
// its own.
type shareDriver struct {
	membership
	bound       int32 // the loop's in-flight bound: the first session's poll's records at most
	maxSessions int   // the most sessions: shareSessions, or the in-flight bound when smaller

	lease  atomic.Int64 // time.Duration: the group's record lock duration
	limit  atomic.Int32 // the group's delivery count limit
	deadTo atomic.Pointer[string]
	// startsLatest is true when the group starts at the latest records
	// (its share.auto.offset.reset says so, or could not be set), for Lag.
	startsLatest atomic.Bool
	warns        *ratelog.Limiter // WARN lines, a few a minute of each kind

	mu       sync.Mutex
	sessions []*shareSession // the first made by client(), the others by startPolls
	ready    bool            // the group is configured and the topic subscribed
	stash    []*shareHandle  // records polled that the loop has not taken yet
	pending  pollResult      // what the polls said since Fetch last looked (no records)
	// recordsAt is when a poll last brought records, for the fetcher's
	// polledAt.
	recordsAt time.Time
	// noSessionUntil is when another session may be made again, after
	// one could not be made or failed.
	noSessionUntil time.Time
	// busySince is when startPolls first found every session holding
	// records; zero while one is idle or polling.
	busySince    time.Time
	pollsStopped bool // stopPolling began: no poll starts
	// lateMu makes the takeLateFetches of a Drain and of a Close take
	// turns.
	lateMu sync.Mutex

	wake      chan struct{}      // a poll ended or a session became idle (a Fetch may wait on it)
	pollCtx   context.Context    // the sessions' polls run until it ends (Drain, Close)
	stopPolls context.CancelFunc // ends pollCtx
	pollers   sync.WaitGroup     // the polls under way
	// retiring counts what Close waits for besides the polls: the
	// clients of sessions given up, and renewStash.
	retiring  sync.WaitGroup
	closeOnce sync.Once
	stop      chan struct{}

	ackMu sync.Mutex // one round of flushes of acknowledgements at a time; the handles' lock reckoning

	failsMu sync.Mutex
	// flushing holds, for each session whose flush a Settle or Extend
	// waits for, what the broker refused it since that flush began.
	flushing map[*shareSession][]kgo.ShareAckResult
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
	s       *shareSession // the session that polled it, which acknowledges it
	settled bool          // d.mu: acknowledged, or being
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
	n = min(n, 1<<20)
	sessions := min(shareSessions, n)
	pctx, stopPolls := context.WithCancel(context.Background())
	d := &shareDriver{
		membership:  membership{b: b, topic: topic, group: group, log: b.log.With("topic", topic, "share_group", group)},
		bound:       int32(n),
		maxSessions: sessions,
		warns:       ratelog.New(3, time.Minute),
		wake:        make(chan struct{}, 1),
		pollCtx:     pctx,
		stopPolls:   stopPolls,
		stop:        make(chan struct{}),
		flushing:    make(map[*shareSession][]kgo.ShareAckResult),
	}
	d.clients = d.sessionClients
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

// client returns the first session's client, making it on first use. It
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
	if len(d.sessions) > 0 {
		return d.sessions[0].cl, nil
	}
	s, err := d.newSession(false)
	if err != nil {
		return nil, err
	}
	d.sessions = append(d.sessions, s)
	d.retiring.Add(1)
	go d.renewStash()
	return s.cl, nil
}

// sessionClients returns the clients of every session.
func (d *shareDriver) sessionClients() []*kgo.Client {
	d.mu.Lock()
	defer d.mu.Unlock()
	cls := make([]*kgo.Client, len(d.sessions))
	for i, s := range d.sessions {
		cls[i] = s.cl
	}
	return cls
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

// Fetch hands out the records the sessions' polls brought that the loop
// has not taken yet, starting a poll of every session whose records are
// all settled (and another session when none is and the loop has room);
// until records come it waits, returning within seconds to report what
// failed or recovered, as the consumer group driver's polls do.
func (d *shareDriver) Fetch(ctx context.Context, dst []driver.Message, room int) ([]driver.Message, error) {
	cl, err := d.client()
	if err != nil {
		return dst, driver.Fatal(err)
	}
	room = max(room, 1)
	d.mu.Lock()
	ready := d.ready
	d.mu.Unlock()
	if !ready {
		// Connect has not got through yet; it configures the group.
		if err := d.Connect(ctx); err != nil {
			return dst, err
		}
	}
	res := pollResult{ask: d.failed == failedTopic}
	var taken pollResult // of res, what came from the polls
	for {
		d.mu.Lock()
		if len(d.stash) > 0 {
			// Records polled as ctx ended still go to the loop (or,
			// when it fetches no more, to Drain): Close gives back what
			// nobody took.
			n := min(room, len(d.stash))
			take := append([]*shareHandle(nil), d.stash[:n]...)
			d.stash = append(d.stash[:0], d.stash[n:]...)
			d.polledAt = d.recordsAt
			// What the polls said that this Fetch took and did not act
			// on waits for the next.
			if taken.err != nil && d.pending.err == nil {
				d.pending.err = taken.err
			}
			d.pending.ask = d.pending.ask || taken.ask
			if d.pending.staleID == ([16]byte{}) {
				d.pending.staleID = taken.staleID
			}
			d.mu.Unlock()
			for _, h := range d.freshen(ctx, take) {
				dst = append(dst, d.message(h))
			}
			return dst, nil
		}
		if p := d.pending; p.err != nil || p.ask {
			if p.err != nil && (res.err == nil || isRefusal(p.err) || errors.Is(p.err, kgo.ErrClientClosed)) {
				res.err, taken.err = p.err, p.err
			}
			taken.ask = taken.ask || p.ask
			if p.staleID != ([16]byte{}) {
				taken.staleID = p.staleID
			}
			if p.ask {
				res.ask = true
			}
			if p.staleID != ([16]byte{}) {
				res.staleID = p.staleID
			}
			d.pending = pollResult{}
		}
		if ctx.Err() != nil {
			d.mu.Unlock()
			return dst, ctx.Err()
		}
		canGrow := d.startPolls()
		d.mu.Unlock()
		switch {
		case res.err != nil, res.ask && time.Since(d.askedAt) >= askEvery:
			return dst, d.fetchErr(ctx, cl, res)
		case time.Since(d.polledAt) >= quietAsk && time.Since(d.askedAt) >= quietAsk:
			res.ask = true
			return dst, d.fetchErr(ctx, cl, res)
		}
		if _, err := d.link.down(); err != nil {
			return dst, d.fetchErr(ctx, cl, res)
		}
		if d.failed == failedLink && !d.link.failing.Load() && d.link.everAnswered() {
			return dst, d.fetchErr(ctx, cl, res)
		}
		wait := pollSlice
		if canGrow {
			// every session holds records: look again when another
			// may be made
			wait = min(wait, max(straggleAfter-time.Since(d.busySince), time.Millisecond))
		}
		t := time.NewTimer(wait)
		select {
		case <-d.wake:
		case <-t.C:
		case <-ctx.Done():
		case <-d.stop:
			t.Stop()
			return dst, driver.Fatal(fmt.Errorf("kafka: fetch %q: %w", d.topic, ErrClosed))
		}
		t.Stop()
	}
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

// Drain hands the loop, when it stops fetching, the records polled that
// it has not taken, to run within its grace: given back, each would count
// one more delivery. It stops the sessions' polls first.
func (d *shareDriver) Drain(ctx context.Context, dst []driver.Message) ([]driver.Message, error) {
	d.stopPolling()
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
// the sum, InFlight is what this consumer holds (the unsettled records of
// its sessions' last polls) and Messages the rest; OldestAge is the age of the
// oldest record this consumer holds: the broker tells no age of a share
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
	for _, s := range d.sessions {
		for _, h := range s.wave {
			if !h.settled {
				out.InFlight++
				if ts := h.rec.Timestamp; oldest.IsZero() || ts.Before(oldest) {
					oldest = ts
				}
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

// Close stops the sessions' polls, gives back the records polled that
// nobody took, sends every acknowledgement still pending, and leaves the
// group (franz-go releases what is still only renewed). The loop calls it
// when Run ends.
func (d *shareDriver) Close() error {
	d.closeOnce.Do(func() {
		close(d.stop)
		d.b.forget(d)
		d.stopPolling()
		d.mu.Lock()
		sessions := d.sessions
		back := map[*shareSession][]*kgo.Record{}
		for _, s := range sessions {
			for _, h := range s.wave {
				if !h.settled {
					h.settled = true
					back[s] = append(back[s], h.rec)
				}
			}
			s.wave, s.held = nil, 0
		}
		untaken := len(d.stash)
		d.stash = nil
		d.mu.Unlock()
		d.wakeFetch()
		var buffered int64
		for _, s := range sessions {
			// A fetch that is still out is counted once it is here.
			for wait := time.Now().Add(lateFetchWait); !s.fetches.quiet(time.Time{}) && time.Now().Before(wait); {
				time.Sleep(5 * time.Millisecond)
			}
			buffered += s.cl.BufferedFetchRecords()
		}
		if untaken > 0 || buffered > 0 {
			// Each counts one more delivery, for records that never
			// ran: Drain hands the loop what the polls brought, so this
			// is a Close without a Drain, or a fetch franz-go sent
			// while its session held records (releasing warns of those
			// on their last delivery that it sees; the buffered ones it
			// cannot see).
			d.log.Warn("ferry/kafka: records this share group consumer fetched and never ran are given back as it closes; each counts one more delivery, and one on the group's last delivery is archived",
				"polled_not_taken", untaken, "fetched_not_polled", buffered)
		}
		d.ackMu.Lock()
		var wg sync.WaitGroup
		for _, s := range sessions {
			wg.Go(func() {
				for _, r := range back[s] {
					d.releasing(r)
					r.Ack(kgo.AckRelease)
				}
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				if err := s.cl.FlushAcks(ctx); err != nil {
					d.log.Warn("ferry/kafka: acknowledgements not sent as the consumer stopped; their records come back when their locks run out", "err", err)
				}
				cancel()
				d.closeSession(s)
			})
		}
		wg.Wait()
		d.ackMu.Unlock()
		// renewStash ends with stop (an Extend of it under way waited
		// for ackMu, and its flush ends with the polls' context).
		d.retiring.Wait()
	})
	return nil
}

// closeSession leaves the group with s's client and closes it, waiting
// for the leave at most leaveWithin. franz-go's leave first waits for the
// client's requests under way, which wait for the cluster's answer (a
// silent cluster held a Close for over a minute): past leaveWithin they
// are cancelled, with the client's context. The member it could not take
// out of the group drops out when its session times out, and the records
// it held come back as their locks run out.
func (d *shareDriver) closeSession(s *shareSession) {
	ctx, cancel := context.WithTimeout(context.Background(), leaveWithin)
	err := s.cl.LeaveGroupContext(ctx)
	cancel()
	if err != nil {
		s.cancel()
		if ok, left := d.warns.Allow("leave"); ok {
			d.log.Warn("ferry/kafka: a share group member could not leave the group; the group drops it when its session times out, and the records it held come back as their locks run out",
				"within", leaveWithin, "err", err, "unlogged", left)
		}
	}
	s.cl.Close()
	s.cancel()
}

// leaveWithin bounds how long a share group member's leave may take as
// the consumer stops.
const leaveWithin = 5 * time.Second
