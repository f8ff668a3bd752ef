package kafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
)

// membership is what a consumer of one topic in one group has whatever
// the kind of its group (a consumer group, a share group): the topic and
// the group, what its client saw of its connections, and what its last
// Connect or Fetch told the loop failed. Both drivers embed it; its polls,
// topic look-ups and errors are theirs.
type membership struct {
	b     *Broker
	topic string
	group string
	log   *slog.Logger

	// link is what the group client saw of its connections. The rest
	// is the fetcher's own (Connect and Fetch run on the loop's fetcher
	// only).
	link     link
	failed   failure   // what the last Connect or Fetch told the loop failed
	askedAt  time.Time // when Connect or Fetch last asked whether the topic exists
	polledAt time.Time // when a poll last brought records
	// fenced is set by fenceHook when the coordinator fenced this static
	// member (WithInstanceID).
	fenced atomic.Bool
	// clients, when set, are every client of the consumer (a share
	// group's sessions), which lookAgain subscribes afresh; nil: the one
	// it is given.
	clients func() []*kgo.Client
}

// failure is what a Connect or Fetch told the loop failed, so that the
// next Fetch looks again at what failed and returns as soon as it works.
type failure uint8

const (
	failedNone  failure = iota
	failedLink          // the client could not get through, or a fetch failed
	failedTopic         // the topic does not exist
)

func failureOf(err error) failure {
	switch {
	case err == nil:
		return failedNone
	case errors.Is(err, consumer.ErrSourceNotFound):
		return failedTopic
	}
	return failedLink
}

// lookUp asks the cluster for the topic: nil, and its ID (where the
// cluster tells it), when it exists.
func (m *membership) lookUp(ctx context.Context, cl *kgo.Client) (id [16]byte, err error) {
	req := kmsg.NewPtrMetadataRequest()
	rt := kmsg.NewMetadataRequestTopic()
	rt.Topic = kmsg.StringPtr(m.topic)
	req.Topics = append(req.Topics, rt)
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return id, m.requestErr(err)
	}
	for _, t := range resp.Topics {
		if t.Topic == nil || *t.Topic != m.topic {
			continue
		}
		terr := kerr.ErrorForCode(t.ErrorCode)
		switch {
		case errors.Is(terr, kerr.UnknownTopicOrPartition):
		case terr == nil, kerr.IsRetriable(terr):
			return t.TopicID, nil // it exists (its leaders may be being elected)
		case isRefusal(terr):
			return id, driver.Fatal(fmt.Errorf("kafka: consumer of %q: %w", m.topic, refused(m.b.addrOr(""), terr)))
		default:
			return id, fmt.Errorf("kafka: consumer of %q: metadata of the topic: %w", m.topic, terr)
		}
	}
	return id, fmt.Errorf("kafka: consumer of %q: %w: the cluster at %s has no topic %q", m.topic, consumer.ErrSourceNotFound, m.b.addrOr(""), m.topic)
}

// requestErr is the error of a request to the cluster that failed with
// err: what the client saw (the dial error, the refusal) rather than the
// context's end, and where.
func (m *membership) requestErr(err error) error {
	if errors.Is(err, kgo.ErrClientClosed) {
		// The Broker closed: no retry can get through.
		return driver.Fatal(fmt.Errorf("kafka: consumer of %q: %w", m.topic, ErrClosed))
	}
	addr, seen := m.link.last()
	cause := err
	if isContextErr(err) && seen != nil {
		cause = seen
	}
	addr = m.b.addrOr(addr)
	switch {
	case refusedBy(&m.link, cause):
		return driver.Fatal(fmt.Errorf("kafka: consumer of %q: %w", m.topic, refused(addr, cause)))
	case isContextErr(cause):
		return fmt.Errorf("kafka: consumer of %q: %w: %s: no broker answered within %s: %w", m.topic, consumer.ErrUnreachable, addr, connectWithin, cause)
	}
	return fmt.Errorf("kafka: consumer of %q: %w", m.topic, unreachable(addr, cause))
}

// linkErr is the error Fetch returns when the client cannot get through
// (see link.down), nil while it can.
func (m *membership) linkErr() error {
	addr, err := m.link.down()
	switch {
	case err == nil:
		return nil
	case refusedBy(&m.link, err):
		return driver.Fatal(fmt.Errorf("kafka: consumer of %q: %w", m.topic, refused(addr, err)))
	}
	return fmt.Errorf("kafka: consumer of %q: %w", m.topic, unreachable(addr, err))
}

// askEvery is how often Fetch asks the cluster whether the topic exists
// while polls say it does not; quietAsk, while no records come. franz-go
// drops the records of a deleted topic without a word, so Fetch asks.
const (
	askEvery = time.Second
	quietAsk = driver.ReportWithin - time.Second
)

// lookAgain asks the cluster for the topic after a poll said it is gone,
// or none brought records for a while: a poll's error may be one
// franz-go kept from before the topic was made, or say the topic was
// deleted and made again (stale is the topic ID a fetch
// was refused for), which franz-go does not follow by itself: it then
// drops the topic from the group's subscription and adds it back, and the
// new topic's partitions are assigned afresh.
func (m *membership) lookAgain(ctx context.Context, cl *kgo.Client, stale [16]byte) error {
	m.askedAt = time.Now()
	lctx, cancel := context.WithTimeout(ctx, connectWithin)
	defer cancel()
	id, err := m.lookUp(lctx, cl)
	if err == nil && stale != ([16]byte{}) && id != ([16]byte{}) && id != stale {
		m.log.Warn("ferry/kafka: the topic was deleted and made again; consuming the new one from its committed offsets")
		cls := []*kgo.Client{cl}
		if m.clients != nil {
			cls = m.clients()
		}
		for _, c := range cls {
			c.PurgeTopicsFromConsuming(m.topic)
			c.AddConsumeTopics(m.topic)
		}
	}
	return err
}

