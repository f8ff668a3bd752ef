package integration_test

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/memory"
	"github.com/ferrymq/ferry/outbox"
	"github.com/ferrymq/ferry/outbox/pgoutbox"
)

// The restart test's workload: events written one per transaction by
// restartWriters goroutines over restartKeys keys; the server goes down once
// restartAt of them have committed.
const (
	restartEvents  = 2000
	restartKeys    = 20
	restartWriters = 4
	restartAt      = 600
	restartQueue   = "orders"
	// restartDown is how long the server stays down at least (and until
	// the writers and the relay have both failed against it).
	restartDown = 2 * time.Second
	// restartRecovery bounds how long after the server is back the relay
	// must publish again, and how long after the last commit every
	// committed event must have arrived.
	restartRecovery = 30 * time.Second
)

// TestOutboxRelayRecoversFromPostgresRestart restarts PostgreSQL under a
// running outbox relay while events are being committed, and checks that
// the relay recovers by itself: every committed event arrives, per key in
// commit order, duplicates are only republished events (same id), and
// Relay.Run keeps running through the outage and returns nil when
// cancelled. The server is a private cluster of this test's own
// (testenv.StartPostgresCluster): restarting the shared one would break the
// other packages' tests running at the same time.
//
// It runs twice: a clean restart (pg_ctl stop -m fast, as a service manager
// does) and a crash (-m immediate, recovered from the WAL at start).
//
// It does not call t.Parallel, so that no other test of this package runs
// meanwhile and goleak can check that it leaves no goroutine behind.
func TestOutboxRelayRecoversFromPostgresRestart(t *testing.T) {
	for _, mode := range []testenv.StopMode{testenv.StopFast, testenv.StopImmediate} {
		t.Run(string(mode), func(t *testing.T) {
			running := goleak.IgnoreCurrent() // before the test starts any
			t.Cleanup(func() { goleak.VerifyNone(t, running) })
			testRelayThroughRestart(t, mode)
		})
	}
}

// restartWrite is one committed (or perhaps committed) event.
type restartWrite struct {
	key string
	n   int64 // the key's commit counter, stamped into the body
}

