package kafka

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/ferrymq/ferry/consumer/driver"
)

// This file is how a share group consumer keeps polling while records of
// an earlier poll are still held.
//
// franz-go accepts, at a client's next poll, every record of its poll
// before that has no final acknowledgement yet (a renewed one included).
// So one client polls again only once all of its last poll's records are
// settled, and with one client a consumer holding a single record (a
// handler still running, a message retried in place during an outage)
// fetched nothing else: the breaker saw no other record fail, and its
// half-open trials spent that one record's attempts; a slow record held
// its whole wave's workers idle. The driver therefore runs up to
// shareSessions clients, each a member of the share group with its own
// polls ("sessions"): a session polls whenever its last poll's records are
// all settled, in a goroutine of its own, and another session is made when
// every session has held records for straggleAfter while the loop asked
// for more.
//
// The first session polls up to the loop's in-flight bound, as one client
// would; the others, made only when records straggle, a quarter of it
// each. So a consumer whose records flow polls as one client does, and one
// whose sessions all hold records may hold up to 1.75 times the bound: the
// excess waits in the driver under renewed locks (a smaller poll of the
// first session cost a fifth of the throughput where records flow).
//
// A session is a member: when a topic has more partitions than the
// group has members, the coordinator splits the partitions among them, and
// a session's partitions are fetched by it alone, so the records of a
// session that holds a record wait for it there (or for another process's
// members). On a topic with fewer partitions than members, every member
// shares them.

// shareSessions is the most sessions (share group members) one consumer
// runs; fewer when its in-flight bound is smaller.
const shareSessions = 4

// straggleAfter is how long every session must have held records, with
// the loop asking for more, before another session is made: longer than a
// poll's records take to settle when they flow (a few milliseconds), so a
// consumer whose records flow stays one member, polling in larger waves.
const straggleAfter = 100 * time.Millisecond

// shareSession is one client of a share group consumer and its last poll.
type shareSession struct {
	cl      *kgo.Client
	cancel  context.CancelFunc // ends the client's context: its requests under way fail
	perPoll int32              // a poll's records at most
	fetches fetchWatch
	// The rest is guarded by the driver's mu.
	wave    []*shareHandle // its last poll's records
	held    int            // of them, those not settled yet
	polling bool           // a poll of it is under way
}

// idle says whether s may poll: no poll of it is under way and every
// record of its last poll is settled. d.mu is held.
func (s *shareSession) idle() bool { return !s.polling && s.held == 0 }

// newSession makes the client of one session; the first is made by
// client(), before the group is configured, the others subscribed at once.
func (d *shareDriver) newSession(subscribe bool) (*shareSession, error) {
	// The client's context (the user's kgo.WithContext, if any): Close
	// ends it once a leave has waited long enough.
	ctx, cancel := context.WithCancel(d.b.cfg.kgoContext)
	s := &shareSession{perPoll: d.bound, cancel: cancel}
	if subscribe {
		s.perPoll = max(d.bound/shareSessions, 1)
	}
	opts := []kgo.Opt{
		kgo.ShareGroup(d.group),
		kgo.ShareMaxRecords(s.perPoll),
		// At most perPoll records a poll, and no fetch ahead of a poll:
		// a record fetched ahead would sit here under its lock while
		// other members could work on it.
		kgo.ShareMaxRecordsStrict(),
		kgo.ShareAckCallback(func(_ *kgo.Client, rs kgo.ShareAckResults) { d.acked(s, rs) }),
		kgo.WithHooks(&s.fetches),
		kgo.FetchMaxWait(shareFetchWait),
		kgo.WithContext(ctx),
	}
	if subscribe {
		opts = append(opts, kgo.ConsumeTopics(d.topic))
	}
	cl, err := kgo.NewClient(d.b.clientOpts(&d.link, opts...)...)
	if err != nil {
		cancel()
		return nil, fmt.Errorf("kafka: consumer of %q: %w", d.topic, err)
	}
	s.cl = cl
	return s, nil
}

