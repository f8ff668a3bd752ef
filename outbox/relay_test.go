package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/memory"
	"github.com/ferrymq/ferry/outbox"
	"github.com/ferrymq/ferry/outbox/pgoutbox"
	"github.com/ferrymq/ferry/outbox/sqliteoutbox"
)

const queue = "orders"

// fast are relay options that keep tests short.
func fast(extra ...outbox.Option) []outbox.Option {
	return append([]outbox.Option{
		outbox.WithLeaseTTL(time.Second),
		outbox.WithPollInterval(200 * time.Millisecond),
		outbox.WithBackoff(10*time.Millisecond, 200*time.Millisecond),
	}, extra...)
}

func distinct(msgs []consumer.Message) int {
	seen := map[string]bool{}
	for _, m := range msgs {
		seen[m.Header(outbox.EventIDHeader)] = true
	}
	return len(seen)
}

// checkOrder checks that every message carries its id header and that, per
// key, the first delivery of each event comes in ascending body order (the
// commit order the test stamped in). It returns the number of distinct
// events and of duplicates.
func checkOrder(t *testing.T, msgs []consumer.Message) (events, dups int) {
	t.Helper()
	seen := map[string]bool{}
	last := map[string]int64{}
	for _, m := range msgs {
		id := m.Header(outbox.EventIDHeader)
		if id == "" || id != m.ID {
			t.Fatalf("message %q: id header %q", m.ID, id)
		}
		if seen[id] {
			dups++
			continue
		}
		seen[id] = true
		n, err := strconv.ParseInt(string(m.Body), 10, 64)
		if err != nil {
			t.Fatalf("message %s: body %q: %v", id, m.Body, err)
		}
		if prev, ok := last[m.Key]; ok && n <= prev {
			t.Fatalf("key %s: event %d published after %d: out of commit order", m.Key, n, prev)
		}
		last[m.Key] = n
	}
	return len(seen), dups
}

// writeStamped commits one transaction with per events of key, whose bodies
// record the key's commit order: the counter row is bumped after Add, so
// its value follows commit order, not insert order.
func writeStamped(ctx context.Context, b *backend, key string, per int) error {
	return b.tx(ctx, func(add addFunc, exec execFunc) error {
		evs := make([]outbox.Event, per)
		for j := range evs {
			evs[j] = outbox.Event{ID: fmt.Sprintf("%s-%d-%d", key, rand.Int64(), j), Destination: queue, Key: key}
		}
		if err := add(ctx, evs...); err != nil {
			return err
		}
		n, err := exec(ctx, b.counter, key)
		if err != nil {
			return fmt.Errorf("counter: %w", err)
		}
		for j, e := range evs {
			if _, err := exec(ctx, b.stamp, []byte(strconv.FormatInt(n*10+int64(j), 10)), []byte(e.ID)); err != nil {
				return fmt.Errorf("stamp: %w", err)
			}
		}
		return nil
	})
}

// writeConcurrently commits txs transactions of per events each, over keys
// keys, from workers goroutines, retrying transactions the database aborted.
func writeConcurrently(ctx context.Context, t *testing.T, b *backend, workers, txs, per, keys int, after func(done int64)) {
	t.Helper()
	var (
		next  atomic.Int64
		wg    sync.WaitGroup
		errMu sync.Mutex
		first error
	)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1)
				if i > int64(txs) || ctx.Err() != nil {
					return
				}
				key := "k" + strconv.Itoa(rand.IntN(keys))
				var err error
				for try := 0; try < 50; try++ {
					if err = writeStamped(ctx, b, key, per); err == nil {
						break
					}
					time.Sleep(time.Duration(try+1) * 5 * time.Millisecond)
				}
				if err != nil {
					errMu.Lock()
					first = errors.Join(first, err)
					errMu.Unlock()
					return
				}
				if after != nil {
					after(i)
				}
			}
		}()
	}
	wg.Wait()
	if first != nil {
		t.Fatalf("writing: %v", first)
	}
}

