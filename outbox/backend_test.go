package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/memory"
	"github.com/ferrymq/ferry/outbox"
	"github.com/ferrymq/ferry/outbox/pgoutbox"
	"github.com/ferrymq/ferry/outbox/sqliteoutbox"
)

// backend is one database the outbox runs on, set up fresh for one test.
type backend struct {
	name string
	// store returns a Store for a relay. appName, when the database has
	// connections with names (PostgreSQL), names the relay's connections.
	store func(t testing.TB, appName string) outbox.Store
	// tx runs f in a transaction and commits it when f returns nil.
	tx func(ctx context.Context, f func(add addFunc, exec execFunc) error) error
	// counter is the SQL that bumps the per-key commit counter and returns
	// it; its parameter is the key.
	counter string
	// stamp is the SQL that sets an event's body; parameters body, event id.
	stamp string
	// kill ends the named connections, as a server restart does; nil where
	// the database has none.
	kill func(ctx context.Context, appName string) (int, error)
	// pool is the PostgreSQL database's pool, for a test's own
	// transactions; nil on SQLite.
	pool *pgxpool.Pool
}

type addFunc func(ctx context.Context, events ...outbox.Event) error
type execFunc func(ctx context.Context, q string, args ...any) (int64, error)

// add commits events in one transaction.
func (b *backend) add(ctx context.Context, events ...outbox.Event) error {
	return b.tx(ctx, func(add addFunc, _ execFunc) error { return add(ctx, events...) })
}

func backends(t *testing.T) []*backend {
	return []*backend{{name: "sqlite"}, {name: "postgres"}}
}

// open sets b up for t: a new database file, or a new PostgreSQL schema.
func (b *backend) open(t testing.TB) *backend {
	t.Helper()
	switch b.name {
	case "sqlite":
		return openSQLite(t)
	case "postgres":
		return openPostgres(t)
	}
	t.Fatalf("unknown backend %s", b.name)
	return nil
}

// forEachBackend runs f once per database, as subtests.
func forEachBackend(t *testing.T, f func(t *testing.T, b *backend)) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) { f(t, b.open(t)) })
	}
}

