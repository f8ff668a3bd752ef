package outbox_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/memory"
	"github.com/ferrymq/ferry/outbox"
)

// nilErrPub fails every message with a PublishError whose entries carry a nil Err.
type nilErrPub struct{ calls atomic.Int64 }

func (p *nilErrPub) Publish(ctx context.Context, dest string, msgs ...consumer.Message) error {
	p.calls.Add(1)
	pe := &consumer.PublishError{}
	for i := range msgs {
		pe.Failed = append(pe.Failed, consumer.FailedMessage{Index: i})
	}
	return pe
}

// A PublishError whose entries carry no error, or that names no message,
// is a failure of the call: the relay backs off instead of spinning.
func TestRelayBacksOffOnAPublishErrorWithoutErrors(t *testing.T) {
	b := openSQLite(t)
	ctx := testenv.Context(t, 20*time.Second)
	if err := b.add(ctx, outbox.Event{ID: "e1", Destination: "q", Key: "k"}); err != nil {
		t.Fatal(err)
	}
	pub := &nilErrPub{}
	_, stop := runRelay(t, b.store(t, ""), pub, outbox.WithBackoff(200*time.Millisecond, time.Second))
	time.Sleep(time.Second)
	stop()
	n := pub.calls.Load()
	t.Logf("Publish calls in 1s with 200ms min backoff: %d", n)
	if n > 10 {
		t.Fatalf("relay spun: %d publish calls in 1s", n)
	}
}

// lostAck is a Store whose Lease, once armed, commits and then reports an
// error (a commit whose acknowledgement was lost on the network).
type lostAck struct {
	outbox.Store
	name  string
	armed atomic.Bool
	log   *fetchLog
}

type fetchLog struct {
	mu   sync.Mutex
	last map[int]string // lane -> relay that fetched it last
	both []string
}

func (s *lostAck) Lease(ctx context.Context, owner string, ttl time.Duration) ([]int, error) {
	held, err := s.Store.Lease(ctx, owner, ttl)
	if err == nil && s.armed.CompareAndSwap(true, false) {
		return nil, errors.New("simulated: connection reset while reading COMMIT reply")
	}
	return held, err
}

func (s *lostAck) Fetch(ctx context.Context, lanes []int, max int) ([]outbox.Record, error) {
	s.log.mu.Lock()
	for _, l := range lanes {
		if p, ok := s.log.last[l]; ok && p != s.name {
			s.log.both = append(s.log.both, s.name)
		}
		s.log.last[l] = s.name
	}
	s.log.mu.Unlock()
	return s.Store.Fetch(ctx, lanes, max)
}

// A relay whose lease renewal fails lets go of every lane at once: the
// renewal may have committed all the same and handed lanes to another
// relay, and two relays must never read one lane in the same period.
func TestRelayLetsGoOfLanesWhenARenewalFails(t *testing.T) {
	b := openSQLite(t)
	br, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer br.Close()
	log := &fetchLog{last: map[int]string{}}
	a := &lostAck{Store: b.store(t, ""), name: "A", log: log}
	ra, _ := runRelay(t, a, br, outbox.WithName("A"), outbox.WithLeaseTTL(3*time.Second), outbox.WithPollInterval(10*time.Millisecond))
	testenv.WaitFor(t, 5*time.Second, "A holds 64", func() bool { return ra.Stats().Lanes == 64 })
	a.armed.Store(true) // A's next Lease gives back 32 lanes, and A sees an error
	bs := &lostAck{Store: b.store(t, ""), name: "B", log: log}
	runRelay(t, bs, br, outbox.WithName("B"), outbox.WithLeaseTTL(3*time.Second), outbox.WithPollInterval(10*time.Millisecond))
	time.Sleep(2500 * time.Millisecond)
	log.mu.Lock()
	defer log.mu.Unlock()
	// Lanes switching owner once (A -> B) is expected; switching back and
	// forth means both read them in the same period.
	flips := 0
	for i := 1; i < len(log.both); i++ {
		if log.both[i] != log.both[i-1] {
			flips++
		}
	}
	t.Logf("owner changes seen by Fetch: %d (sequence head %v)", len(log.both), log.both[:min(10, len(log.both))])
	if flips > 1 {
		t.Fatalf("A and B fetched the same lanes alternately: two relays on one lane")
	}
}

// emptyFailurePub answers every call with a PublishError that names no
// message.
type emptyFailurePub struct{ calls atomic.Int64 }

func (p *emptyFailurePub) Publish(ctx context.Context, dest string, msgs ...consumer.Message) error {
	p.calls.Add(1)
	return &consumer.PublishError{}
}

func TestRelayKeepsEventsWhenAPublishErrorNamesNoMessage(t *testing.T) {
	b := openSQLite(t)
	ctx := testenv.Context(t, 20*time.Second)
	if err := b.add(ctx, outbox.Event{ID: "e1", Destination: "q", Key: "k"}); err != nil {
		t.Fatal(err)
	}
	pub := &emptyFailurePub{}
	store := b.store(t, "")
	_, stop := runRelay(t, store, pub, outbox.WithBackoff(200*time.Millisecond, time.Second))
	testenv.WaitFor(t, 10*time.Second, "a publish attempt", func() bool { return pub.calls.Load() > 0 })
	time.Sleep(500 * time.Millisecond)
	stop()
	bl, err := store.Backlog(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if bl.Events != 1 {
		t.Fatalf("backlog %d after a PublishError that named nothing; the event was taken as published", bl.Events)
	}
	if n := pub.calls.Load(); n > 10 {
		t.Fatalf("relay spun: %d publish calls", n)
	}
}