func testRelayThroughRestart(t *testing.T, mode testenv.StopMode) {
	pg := testenv.StartPostgresCluster(t)
	ctx := testenv.Context(t, 90*time.Second)

	newPool := func(app string, maxConns int32) *pgxpool.Pool {
		cfg, err := pgxpool.ParseConfig(pg.URL())
		if err != nil {
			t.Fatal(err)
		}
		cfg.ConnConfig.RuntimeParams["application_name"] = app
		cfg.MaxConns = maxConns
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		return pool
	}
	writers := newPool("writers", 2*restartWriters)
	if err := pgoutbox.Migrate(ctx, writers); err != nil {
		t.Fatal(err)
	}
	if _, err := writers.Exec(ctx, `CREATE TABLE test_counters (key text PRIMARY KEY, n bigint NOT NULL);
		CREATE INDEX test_outbox_event_id ON ferry_outbox (event_id)`); err != nil {
		t.Fatal(err)
	}
	w, err := pgoutbox.NewWriter()
	if err != nil {
		t.Fatal(err)
	}
	st, err := pgoutbox.NewStore(newPool("relay", 4))
	if err != nil {
		t.Fatal(err)
	}

	br, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { br.Close() })
	// The relay runs with its default options: what a service gets.
	relay, err := outbox.NewRelay(st, br, outbox.WithLogger(slog.New(slog.NewTextHandler(t.Output(), nil))))
	if err != nil {
		t.Fatal(err)
	}
	relayCtx, stopRelay := context.WithCancel(context.Background())
	defer stopRelay()
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(relayCtx) }()
	relayStopped := false
	t.Cleanup(func() {
		if !relayStopped { // a failed test: stop the relay before the cluster
			stopRelay()
			<-relayDone
		}
	})

	// The writers commit restartEvents events, one per transaction, pacing
	// themselves, and retry a transaction that fails (with a new event: the
	// failed one may have committed after all when its COMMIT failed).
	writeCtx, stopWriting := context.WithCancel(ctx)
	defer stopWriting()
	var (
		mu        sync.Mutex
		committed = map[string]restartWrite{} // commit acknowledged
		uncertain = map[string]bool{}         // COMMIT failed: may have committed
		claimed   atomic.Int64
		done      atomic.Int64
		failures  atomic.Int64
		outage    = make(chan struct{})
		wg        sync.WaitGroup
	)
	for range restartWriters {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for writeCtx.Err() == nil && claimed.Add(1) <= restartEvents {
				key := "k" + strconv.Itoa(rand.IntN(restartKeys))
				pause := 20 * time.Millisecond
				for writeCtx.Err() == nil {
					id := fmt.Sprintf("%s-%016x", key, rand.Uint64())
					n, inCommit, err := commitStamped(writeCtx, writers, w, key, id)
					if err == nil {
						mu.Lock()
						committed[id] = restartWrite{key, n}
						mu.Unlock()
						if done.Add(1) == restartAt {
							close(outage)
						}
						break
					}
					failures.Add(1)
					if inCommit {
						mu.Lock()
						uncertain[id] = true
						mu.Unlock()
					}
					time.Sleep(pause)
					pause = min(2*pause, 500*time.Millisecond)
				}
				time.Sleep(5 * time.Millisecond) // a steady stream, not a burst
			}
		}()
	}
	writing := make(chan struct{})
	go func() { wg.Wait(); close(writing) }()
	t.Cleanup(func() { stopWriting(); <-writing }) // ends them on a failed test

	// Mid-run, take the server down until both the writers and the relay
	// have failed against it, and for restartDown at least; then start it.
	select {
	case <-outage:
	case <-writing:
		t.Fatalf("the writers stopped after %d of %d events (context: %v)", done.Load(), restartEvents, ctx.Err())
	}
	stopped := time.Now()
	if err := pg.Stop(ctx, mode); err != nil {
		t.Fatal(err)
	}
	failuresBefore, storeErrsBefore := failures.Load(), relay.Stats().StoreErrors
	publishedBefore := relay.Stats().Published
	testenv.WaitFor(t, 30*time.Second, "the outage reached neither the writers nor the relay", func() bool {
		return time.Since(stopped) >= restartDown &&
			failures.Load() > failuresBefore && relay.Stats().StoreErrors > storeErrsBefore
	})
	if err := pg.Start(ctx); err != nil {
		t.Fatal(err)
	}
	back := time.Now()
	downFor := back.Sub(stopped)

	// The relay publishes again by itself: a delete after a publish
	// succeeded on the restarted server.
	testenv.WaitFor(t, restartRecovery, "the relay did not publish again after the server came back", func() bool {
		return relay.Stats().Published > publishedBefore
	})
	recovered := time.Since(back)
	testenv.WaitFor(t, restartRecovery, "the relay did not hold every lane again", func() bool {
		return relay.Stats().Lanes == outbox.Lanes
	})
	// It listens for commits again, on a connection of its own (whose last
	// statement stays the LISTEN), rather than falling back to polling for
	// good.
	testenv.WaitFor(t, restartRecovery, "the relay did not LISTEN again after the server came back", func() bool {
		var n int
		err := writers.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = 'relay' AND query ILIKE 'LISTEN %'`).Scan(&n)
		return err == nil && n == 1
	})

	select {
	case <-writing:
	case <-ctx.Done():
		t.Fatalf("the writers did not finish: %d of %d events committed", done.Load(), restartEvents)
	}
	wrote := time.Now()
	if done.Load() != restartEvents {
		t.Fatalf("%d events committed, want %d", done.Load(), restartEvents)
	}
	arrived := func() map[string]bool {
		ids := map[string]bool{}
		for _, m := range br.Messages(restartQueue) {
			ids[m.ID] = true
		}
		return ids
	}
	testenv.WaitFor(t, restartRecovery, "not every committed event arrived", func() bool {
		got := arrived()
		for id := range committed { // the writers are done: no lock needed
			if !got[id] {
				return false
			}
		}
		return true
	})
	drained := time.Since(wrote)
	testenv.WaitFor(t, restartRecovery, "the outbox did not drain", func() bool {
		bl, err := st.Backlog(ctx)
		return err == nil && bl.Events == 0 && bl.Failed == 0
	})

	select {
	case err := <-relayDone:
		t.Fatalf("Relay.Run returned %v before it was cancelled", err)
	default:
	}
	stopRelay()
	relayStopped = true
	select {
	case err := <-relayDone:
		if err != nil {
			t.Fatalf("Relay.Run after cancellation: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Relay.Run did not return within 30s of its cancellation")
	}

	// Every message is a committed event, or one whose COMMIT failed but
	// went through; per key, first deliveries come in commit order; a
	// duplicate is the same event again.
	var (
		first = map[string]restartWrite{}
		last  = map[string]int64{}
		dups  int
	)
	for _, m := range br.Messages(restartQueue) {
		if m.Header(outbox.EventIDHeader) != m.ID {
			t.Fatalf("message %q carries id header %q", m.ID, m.Header(outbox.EventIDHeader))
		}
		n, err := strconv.ParseInt(string(m.Body), 10, 64)
		if err != nil {
			t.Fatalf("message %s: body %q: %v", m.ID, m.Body, err)
		}
		got := restartWrite{m.Key, n}
		if want, ok := committed[m.ID]; ok && want != got {
			t.Fatalf("message %s: key %s, counter %d; committed as key %s, counter %d", m.ID, got.key, got.n, want.key, want.n)
		} else if !ok && !uncertain[m.ID] {
			t.Fatalf("message %s (key %s, counter %d) is no event the writers committed", m.ID, m.Key, n)
		}
		if prev, ok := first[m.ID]; ok {
			if prev != got {
				t.Fatalf("message %s again as key %s, counter %d; first as key %s, counter %d", m.ID, got.key, got.n, prev.key, prev.n)
			}
			dups++
			continue
		}
		first[m.ID] = got
		if prev, ok := last[m.Key]; ok && n <= prev {
			t.Fatalf("key %s: commit %d published after commit %d: out of commit order", m.Key, n, prev)
		}
		last[m.Key] = n
	}
	extra := len(first) - len(committed)
	s := relay.Stats()
	t.Logf("stop -m %s: server down %s; relay published again %s after it was back; "+
		"all %d events arrived %s after the last commit; %d writer failures (%d commits in doubt, %d of them went through); "+
		"relay: %d database errors, %d duplicates",
		mode, downFor.Round(time.Millisecond), recovered.Round(time.Millisecond),
		len(committed), drained.Round(time.Millisecond), failures.Load(), len(uncertain), extra,
		s.StoreErrors, dups)
}

// commitStamped commits one event of key with id in its own transaction,
// and stamps the key's commit counter into its body: the counter row is
// bumped after Add took the key's lock, so its value follows the order the
// key's transactions commit in. inCommit reports that the error came from
// COMMIT, which may have gone through.
func commitStamped(ctx context.Context, pool *pgxpool.Pool, w *pgoutbox.Writer, key, id string) (n int64, inCommit bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	tx, err := pool.Begin(ctx)
	if err != nil {
		return 0, false, err
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	if err := w.Add(ctx, tx, outbox.Event{ID: id, Destination: restartQueue, Key: key}); err != nil {
		return 0, false, err
	}
	if err := tx.QueryRow(ctx, `INSERT INTO test_counters (key, n) VALUES ($1, 1)
		ON CONFLICT (key) DO UPDATE SET n = test_counters.n + 1 RETURNING n`, key).Scan(&n); err != nil {
		return 0, false, fmt.Errorf("counter: %w", err)
	}
	tag, err := tx.Exec(ctx, `UPDATE ferry_outbox SET body = $1 WHERE event_id = $2`, []byte(strconv.FormatInt(n, 10)), []byte(id))
	if err != nil {
		return 0, false, fmt.Errorf("stamp: %w", err)
	}
	if tag.RowsAffected() != 1 {
		return 0, false, fmt.Errorf("stamp: %d rows of event %s", tag.RowsAffected(), id)
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, true, err
	}
	return n, false, nil
}