// startPolls starts a poll of every idle session, and makes another
// session when none has been idle for straggleAfter and fewer than the
// most run (and none failed lately). It says whether another session may
// be made when the wait is over. d.mu is held; the group is configured;
// the fetcher calls it (busySince is the fetcher's).
func (d *shareDriver) startPolls() (canGrow bool) {
	if d.pollsStopped {
		return false
	}
	busy := true
	for _, s := range d.sessions {
		if s.polling || s.held == 0 {
			busy = false
		}
	}
	now := time.Now()
	switch {
	case !busy:
		d.busySince = time.Time{}
	case d.busySince.IsZero():
		d.busySince = now
	}
	canGrow = busy && len(d.sessions) < d.maxSessions && now.After(d.noSessionUntil)
	if canGrow && now.Sub(d.busySince) >= straggleAfter {
		d.busySince = now
		s, err := d.newSession(true)
		if err != nil {
			d.sessionFailed(err)
		} else {
			d.sessions = append(d.sessions, s)
			d.log.Debug("ferry/kafka: every share group session holds records; another one joins the group", "sessions", len(d.sessions))
		}
	}
	for _, s := range d.sessions {
		if s.idle() {
			s.polling = true
			d.pollers.Add(1)
			go d.pollSession(s)
		}
	}
	return canGrow
}

// sessionFailed notes that another session could not be made or failed:
// the consumer goes on with the sessions it has, and makes none for a
// while. d.mu is held.
func (d *shareDriver) sessionFailed(err error) {
	d.noSessionUntil = time.Now().Add(sessionRetry)
	if ok, left := d.warns.Allow("session"); ok {
		d.log.Warn("ferry/kafka: another share group member of this consumer could not join or failed; the consumer goes on with the members it has, which poll again when their records are settled",
			"sessions", len(d.sessions), "retry_in", sessionRetry, "err", err, "unlogged", left)
	}
}

// sessionRetry is how long a consumer makes no session after one could
// not be made or failed (the group may be full: group.share.max.size).
const sessionRetry = time.Minute

// stopPolling ends the sessions' polls and waits for them, and for the
// records their last ShareFetch requests bring after that: what they
// brought is in the stash then. Once it began, no poll starts.
func (d *shareDriver) stopPolling() {
	d.mu.Lock()
	d.pollsStopped = true
	d.stopPolls()
	d.mu.Unlock()
	d.pollers.Wait()
	d.takeLateFetches()
}

// takeLateFetches takes into the stash the records that idle sessions'
// ShareFetch requests brought after their polls ended.
//
// A poll that ends (its context cancelled) leaves its session's last
// ShareFetch at the broker, which holds it up to the fetch's wait
// (shareFetchWait) for records to come. The records it brings are
// acquired for this member, counting a delivery, and no poll takes them:
// the client's Close gave them back, each on one more delivery, and one on
// the group's last delivery was archived (dropped, without a dead-letter
// topic), never run and with nothing said. So stopPolling waits, at most
// lateFetchWait, until no ShareFetch of an idle session is unanswered and
// nothing more has come for lateMargin, and polls what they brought:
// Drain hands it to the loop, Close gives it back with a warning.
//
// Only idle sessions are polled, and one only until a poll brings it
// records: franz-go accepts a client's unsettled records of its last poll
// at its next one. A session holding records (or one whose extra fetch
// franz-go sent while it held them, or that the brief poll here let go)
// keeps what it buffered; Close warns of it. A Drain and a Close at once
// (a Broker closed while its consumer stops) take turns here.
func (d *shareDriver) takeLateFetches() {
	d.lateMu.Lock()
	defer d.lateMu.Unlock()
	d.mu.Lock()
	var idle []*shareSession
	for _, s := range d.sessions {
		if s.idle() {
			s.polling = true // taken: nothing else polls it or counts it idle
			idle = append(idle, s)
		}
	}
	d.mu.Unlock()
	deadline := time.Now().Add(lateFetchWait)
	for _, s := range idle {
		since := time.Now()
		var recs []*kgo.Record
		for len(recs) == 0 && time.Now().Before(deadline) {
			if s.cl.BufferedFetchRecords() == 0 {
				if s.fetches.quiet(since) {
					break
				}
				time.Sleep(5 * time.Millisecond)
				continue
			}
			// A done context: PollRecords takes what is buffered and
			// does not wait. It finds nothing when franz-go counted
			// the records before it made them ready: then again.
			s.cl.PollRecords(doneContext, int(s.perPoll)).EachRecord(func(rec *kgo.Record) {
				if rec.Topic == d.topic {
					recs = append(recs, rec)
				} else {
					rec.Ack(kgo.AckRelease) // not ours (never, today)
				}
			})
			since = time.Now()
		}
		if len(recs) > 0 {
			d.log.Debug("ferry/kafka: records a share group session fetched as its polls stopped go to the consumer", "count", len(recs))
		}
		d.polled(s, recs, pollResult{}, true)
	}
}