func openSQLite(t testing.TB) *backend {
	t.Helper()
	db, err := sqliteoutbox.Open(filepath.Join(t.TempDir(), "outbox.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	ctx := context.Background()
	if err := sqliteoutbox.Migrate(ctx, db); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE test_counters (key TEXT PRIMARY KEY, n INTEGER NOT NULL);
		CREATE INDEX test_outbox_event_id ON ferry_outbox (event_id)`); err != nil {
		t.Fatal(err)
	}
	w, err := sqliteoutbox.NewWriter()
	if err != nil {
		t.Fatal(err)
	}
	st, err := sqliteoutbox.NewStore(db)
	if err != nil {
		t.Fatal(err)
	}
	return &backend{
		name:  "sqlite",
		store: func(testing.TB, string) outbox.Store { return st },
		tx: func(ctx context.Context, f func(addFunc, execFunc) error) error {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				return err
			}
			defer tx.Rollback()
			add := func(ctx context.Context, evs ...outbox.Event) error { return w.Add(ctx, tx, evs...) }
			if err := f(add, sqlExec(tx)); err != nil {
				return err
			}
			return tx.Commit()
		},
		counter: `INSERT INTO test_counters (key, n) VALUES (?, 1) ON CONFLICT (key) DO UPDATE SET n = n + 1 RETURNING n`,
		stamp:   `UPDATE ferry_outbox SET body = ? WHERE event_id = ?`,
	}
}

func sqlExec(tx *sql.Tx) execFunc {
	return func(ctx context.Context, q string, args ...any) (int64, error) {
		var n int64
		err := tx.QueryRowContext(ctx, q, args...).Scan(&n)
		if err == sql.ErrNoRows {
			return 0, nil
		}
		return n, err
	}
}

func openPostgres(t testing.TB) *backend {
	t.Helper()
	url := testenv.RequirePostgres(t)
	ctx := context.Background()
	schema := strings.ReplaceAll(testenv.UniqueName(t, "outbox"), "-", "_")
	admin, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connect %s: %v", url, err)
	}
	if _, err := admin.Exec(ctx, `CREATE SCHEMA `+schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		admin.Exec(ctx, `DROP SCHEMA `+schema+` CASCADE`)
		admin.Close(ctx)
	})
	newPool := func(t testing.TB, appName string) *pgxpool.Pool {
		cfg, err := pgxpool.ParseConfig(url)
		if err != nil {
			t.Fatal(err)
		}
		cfg.ConnConfig.RuntimeParams["search_path"] = schema
		if appName != "" {
			cfg.ConnConfig.RuntimeParams["application_name"] = appName
		}
		cfg.MaxConns = 8
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		return pool
	}
	pool := newPool(t, "")
	if err := pgoutbox.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE test_counters (key text PRIMARY KEY, n bigint NOT NULL);
		CREATE INDEX test_outbox_event_id ON ferry_outbox (event_id)`); err != nil {
		t.Fatal(err)
	}
	w, err := pgoutbox.NewWriter()
	if err != nil {
		t.Fatal(err)
	}
	return &backend{
		pool: pool,
		name: "postgres",
		store: func(t testing.TB, appName string) outbox.Store {
			p := pool
			if appName != "" {
				p = newPool(t, appName)
			}
			st, err := pgoutbox.NewStore(p)
			if err != nil {
				t.Fatal(err)
			}
			return st
		},
		tx: func(ctx context.Context, f func(addFunc, execFunc) error) error {
			return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				add := func(ctx context.Context, evs ...outbox.Event) error { return w.Add(ctx, tx, evs...) }
				exec := func(ctx context.Context, q string, args ...any) (int64, error) {
					var n int64
					err := tx.QueryRow(ctx, q, args...).Scan(&n)
					if err == pgx.ErrNoRows {
						return 0, nil
					}
					return n, err
				}
				return f(add, exec)
			})
		},
		counter: `INSERT INTO test_counters (key, n) VALUES ($1, 1) ON CONFLICT (key) DO UPDATE SET n = test_counters.n + 1 RETURNING n`,
		stamp:   `WITH u AS (UPDATE ferry_outbox SET body = $1 WHERE event_id = $2 RETURNING 1) SELECT count(*) FROM u`,
		kill: func(ctx context.Context, appName string) (int, error) {
			var n int
			err := pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1`, appName).Scan(&n)
			return n, err
		},
	}
}

// flaky is a Publisher over the memory broker that fails while told to, and
// counts calls. It tests the relay, not a broker: the broker is real.
type flaky struct {
	*memory.Broker
	failing atomic.Bool
	calls   atomic.Int64
	// refuse, when set, refuses for good the messages it returns true for.
	refuse func(m consumer.Message) bool
}

var errDown = errors.New("broker down")

func (f *flaky) Publish(ctx context.Context, dest string, msgs ...consumer.Message) error {
	f.calls.Add(1)
	if f.failing.Load() {
		return errDown
	}
	if f.refuse != nil {
		var pe consumer.PublishError
		var ok []consumer.Message
		for i, m := range msgs {
			if f.refuse(m) {
				pe.Failed = append(pe.Failed, consumer.FailedMessage{Index: i, Err: consumer.Permanent(fmt.Errorf("message too large"))})
				continue
			}
			ok = append(ok, m)
		}
		if len(pe.Failed) > 0 {
			if err := f.Broker.Publish(ctx, dest, ok...); err != nil {
				return err
			}
			return &pe
		}
	}
	return f.Broker.Publish(ctx, dest, msgs...)
}

// runRelay runs a relay until the test ends, and returns it.
func runRelay(t *testing.T, st outbox.Store, pub consumer.Publisher, opts ...outbox.Option) (*outbox.Relay, context.CancelFunc) {
	t.Helper()
	r, err := outbox.NewRelay(st, pub, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return r, startRelay(t, r)
}

func startRelay(t *testing.T, r *outbox.Relay) context.CancelFunc {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("relay %s: Run: %v", r.Name(), err)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}