func TestInvalidEventRefusedAtWrite(t *testing.T) {
	forEachBackend(t, func(t *testing.T, b *backend) {
		ctx := testenv.Context(t, 30*time.Second)
		cases := []struct {
			ev    outbox.Event
			field string
		}{
			{outbox.Event{ID: "no-dest", Key: "k", Body: []byte("x")}, "Destination"},
			{outbox.Event{ID: "too-big", Destination: queue, Body: make([]byte, 256<<10+1)}, "Size"},
		}
		for _, c := range cases {
			err := b.tx(ctx, func(add addFunc, _ execFunc) error {
				err := add(ctx, outbox.Event{Destination: queue, Key: "ok"}, c.ev)
				var ee *outbox.EventError
				if !errors.As(err, &ee) || !errors.Is(err, outbox.ErrInvalidEvent) {
					t.Fatalf("%s: Add = %v, want an *outbox.EventError", c.field, err)
				}
				if ee.Field != c.field || ee.ID != c.ev.ID || ee.Index != 1 {
					t.Fatalf("error %+v, want field %s, id %s, index 1", ee, c.field, c.ev.ID)
				}
				// The refused call wrote nothing; the transaction carries on.
				return add(ctx, outbox.Event{ID: "valid-" + c.field, Destination: queue, Key: "ok"})
			})
			if err != nil {
				t.Fatal(err)
			}
		}
		bl, err := b.store(t, "").Backlog(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if bl.Events != 2 {
			t.Fatalf("backlog %d events, want the 2 valid ones only", bl.Events)
		}
	})
}

func TestRollbackPublishesNothingCommitPublishesOnce(t *testing.T) {
	forEachBackend(t, func(t *testing.T, b *backend) {
		ctx := testenv.Context(t, 60*time.Second)
		br, err := memory.New()
		if err != nil {
			t.Fatal(err)
		}
		defer br.Close()
		errRollback := errors.New("roll back")
		err = b.tx(ctx, func(add addFunc, _ execFunc) error {
			if err := add(ctx, outbox.Event{ID: "rolled-back", Destination: queue, Key: "k"}); err != nil {
				return err
			}
			return errRollback
		})
		if !errors.Is(err, errRollback) {
			t.Fatal(err)
		}
		if err := b.add(ctx, outbox.Event{ID: "committed", Destination: queue, Key: "k",
			Body: []byte("hello"), Headers: map[string]string{"type": "order.created"}}); err != nil {
			t.Fatal(err)
		}
		st := b.store(t, "")
		r, _ := runRelay(t, st, br, fast()...)
		testenv.WaitFor(t, 30*time.Second, "the committed event was not published", func() bool {
			return len(br.Messages(queue)) > 0
		})
		testenv.WaitFor(t, 30*time.Second, "the backlog did not drain", func() bool {
			bl, err := st.Backlog(ctx)
			return err == nil && bl.Events == 0
		})
		msgs := br.Messages(queue)
		if len(msgs) != 1 {
			t.Fatalf("%d messages published, want 1: %+v", len(msgs), msgs)
		}
		m := msgs[0]
		if m.ID != "committed" || m.Header(outbox.EventIDHeader) != "committed" || m.Key != "k" ||
			string(m.Body) != "hello" || m.Header("type") != "order.created" {
			t.Fatalf("published %+v", m)
		}
		testenv.WaitFor(t, 30*time.Second, "the relay did not count the event", func() bool { return r.Stats().Published == 1 })
	})
}

func TestCrashBetweenPublishAndDeletePublishesAgain(t *testing.T) {
	forEachBackend(t, func(t *testing.T, b *backend) {
		ctx := testenv.Context(t, 60*time.Second)
		br, err := memory.New()
		if err != nil {
			t.Fatal(err)
		}
		defer br.Close()
		if err := b.add(ctx, outbox.Event{ID: "ev-1", Destination: queue, Key: "k", Body: []byte("1")}); err != nil {
			t.Fatal(err)
		}
		st := b.store(t, "")
		first, err := outbox.NewRelay(st, br, fast(outbox.WithName("first"))...)
		if err != nil {
			t.Fatal(err)
		}
		crashed := make(chan struct{})
		outbox.CrashAfterPublish(first, func() bool { close(crashed); return true })
		done := make(chan error, 1)
		go func() { done <- first.Run(ctx) }()
		<-crashed
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if n := len(br.Messages(queue)); n != 1 {
			t.Fatalf("%d messages after the crash, want 1", n)
		}
		if bl, err := st.Backlog(ctx); err != nil || bl.Events != 1 {
			t.Fatalf("backlog after the crash %+v, %v: want the event still there", bl, err)
		}

		// A new relay takes the lanes once the dead one's lease expires.
		runRelay(t, st, br, fast(outbox.WithName("second"))...)
		testenv.WaitFor(t, 30*time.Second, "the event was not published again", func() bool {
			bl, err := st.Backlog(ctx)
			return err == nil && bl.Events == 0
		})
		msgs := br.Messages(queue)
		if len(msgs) != 2 {
			t.Fatalf("%d messages, want the event twice", len(msgs))
		}
		for _, m := range msgs {
			if m.Header(outbox.EventIDHeader) != "ev-1" {
				t.Fatalf("message %+v, want id header ev-1", m)
			}
		}
	})
}

func TestThreeRelaysShareLanesAndKeepKeyOrder(t *testing.T) {
	forEachBackend(t, func(t *testing.T, b *backend) {
		ctx := testenv.Context(t, 120*time.Second)
		br, err := memory.New()
		if err != nil {
			t.Fatal(err)
		}
		defer br.Close()
		const (
			txs  = 2500
			per  = 4
			keys = 100
		)
		var relays []*outbox.Relay
		for i := range 3 {
			r, _ := runRelay(t, b.store(t, ""), br, fast(outbox.WithName("relay-"+strconv.Itoa(i)))...)
			relays = append(relays, r)
		}
		testenv.WaitFor(t, 30*time.Second, "the relays did not share the lanes", func() bool {
			held := 0
			for _, r := range relays {
				if r.Stats().Lanes == 0 {
					return false
				}
				held += r.Stats().Lanes
			}
			return held == outbox.Lanes
		})
		writeConcurrently(ctx, t, b, 8, txs, per, keys, nil)
		testenv.WaitFor(t, 90*time.Second, "not every event arrived", func() bool {
			return distinct(br.Messages(queue)) >= txs*per
		})
		events, dups := checkOrder(t, br.Messages(queue))
		if events != txs*per {
			t.Fatalf("%d events arrived, want %d", events, txs*per)
		}
		t.Logf("%d events, %d duplicates", events, dups)
		for _, r := range relays {
			if s := r.Stats(); s.Published == 0 {
				t.Errorf("relay %s published nothing: the lanes were not shared (%+v)", r.Name(), s)
			}
		}
	})
}

func TestDeadRelayLanesTakenOver(t *testing.T) {
	forEachBackend(t, func(t *testing.T, b *backend) {
		ctx := testenv.Context(t, 120*time.Second)
		br, err := memory.New()
		if err != nil {
			t.Fatal(err)
		}
		defer br.Close()
		const (
			txs  = 1500
			per  = 2
			keys = 30
		)
		var (
			relays []*outbox.Relay
			killed atomic.Bool
			dead   = make(chan struct{})
			diedAt time.Time
		)
		for i := range 3 {
			r, err := outbox.NewRelay(b.store(t, ""), br, fast(outbox.WithName("relay-"+strconv.Itoa(i)))...)
			if err != nil {
				t.Fatal(err)
			}
			if i == 0 {
				outbox.CrashAfterPublish(r, func() bool {
					if killed.Load() {
						diedAt = time.Now() // read after dead is closed
						return true
					}
					return false
				})
				go func() {
					defer close(dead)
					r.Run(ctx)
				}()
			} else {
				startRelay(t, r)
			}
			relays = append(relays, r)
		}
		// Let every relay hold lanes before the writing starts.
		testenv.WaitFor(t, 30*time.Second, "the relays did not share the lanes", func() bool {
			for _, r := range relays {
				if r.Stats().Lanes == 0 {
					return false
				}
			}
			return true
		})
		writeConcurrently(ctx, t, b, 4, txs, per, keys, func(i int64) {
			if i == txs/3 {
				killed.Store(true)
			}
		})
		// The first relay dies at its next publish.
		select {
		case <-dead:
		case <-ctx.Done():
			t.Fatal("the killed relay did not stop")
		}
		if relays[0].Stats().Published == 0 {
			t.Fatal("the killed relay had published nothing before it died")
		}
		testenv.WaitFor(t, 30*time.Second, "the dead relay's lanes were not taken over", func() bool {
			return relays[1].Stats().Lanes+relays[2].Stats().Lanes == outbox.Lanes
		})
		t.Logf("lanes taken over %s after the relay died (lease TTL 1s)", time.Since(diedAt).Round(time.Millisecond))
		testenv.WaitFor(t, 60*time.Second, "not every event arrived", func() bool {
			return distinct(br.Messages(queue)) >= txs*per
		})
		events, dups := checkOrder(t, br.Messages(queue))
		if events != txs*per {
			t.Fatalf("%d events arrived, want %d", events, txs*per)
		}
		t.Logf("%d events, %d duplicates (the dead relay's last batch)", events, dups)
	})
}

func TestPostgresOutageRelayRecovers(t *testing.T) {
	b := openPostgres(t)
	ctx := testenv.Context(t, 120*time.Second)
	br, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer br.Close()
	app := "ferry-outbox-relay-" + strconv.FormatInt(rand.Int64(), 36)
	r, _ := runRelay(t, b.store(t, app), br, fast()...)

	const (
		txs  = 600
		per  = 2
		keys = 20
	)
	outage := make(chan struct{})
	var terminated atomic.Int64
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		<-outage
		// Kill the relay's connections over and over for 3s: what a server
		// restart looks like to a client.
		end := time.Now().Add(3 * time.Second)
		for time.Now().Before(end) && ctx.Err() == nil {
			n, err := b.kill(ctx, app)
			if err != nil {
				t.Errorf("terminate: %v", err)
				return
			}
			terminated.Add(int64(n))
			time.Sleep(50 * time.Millisecond)
		}
	}()
	writeConcurrently(ctx, t, b, 4, txs, per, keys, func(i int64) {
		if i == txs/4 {
			close(outage)
		}
		if i > txs/4 && i < txs/2 {
			time.Sleep(10 * time.Millisecond) // keep writing through the outage
		}
	})
	wg.Wait()
	testenv.WaitFor(t, 60*time.Second, "the relay did not recover: not every event arrived", func() bool {
		return distinct(br.Messages(queue)) >= txs*per
	})
	events, dups := checkOrder(t, br.Messages(queue))
	if events != txs*per {
		t.Fatalf("%d events, want %d", events, txs*per)
	}
	if terminated.Load() == 0 || r.Stats().StoreErrors == 0 {
		t.Fatalf("the outage did not reach the relay: %d connections terminated, stats %+v", terminated.Load(), r.Stats())
	}
	t.Logf("%d connections terminated, %d database errors, %d duplicates", terminated.Load(), r.Stats().StoreErrors, dups)
}