// shareFetchWait is how long the broker holds a share group session's
// ShareFetch for records to come (kgo.FetchMaxWait, set on every session:
// franz-go's default for share groups).
const shareFetchWait = 500 * time.Millisecond

// lateFetchWait is the longest stopPolling waits for the sessions' last
// ShareFetch requests: the broker holds one up to shareFetchWait, and its
// answer has to get here.
const lateFetchWait = shareFetchWait + 500*time.Millisecond

// doneContext is a context that is already done.
var doneContext = func() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}()

// fetchWatch is a franz-go hook of one session's client that counts its
// ShareFetch requests the broker has not answered.
type fetchWatch struct {
	out       atomic.Int32 // written, not answered
	writtenAt atomic.Int64 // unix nanoseconds of the last one written
	readAt    atomic.Int64 // unix nanoseconds of the last answer
}

var (
	_ kgo.HookBrokerWrite = (*fetchWatch)(nil)
	_ kgo.HookBrokerRead  = (*fetchWatch)(nil)
)

// OnBrokerWrite counts a ShareFetch written.
func (w *fetchWatch) OnBrokerWrite(_ kgo.BrokerMetadata, key int16, _ int, _, _ time.Duration, err error) {
	if key == kmsg.ShareFetch.Int16() && err == nil {
		w.writtenAt.Store(time.Now().UnixNano())
		w.out.Add(1)
	}
}

// OnBrokerRead counts a ShareFetch answered (or failed as it was read).
func (w *fetchWatch) OnBrokerRead(_ kgo.BrokerMetadata, key int16, _ int, _, _ time.Duration, _ error) {
	if key == kmsg.ShareFetch.Int16() {
		w.readAt.Store(time.Now().UnixNano())
		w.out.Add(-1)
	}
}

// quiet says whether nothing more comes of the session's fetches: none
// is unanswered, and lateMargin passed since the last answer (franz-go
// decodes it and buffers its records after the read) and since since (a
// fetch franz-go let go just before a poll ended is written a moment
// later). A fetch written longer ago than lateFetchWait counts as
// answered: a request queued behind one whose connection died is failed
// without a read, and would count as unanswered for ever.
func (w *fetchWatch) quiet(since time.Time) bool {
	now := time.Now()
	if now.Sub(since) < lateMargin || now.Sub(time.Unix(0, w.readAt.Load())) < lateMargin {
		return false
	}
	return w.out.Load() <= 0 || now.Sub(time.Unix(0, w.writtenAt.Load())) > lateFetchWait
}

// lateMargin is how long after a ShareFetch's answer (or a poll's end)
// stopPolling looks for its records.
const lateMargin = 50 * time.Millisecond

