package kafka_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
)

// owners follows, from the rebalance hooks of several Brokers, which
// partitions each member (named by the test) owns, and every change.
type owners struct {
	mu      sync.Mutex
	owned   map[string]map[int32]bool
	changes map[string]int
}

func newOwners() *owners {
	return &owners{owned: make(map[string]map[int32]bool), changes: make(map[string]int)}
}

func (o *owners) hook(who string) kafka.Option {
	return kafka.WithRebalanceHook(func(ev kafka.RebalanceEvent) {
		o.mu.Lock()
		defer o.mu.Unlock()
		if o.owned[who] == nil {
			o.owned[who] = make(map[int32]bool)
		}
		for _, p := range ev.Assigned {
			o.owned[who][p] = true
		}
		for _, p := range slices.Concat(ev.Revoked, ev.Lost) {
			delete(o.owned[who], p)
		}
		if len(ev.Assigned)+len(ev.Revoked)+len(ev.Lost) > 0 {
			o.changes[who]++
		}
	})
}

// of returns the partitions who owns, sorted.
func (o *owners) of(who string) []int32 {
	o.mu.Lock()
	defer o.mu.Unlock()
	var ps []int32
	for p := range o.owned[who] {
		ps = append(ps, p)
	}
	slices.Sort(ps)
	return ps
}

func (o *owners) changesOf(who string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.changes[who]
}

func (o *owners) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return fmt.Sprintf("owned %v, changes %v", o.owned, o.changes)
}

// A static member (WithInstanceID) that stops and comes back within the
// session timeout gets its partitions back, and the other member of its
// group sees no rebalance meanwhile: its partitions are neither revoked
// nor added to. A dynamic member leaves on Close, and the other takes its
// partitions at once.
func TestStaticMemberRestartsWithoutARebalance(t *testing.T) {
	own := newOwners()
	admin := newBroker(t)
	topic := newTopic(t, admin, "static", 4)
	group := testenv.UniqueName(t, "static")
	var mu sync.Mutex
	seen := make(map[string]string) // record value -> who handled it
	start := func(who string) (*kafka.Broker, *running) {
		b := newBroker(t, kafka.WithInstanceID(who),
			kafka.WithSessionTimeout(30*time.Second), own.hook(who))
		c, err := b.NewConsumer(context.Background(), topic, consumer.WithName(group))
		if err != nil {
			t.Fatal(err)
		}
		return b, runConsumer(t, c, consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
			mu.Lock()
			seen[string(m.Body)] = who
			mu.Unlock()
			return nil
		}))
	}
	ba, ra := start("a")
	_, _ = start("b")
	testenv.WaitFor(t, 60*time.Second, "a and b to share the 4 partitions", func() bool {
		return len(own.of("a")) > 0 && len(own.of("b")) > 0 && len(own.of("a"))+len(own.of("b")) == 4
	}, own.String)
	// Let the group settle: a classic cooperative rebalance ends in a
	// second round, after which nothing moves.
	time.Sleep(3 * time.Second)
	before, bChanges := own.of("a"), own.changesOf("b")

	ra.stop(t)
	_ = ba.Close()
	// A dynamic member's leave would hand its partitions to b within
	// this time; a static one's keeps them for it.
	time.Sleep(5 * time.Second)
	if n := own.changesOf("b"); n != bChanges {
		t.Fatalf("b's partitions changed %d times while a was away; want none (%s)", n-bChanges, own)
	}
	own.mu.Lock()
	own.owned["a"] = nil // a's own hook told it let go at Close
	own.mu.Unlock()

	start("a")
	testenv.WaitFor(t, 60*time.Second, "a back with its partitions", func() bool {
		return slices.Equal(own.of("a"), before)
	}, own.String)
	var recs []*kgo.Record
	for p := range int32(4) {
		recs = append(recs, &kgo.Record{Topic: topic, Partition: p, Value: []byte(strconv.Itoa(int(p)))})
	}
	produceRaw(t, recs...)
	testenv.WaitFor(t, 60*time.Second, "a record of every partition handled", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(seen) == 4
	}, own.String)
	mu.Lock()
	for p := range int32(4) {
		want := "b"
		if slices.Contains(before, p) {
			want = "a"
		}
		if got := seen[strconv.Itoa(int(p))]; got != want {
			t.Errorf("partition %d's record handled by %s, want %s (a owned %v before its restart)", p, got, want, before)
		}
	}
	mu.Unlock()
	if n := own.changesOf("b"); n != bChanges {
		t.Errorf("b's partitions changed %d times across a's restart; want none (%s)", n-bChanges, own)
	}
}