func TestPublisherDownBacklogGrowsThenDrains(t *testing.T) {
	forEachBackend(t, func(t *testing.T, b *backend) {
		ctx := testenv.Context(t, 60*time.Second)
		br, err := memory.New()
		if err != nil {
			t.Fatal(err)
		}
		defer br.Close()
		pub := &flaky{Broker: br}
		pub.failing.Store(true)
		st := b.store(t, "")
		const maxBackoff = 200 * time.Millisecond
		r, _ := runRelay(t, st, pub, fast(outbox.WithBackoff(10*time.Millisecond, maxBackoff))...)
		for i := range 50 {
			if err := b.add(ctx, outbox.Event{Destination: queue, Key: "k" + strconv.Itoa(i%5), Body: []byte(strconv.Itoa(i))}); err != nil {
				t.Fatal(err)
			}
		}
		// Past the first few failures the delay is at its maximum.
		testenv.WaitFor(t, 30*time.Second, "the relay did not try to publish", func() bool { return pub.calls.Load() >= 8 })
		c0, t0 := pub.calls.Load(), time.Now()
		testenv.WaitFor(t, 30*time.Second, "the relay stopped retrying", func() bool { return pub.calls.Load() >= c0+5 })
		calls, window := pub.calls.Load()-c0, time.Since(t0)
		// Each retry waits at least half the maximum backoff: a busy loop
		// would make thousands of calls here.
		if limit := int64(window/(maxBackoff/2)) + 2; calls > limit {
			t.Fatalf("%d publish calls in %s while the publisher was down, want at most %d", calls, window, limit)
		}
		bl, err := r.Backlog(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if bl.Events != 50 || bl.OldestAge <= 0 {
			t.Fatalf("backlog while down %+v, want 50 events with an age", bl)
		}
		pub.failing.Store(false)
		testenv.WaitFor(t, 30*time.Second, "the backlog did not drain", func() bool {
			bl, err := r.Backlog(ctx)
			return err == nil && bl.Events == 0 && r.Stats().Published == 50
		})
		if n := len(br.Messages(queue)); n != 50 {
			t.Fatalf("%d messages, want 50", n)
		}
		if s := r.Stats(); s.PublishFailures < 13 || s.Published != 50 {
			t.Fatalf("stats %+v", s)
		}
	})
}

func TestRefusedEventMovedToFailed(t *testing.T) {
	forEachBackend(t, func(t *testing.T, b *backend) {
		ctx := testenv.Context(t, 60*time.Second)
		br, err := memory.New()
		if err != nil {
			t.Fatal(err)
		}
		defer br.Close()
		pub := &flaky{Broker: br, refuse: func(m consumer.Message) bool { return string(m.Body) == "poison" }}
		if err := b.add(ctx,
			outbox.Event{ID: "a", Destination: queue, Key: "k", Body: []byte("1")},
			outbox.Event{ID: "p", Destination: queue, Key: "k", Body: []byte("poison")},
			outbox.Event{ID: "c", Destination: queue, Key: "k", Body: []byte("3")},
		); err != nil {
			t.Fatal(err)
		}
		st := b.store(t, "")
		r, _ := runRelay(t, st, pub, fast()...)
		testenv.WaitFor(t, 30*time.Second, "the relay did not carry on past the refused event", func() bool {
			bl, err := st.Backlog(ctx)
			return err == nil && bl.Events == 0 && bl.Failed == 1 && r.Stats().Failed == 1
		})
		msgs := br.Messages(queue)
		if len(msgs) != 2 || msgs[0].ID != "a" || msgs[1].ID != "c" {
			t.Fatalf("published %+v, want a and c", msgs)
		}
		if s := r.Stats(); s.Failed != 1 {
			t.Fatalf("stats %+v, want 1 failed", s)
		}
	})
}

func TestConfigErrorsNameTheField(t *testing.T) {
	br, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer br.Close()
	st, err := sqliteoutbox.NewStore(nil)
	var ce *consumer.ConfigError
	if !errors.As(err, &ce) || ce.Field != "DB" || st != nil {
		t.Fatalf("sqliteoutbox.NewStore(nil) = %v", err)
	}
	if _, err := pgoutbox.NewStore(nil); !errors.As(err, &ce) || ce.Field != "Pool" {
		t.Fatalf("pgoutbox.NewStore(nil) = %v", err)
	}
	for _, n := range []int{0, -1, 64<<20 + 1} {
		if _, err := sqliteoutbox.NewWriter(outbox.WriterMaxEventSize(n)); !errors.As(err, &ce) || ce.Field != "MaxEventSize" {
			t.Fatalf("sqliteoutbox.NewWriter(WriterMaxEventSize(%d)) = %v", n, err)
		}
		if _, err := pgoutbox.NewWriter(outbox.WriterMaxEventSize(n)); !errors.As(err, &ce) || ce.Field != "MaxEventSize" {
			t.Fatalf("pgoutbox.NewWriter(WriterMaxEventSize(%d)) = %v", n, err)
		}
	}
	if _, err := pgoutbox.NewWriter(outbox.WriterOption{}, outbox.WriterMaxEventSize(64<<20), outbox.WriterNotify(false)); err != nil {
		t.Fatalf("pgoutbox.NewWriter with good options: %v", err)
	}
	good := openSQLite(t).store(t, "")
	for _, c := range []struct {
		field string
		store outbox.Store
		pub   consumer.Publisher
		opt   outbox.Option
	}{
		{"Store", nil, br, nil},
		{"Publisher", good, nil, nil},
		{"BatchSize", good, br, outbox.WithBatchSize(0)},
		{"PollInterval", good, br, outbox.WithPollInterval(0)},
		{"LeaseTTL", good, br, outbox.WithLeaseTTL(time.Millisecond)},
		{"Backoff", good, br, outbox.WithBackoff(time.Second, time.Millisecond)},
		{"PublishTimeout", good, br, outbox.WithPublishTimeout(0)},
		{"Name", good, br, outbox.WithName("")},
		{"Name", good, br, outbox.WithName("relay\x00")},
		{"Name", good, br, outbox.WithName("relay\xff")},
		{"Name", good, br, outbox.WithName(strings.Repeat("r", 201))},
		{"PublishTimeout", good, br, outbox.WithPublishTimeout(time.Minute)},
		{"MeterProvider", good, br, outbox.WithMeterProvider(nil)},
		{"Logger", good, br, outbox.WithLogger(nil)},
	} {
		_, err := outbox.NewRelay(c.store, c.pub, c.opt)
		if !errors.As(err, &ce) || ce.Field != c.field || !errors.Is(err, consumer.ErrInvalidConfig) {
			t.Errorf("%s: NewRelay = %v", c.field, err)
		}
	}
}