// pollSession polls s, in slices of pollSlice, until a poll brings records
// or an error franz-go does not retry, or the driver stops polling; then
// it hands them to Fetch (the records through the stash, where Extend
// renews their locks until the loop takes them). A poll's errors that
// franz-go retries, and its word that the topic is gone, go to Fetch as
// they come.
func (d *shareDriver) pollSession(s *shareSession) {
	defer d.pollers.Done()
	for {
		began := time.Now()
		sctx, cancel := context.WithTimeout(d.pollCtx, pollSlice)
		fs := s.cl.PollRecords(sctx, int(s.perPoll))
		cancel()
		var r pollResult
		d.scan(fs, &r)
		var recs []*kgo.Record
		fs.EachRecord(func(rec *kgo.Record) {
			if rec.Topic == d.topic {
				recs = append(recs, rec)
			} else {
				rec.Ack(kgo.AckRelease) // not ours: another subscription of the client's (never, today)
			}
		})
		end := len(recs) > 0 || r.err != nil || d.pollCtx.Err() != nil
		d.polled(s, recs, r, end)
		if end {
			return
		}
		if rest := pollSlice - time.Since(began); rest > 0 {
			t := time.NewTimer(rest)
			select {
			case <-d.pollCtx.Done():
			case <-t.C:
			}
			t.Stop()
		}
	}
}

// polled takes in what a poll of s brought: its records become s's wave
// and go to the stash, and its errors wait for Fetch; end says the poll
// is over (s is no longer polling). An error of a session other than the
// first, with no records, ends that session instead: the first reports
// whatever concerns them all (the cluster unreachable, a refusal), and an
// error of its own (the group is full, say) must not fail a consumer that
// consumes. It wakes Fetch.
func (d *shareDriver) polled(s *shareSession, recs []*kgo.Record, r pollResult, end bool) {
	now := time.Now()
	var retired *shareSession
	d.mu.Lock()
	if end {
		s.polling = false
	}
	switch {
	case r.err == nil, d.pollsStopped:
	case s != d.sessions[0] && len(recs) == 0:
		d.sessions = slices.DeleteFunc(d.sessions, func(x *shareSession) bool { return x == s })
		d.sessionFailed(r.err)
		retired = s
	case d.pending.err == nil || isRefusal(r.err) || errors.Is(r.err, kgo.ErrClientClosed):
		d.pending.err = r.err
	}
	if r.ask {
		d.pending.ask = true
		if r.staleID != ([16]byte{}) {
			d.pending.staleID = r.staleID
		}
	}
	if len(recs) > 0 {
		d.recordsAt = now
		s.wave = make([]*shareHandle, len(recs))
		var lock time.Duration
		for i, rec := range recs {
			until := rec.AcquisitionDeadline()
			if until.IsZero() {
				until = now.Add(d.Lease())
			}
			lock = max(lock, until.Sub(now))
			s.wave[i] = &shareHandle{rec: rec, s: s, lockUntil: until}
		}
		// The lock the group gives now, as the poll shows it: the
		// group's configuration may have changed since Connect read it,
		// or could not be read.
		d.lease.Store(int64(max(lock, driver.MinLease)))
		d.stash = append(d.stash, s.wave...)
		s.held = len(recs)
	}
	d.mu.Unlock()
	if retired != nil {
		// It holds no record: leaving gives back nothing. Its leave may
		// retry for a while; Close waits for it, polls do not.
		d.retiring.Go(func() { d.closeSession(retired) })
	}
	d.wakeFetch()
}

// wakeFetch tells a waiting Fetch that something changed: a poll brought
// records or errors, or a session became idle.
func (d *shareDriver) wakeFetch() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// renewStash renews, while the driver runs, the locks of records polled
// that the loop has not taken (Extend renews those a third gone): the loop
// calls Extend only for deliveries of its own that are due, and the
// sessions' polls go on bringing records while it holds none (a breaker's
// pause, a rate limit).
func (d *shareDriver) renewStash() {
	defer d.retiring.Done()
	for {
		every := min(max(d.Lease()/3, 250*time.Millisecond), 10*time.Second)
		t := time.NewTimer(every)
		select {
		case <-d.stop:
			t.Stop()
			return
		case <-t.C:
		}
		d.mu.Lock()
		waiting := len(d.stash) > 0
		d.mu.Unlock()
		if waiting {
			ctx, cancel := context.WithTimeout(d.pollCtx, every)
			_ = d.Extend(ctx, nil, 0) // it logs what it lost
			cancel()
		}
	}
}