// pollResult is what the polls of one Fetch brought.
type pollResult struct {
	fs      kgo.Fetches // the last poll's, with its records
	err     error       // an error no retry inside franz-go fixes
	ask     bool        // ask whether the topic exists: a poll said it is gone, or none brought records for quietAsk
	staleID [16]byte    // the topic ID a fetch was refused for (UNKNOWN_TOPIC_ID)
}

// poll polls up to max records in slices of pollSlice, until a poll
// brings records or an error franz-go does not retry, pctx ends (Settle
// woke it, or ctx ended), it is time to ask whether the topic exists (a
// poll, or the last Fetch, said it is gone: at most every askEvery; or
// none brought records for quietAsk), the client cannot get through
// (link.down), or, after the client could not get through, a broker
// answers again: so that the loop hears of failures and recoveries
// within seconds, whether records flow or not. A poll that brought
// nothing but errors franz-go retries waits out its slice, rather than
// spin while they come back at once.
func (m *membership) poll(pctx context.Context, cl *kgo.Client, max int) pollResult {
	r := pollResult{ask: m.failed == failedTopic}
	for {
		began := time.Now()
		sctx, cancel := context.WithTimeout(pctx, pollSlice)
		fs := cl.PollRecords(sctx, max)
		cancel()
		m.scan(fs, &r)
		if fs.NumRecords() > 0 {
			m.polledAt = time.Now()
		}
		switch {
		case pctx.Err() != nil, fs.NumRecords() > 0, r.err != nil:
			r.fs = fs
			return r
		case r.ask && time.Since(m.askedAt) >= askEvery:
			return r
		case time.Since(m.polledAt) >= quietAsk && time.Since(m.askedAt) >= quietAsk:
			r.ask = true
			return r
		}
		if _, err := m.link.down(); err != nil {
			return r
		}
		if m.failed == failedLink && !m.link.failing.Load() && m.link.everAnswered() {
			return r
		}
		if rest := pollSlice - time.Since(began); rest > 0 {
			t := time.NewTimer(rest)
			select {
			case <-pctx.Done():
			case <-t.C:
			}
			t.Stop()
		}
	}
}

// scan records in r the errors of fs that Fetch acts on.
func (m *membership) scan(fs kgo.Fetches, r *pollResult) {
	for i := range fs {
		for j := range fs[i].Topics {
			t := &fs[i].Topics[j]
			for k := range t.Partitions {
				err := t.Partitions[k].Err
				switch {
				case err == nil, isContextErr(err):
					// the end of a poll's slice, or Settle woke it
				case errors.Is(err, kerr.UnknownTopicOrPartition), errors.Is(err, kerr.UnknownTopicID):
					r.ask = true
					if errors.Is(err, kerr.UnknownTopicID) && t.TopicID != ([16]byte{}) {
						r.staleID = t.TopicID
					}
				case kerr.IsRetriable(err):
					// franz-go retries it
				case r.err == nil || isRefusal(err) || errors.Is(err, kgo.ErrClientClosed):
					r.err = err
				}
			}
		}
	}
}

// fetchErr is what a Fetch whose polls brought res tells the loop, and
// notes it in m.failed: the client closed, what the client saw of its
// connections (first: a failed group session, say, is its consequence),
// what the polls' errors say, or, when a poll said the topic is gone or
// none brought records for a while, whether the topic exists.
func (m *membership) fetchErr(ctx context.Context, cl *kgo.Client, res pollResult) error {
	ferr := res.err
	if errors.Is(ferr, kgo.ErrClientClosed) {
		return driver.Fatal(fmt.Errorf("kafka: fetch %q: %w", m.topic, ErrClosed))
	}
	if m.fenced.Load() || errors.Is(ferr, kerr.FencedInstanceID) {
		// Another process joined the group as this static member. franz-go
		// would rejoin, and fence it in turn, for ever.
		cause := ferr
		if cause == nil {
			cause = kerr.FencedInstanceID
		}
		return driver.Fatal(fmt.Errorf("kafka: consumer of %q in group %q: another member joined as static member %q (WithInstanceID): %w: %w",
			m.topic, m.group, m.b.cfg.instanceID, ErrFenced, cause))
	}
	err := m.linkErr()
	switch {
	case err != nil:
	case ferr != nil && refusedBy(&m.link, ferr):
		addr, _ := m.link.last()
		err = driver.Fatal(fmt.Errorf("kafka: consumer of %q: %w", m.topic, refused(m.b.addrOr(addr), ferr)))
	case ferr != nil && isDialErr(ferr):
		// franz-go gave up on something (the group session, say) because
		// it could not dial a broker: the link's grace has not run out
		// yet, but the cause is the same.
		addr, _ := m.link.last()
		err = fmt.Errorf("kafka: consumer of %q: %w", m.topic, unreachable(m.b.addrOr(addr), ferr))
	case ferr != nil:
		err = fmt.Errorf("kafka: fetch %q: %w", m.topic, ferr)
	case res.ask:
		err = m.lookAgain(ctx, cl, res.staleID)
	}
	m.failed = failureOf(err)
	return err
}