// Two processes given one instance id: the coordinator fences the member
// that was there first, whose Run ends with ErrFenced instead of rejoining
// (which would fence the newcomer in turn, for ever); the newcomer keeps
// consuming.
func TestStaticMemberFencedByAnotherWithItsIDStops(t *testing.T) {
	own := newOwners()
	admin := newBroker(t)
	topic := newTopic(t, admin, "fenced", 2)
	group := testenv.UniqueName(t, "fenced")
	first := newBroker(t, kafka.WithInstanceID("same"), own.hook("first"))
	c1, err := first.NewConsumer(context.Background(), topic, consumer.WithName(group))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ended := make(chan error, 1)
	go func() {
		ended <- c1.Run(ctx, consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }))
	}()
	testenv.WaitFor(t, 60*time.Second, "the first member to own both partitions", func() bool { return len(own.of("first")) == 2 }, own.String)

	second := newBroker(t, kafka.WithInstanceID("same"), own.hook("second"))
	c2, err := second.NewConsumer(context.Background(), topic, consumer.WithName(group))
	if err != nil {
		t.Fatal(err)
	}
	handled := make(chan string, 16)
	runConsumer(t, c2, consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
		handled <- string(m.Body)
		return nil
	}))
	select {
	case err := <-ended:
		if !errors.Is(err, kafka.ErrFenced) {
			t.Fatalf("the fenced member's Run = %v, want an error wrapping kafka.ErrFenced", err)
		}
		t.Logf("the fenced member's Run: %v", err)
	case <-time.After(90 * time.Second):
		t.Fatalf("the first member's Run did not end after another joined with its instance id (%s)", own)
	}
	// The newcomer is not fenced back: it owns the partitions and
	// consumes what comes after.
	testenv.WaitFor(t, 60*time.Second, "the second member to own both partitions", func() bool { return len(own.of("second")) == 2 }, own.String)
	time.Sleep(3 * time.Second)
	produceRaw(t, &kgo.Record{Topic: topic, Partition: 0, Value: []byte("after")}, &kgo.Record{Topic: topic, Partition: 1, Value: []byte("after")})
	for range 2 {
		select {
		case <-handled:
		case <-time.After(60 * time.Second):
			t.Fatalf("the second member stopped consuming after the first was fenced (%s)", own)
		}
	}
}

// One Broker's consumers of one group would join as one static member: the
// second is refused while the first is open, and allowed once it closed.
// Consumers of other groups share the id.
func TestInstanceIDRefusesASecondConsumerOfTheGroup(t *testing.T) {
	b := newBroker(t, kafka.WithInstanceID("pod-0"))
	ctx := context.Background()
	c1, err := b.NewConsumer(ctx, "orders", consumer.WithName("billing"))
	if err != nil {
		t.Fatal(err)
	}
	_, err = b.NewConsumer(ctx, "refunds", consumer.WithName("billing"))
	var ce *consumer.ConfigError
	if !errors.As(err, &ce) || ce.Field != "InstanceID" {
		t.Fatalf("a second consumer of group billing = %v, want a *consumer.ConfigError naming InstanceID", err)
	}
	if _, err := b.NewConsumer(ctx, "orders", consumer.WithName("shipping")); err != nil {
		t.Fatalf("a consumer of another group: %v", err)
	}
	// A Run that ends closes the driver, and the group is free again.
	rctx, cancel := context.WithCancel(ctx)
	cancel()
	if err := c1.Run(rctx, consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })); err != nil {
		t.Fatal(err)
	}
	if _, err := b.NewConsumer(ctx, "orders", consumer.WithName("billing")); err != nil {
		t.Fatalf("a consumer of group billing after the first ended: %v", err)
	}
}
