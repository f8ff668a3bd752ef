package pgstore_test

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"go.uber.org/goleak"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/idempotency/pgstore"
	"github.com/ferrymq/ferry/idempotency/storetest"
	"github.com/ferrymq/ferry/internal/testenv"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func newPool(t testing.TB, url string, conns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = conns
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// testPool connects to the real PostgreSQL of integration/brokers.sh.
func testPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	return newPool(t, testenv.RequirePostgres(t), 24)
}

// freshTable creates a keys table of its own for t and drops it afterwards.
func freshTable(t testing.TB, p *pgxpool.Pool) string {
	t.Helper()
	name := strings.ReplaceAll(testenv.UniqueName(t, "idem"), "-", "_")
	if err := pgstore.Migrate(testenv.Context(t, 2*time.Minute), p, pgstore.WithTable(name)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = p.Exec(context.Background(), "DROP TABLE IF EXISTS "+name) })
	return name
}

// effectTable is the handler's effect: a row per run, in a table with no
// unique constraint, so that a second run shows as a second row. Its key is
// bytea: the keys of the tests are arbitrary bytes.
type effectTable struct {
	p    *pgxpool.Pool
	name string
}

func newEffect(t testing.TB, p *pgxpool.Pool) *effectTable {
	t.Helper()
	name := strings.ReplaceAll(testenv.UniqueName(t, "effect"), "-", "_")
	if _, err := p.Exec(testenv.Context(t, 2*time.Minute), "CREATE TABLE "+name+" (key bytea NOT NULL, at timestamptz NOT NULL DEFAULT now())"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = p.Exec(context.Background(), "DROP TABLE IF EXISTS "+name) })
	return &effectTable{p: p, name: name}
}

func (e *effectTable) insertSQL() string { return "INSERT INTO " + e.name + " (key) VALUES ($1)" }

func (e *effectTable) Apply(ctx context.Context, key string) error {
	_, err := e.p.Exec(ctx, e.insertSQL(), []byte(key))
	return err
}

func (e *effectTable) Counts(ctx context.Context) (map[string]int, error) {
	rows, err := e.p.Query(ctx, "SELECT key, count(*) FROM "+e.name+" GROUP BY key")
	if err != nil {
		return nil, err
	}
	m := map[string]int{}
	var k []byte
	var n int
	_, err = pgx.ForEachRow(rows, []any{&k, &n}, func() error { m[string(k)] = n; return nil })
	return m, err
}

func TestStore(t *testing.T) {
	p := testPool(t)
	storetest.Run(t, storetest.Config{
		NewStore: func(t *testing.T) idempotency.Store {
			s, err := pgstore.NewStore(p, pgstore.WithTable(freshTable(t, p)))
			if err != nil {
				t.Fatal(err)
			}
			return s
		},
		NewEffect: func(t *testing.T) storetest.Effect { return newEffect(t, p) },
	})
}

func TestInboxExactlyOnce(t *testing.T) {
	p := testPool(t)
	e := newEffect(t, p)
	h, err := pgstore.NewInbox(p, "inbox", func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		_, err := tx.Exec(ctx, e.insertSQL(), []byte(m.Header(idempotency.EventIDHeader)))
		return err
	}, pgstore.WithTable(freshTable(t, p)))
	if err != nil {
		t.Fatal(err)
	}
	storetest.ExactlyOnce(t, h, e, 10000, 3, 16)
}

func TestSQLInboxExactlyOnce(t *testing.T) {
	p := testPool(t)
	e := newEffect(t, p)
	db := stdlib.OpenDBFromPool(p)
	t.Cleanup(func() { db.Close() })
	h, err := pgstore.NewSQLInbox(db, "inbox", func(ctx context.Context, tx *sql.Tx, m *consumer.Message) error {
		_, err := tx.ExecContext(ctx, e.insertSQL(), []byte(m.Header(idempotency.EventIDHeader)))
		return err
	}, pgstore.WithTable(freshTable(t, p)))
	if err != nil {
		t.Fatal(err)
	}
	storetest.ExactlyOnce(t, h, e, 10000, 3, 16)
}

func TestInboxHandlerErrorRollsBackKeyAndWrites(t *testing.T) {
	p := testPool(t)
	ctx := testenv.Context(t, 2*time.Minute)
	e := newEffect(t, p)
	boom := consumer.Permanent(errors.New("boom"))
	var calls atomic.Int32
	h, err := pgstore.NewInbox(p, "inbox", func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if _, err := tx.Exec(ctx, e.insertSQL(), []byte(m.Header(idempotency.EventIDHeader))); err != nil {
			return err
		}
		if calls.Add(1) == 1 {
			return boom // after its write: the write must roll back too
		}
		return nil
	}, pgstore.WithTable(freshTable(t, p)))
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Handle(ctx, storetest.Message("ev", 1)); err != boom {
		t.Fatalf("first delivery = %v, want the handler's error unchanged", err)
	}
	for copy := 2; copy <= 3; copy++ {
		if err := h.Handle(ctx, storetest.Message("ev", copy)); err != nil {
			t.Fatalf("delivery %d: %v", copy, err)
		}
	}
	if n := calls.Load(); n != 2 {
		t.Errorf("handler ran %d times, want 2", n)
	}
	got, err := e.Counts(ctx)
	if err != nil || got["ev"] != 1 || len(got) != 1 {
		t.Fatalf("effects = %v, %v; want ev once", got, err)
	}
}

func TestInboxDuplicateWaitsForOpenTransaction(t *testing.T) {
	p := testPool(t)
	ctx := testenv.Context(t, 2*time.Minute)
	e := newEffect(t, p)
	entered := make(chan struct{})
	proceed := make(chan struct{})
	var calls atomic.Int32
	table := freshTable(t, p)
	h, err := pgstore.NewInbox(p, "inbox", func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if calls.Add(1) == 1 {
			close(entered)
			<-proceed
		}
		_, err := tx.Exec(ctx, e.insertSQL(), []byte(m.Header(idempotency.EventIDHeader)))
		return err
	}, pgstore.WithTable(table))
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make([]error, 2)
	wg.Go(func() { errs[0] = h.Handle(ctx, storetest.Message("ev", 1)) })
	<-entered
	wg.Go(func() { errs[1] = h.Handle(ctx, storetest.Message("ev", 2)) }) // blocks on the key's row
	// Wait until the duplicate's key insert waits on the first transaction's lock.
	deadline := time.Now().Add(30 * time.Second)
	for {
		var waiting int
		err := p.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO ' || $1::text || '%'`, table).Scan(&waiting)
		if err != nil {
			t.Fatal(err)
		}
		if waiting == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the duplicate never waited on the first delivery's open transaction")
		}
		time.Sleep(10 * time.Millisecond) // poll interval
	}
	close(proceed)
	wg.Wait()
	if errs[0] != nil || errs[1] != nil {
		t.Fatalf("deliveries = %v", errs)
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want 1", n)
	}
}

func TestInboxDuplicateOfCommittedKeySkipsHandler(t *testing.T) {
	p := testPool(t)
	ctx := testenv.Context(t, 2*time.Minute)
	var calls atomic.Int32
	h, err := pgstore.NewInbox(p, "inbox", func(context.Context, pgx.Tx, *consumer.Message) error {
		calls.Add(1)
		return nil
	}, pgstore.WithTable(freshTable(t, p)))
	if err != nil {
		t.Fatal(err)
	}
	for copy := range 3 {
		if err := h.Handle(ctx, storetest.Message("ev", copy)); err != nil {
			t.Fatal(err)
		}
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want 1", n)
	}
}

// deadURL points at a port where nothing listens: a real client against a
// dead address.
const deadURL = "postgres://ferry:ferry@127.0.0.1:1/ferry?sslmode=disable&connect_timeout=5"

func TestUnreachablePostgresIsNotAckedAndHandlerNotCalled(t *testing.T) {
	p := newPool(t, deadURL, 2)
	ctx := testenv.Context(t, 2*time.Minute)
	s, err := pgstore.NewStore(p)
	if err != nil {
		t.Fatal(err)
	}
	dedup, err := idempotency.New(s, "billing")
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int32
	h := dedup.Wrap(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { calls.Add(1); return nil }))
	err = h.Handle(ctx, storetest.Message("ev", 1))
	var ra *consumer.RetryAfterError
	if err == nil || consumer.IsPermanent(err) || errors.As(err, &ra) || consumer.IsDeferred(err) {
		t.Fatalf("middleware = %v, want a plain error (not acked, redelivered)", err)
	}

	in, err := pgstore.NewInbox(p, "billing", func(context.Context, pgx.Tx, *consumer.Message) error { calls.Add(1); return nil })
	if err != nil {
		t.Fatal(err)
	}
	if err := in.Handle(ctx, storetest.Message("ev", 1)); err == nil || consumer.IsPermanent(err) {
		t.Fatalf("inbox = %v, want a plain error", err)
	}
	if n := calls.Load(); n != 0 {
		t.Fatalf("handler ran %d times without a reachable store", n)
	}
}

func TestUnreachablePostgresThroughDeliveryLoop(t *testing.T) {
	s, err := pgstore.NewStore(newPool(t, deadURL, 2))
	if err != nil {
		t.Fatal(err)
	}
	storetest.StoreDown(t, s)
}

func TestMigrateIsRepeatableAndConcurrent(t *testing.T) {
	p := testPool(t)
	ctx := testenv.Context(t, 2*time.Minute)
	name := freshTable(t, p)
	db := stdlib.OpenDBFromPool(p)
	t.Cleanup(func() { db.Close() })
	var wg sync.WaitGroup
	errs := make([]error, 6)
	for i := range errs {
		wg.Go(func() {
			if i%2 == 0 {
				errs[i] = pgstore.Migrate(ctx, p, pgstore.WithTable(name))
			} else {
				errs[i] = pgstore.MigrateSQL(ctx, db, pgstore.WithTable(name))
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatalf("Migrate again: %v", err)
		}
	}
	var n int
	if err := p.QueryRow(ctx, "SELECT count(*) FROM pg_indexes WHERE tablename = $1", name).Scan(&n); err != nil || n != 1 {
		t.Fatalf("indexes on %s = %d, %v; want 1 (the primary key)", name, n, err)
	}
}

// MigrateSQL (database/sql) and Migrate in a caller's transaction create a
// table the store works with.
func TestMigrateSQLAndMigrateInATransaction(t *testing.T) {
	p := testPool(t)
	ctx := testenv.Context(t, 2*time.Minute)
	db := stdlib.OpenDBFromPool(p)
	t.Cleanup(func() { db.Close() })
	viaSQL := strings.ReplaceAll(testenv.UniqueName(t, "idem_sql"), "-", "_")
	viaTx := strings.ReplaceAll(testenv.UniqueName(t, "idem_tx"), "-", "_")
	t.Cleanup(func() { _, _ = p.Exec(context.Background(), "DROP TABLE IF EXISTS "+viaSQL+", "+viaTx) })
	if err := pgstore.MigrateSQL(ctx, db, pgstore.WithTable(viaSQL)); err != nil {
		t.Fatalf("MigrateSQL: %v", err)
	}
	err := pgx.BeginFunc(ctx, p, func(tx pgx.Tx) error { return pgstore.Migrate(ctx, tx, pgstore.WithTable(viaTx)) })
	if err != nil {
		t.Fatalf("Migrate in a transaction: %v", err)
	}
	for _, table := range []string{viaSQL, viaTx} {
		s, err := pgstore.NewStore(p, pgstore.WithTable(table))
		if err != nil {
			t.Fatal(err)
		}
		if cl, err := s.Claim(ctx, "k\x00", time.Minute); err != nil || cl.Status != idempotency.Claimed {
			t.Fatalf("claim in %s = %v, %v", table, cl.Status, err)
		}
	}
}

func TestSchemaRendersTheTableName(t *testing.T) {
	text, err := pgstore.Schema("my_keys")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(text, "CREATE TABLE IF NOT EXISTS my_keys (") || strings.Contains(text, pgstore.DefaultTable) {
		t.Fatalf("Schema(my_keys) =\n%s", text)
	}
}

func TestBadConfigurationNamesTheField(t *testing.T) {
	var ce *consumer.ConfigError
	if _, err := pgstore.Schema("drop table x;"); !errors.As(err, &ce) || ce.Field != "Table" {
		t.Errorf("Schema(bad name) = %v, want a ConfigError naming Table", err)
	}
	if _, err := pgstore.NewStore(nil); !errors.As(err, &ce) || ce.Field != "DB" {
		t.Errorf("NewStore(nil) = %v, want a ConfigError naming DB", err)
	}
	if err := pgstore.Migrate(context.Background(), nil); !errors.As(err, &ce) || ce.Field != "DB" {
		t.Errorf("Migrate(nil) = %v, want a ConfigError naming DB", err)
	}
	if err := pgstore.MigrateSQL(context.Background(), nil); !errors.As(err, &ce) || ce.Field != "DB" {
		t.Errorf("MigrateSQL(nil) = %v, want a ConfigError naming DB", err)
	}
	p := newPool(t, deadURL, 1)
	if _, err := pgstore.NewStore(p, pgstore.WithTable("Bad-Name")); !errors.As(err, &ce) || ce.Field != "Table" {
		t.Errorf("NewStore(bad table) = %v, want a ConfigError naming Table", err)
	}
	noop := func(context.Context, pgx.Tx, *consumer.Message) error { return nil }
	if _, err := pgstore.NewInbox(p, "", noop); !errors.As(err, &ce) || ce.Field != "Namespace" {
		t.Errorf("NewInbox(empty namespace) = %v, want a ConfigError naming Namespace", err)
	}
	if _, err := pgstore.NewInbox(p, "x", nil); !errors.As(err, &ce) || ce.Field != "Handler" {
		t.Errorf("NewInbox(nil handler) = %v, want a ConfigError naming Handler", err)
	}
	if _, err := pgstore.NewInbox(p, "x", noop, pgstore.WithRetention(0)); !errors.As(err, &ce) || ce.Field != "Retention" {
		t.Errorf("NewInbox(zero retention) = %v, want a ConfigError naming Retention", err)
	}
}

// refuseKey makes the database refuse one namespaced key of table with a
// data exception (SQLSTATE 22023), as it would refuse a value it cannot
// store: a trigger, so the error is PostgreSQL's own.
func refuseKey(t *testing.T, p *pgxpool.Pool, table, key string) {
	t.Helper()
	sum := sha256.Sum256([]byte(key))
	fn := table + "_refuse"
	_, err := p.Exec(testenv.Context(t, 2*time.Minute), `CREATE FUNCTION `+fn+`() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.key_hash = '\x`+hex.EncodeToString(sum[:])+`'::bytea THEN
    RAISE EXCEPTION 'refused key' USING ERRCODE = '22023';
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER `+fn+` BEFORE INSERT OR UPDATE ON `+table+` FOR EACH ROW EXECUTE FUNCTION `+fn+`()`)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = p.Exec(context.Background(), "DROP FUNCTION IF EXISTS "+fn+" CASCADE") })
}

// A key the database refuses with a data exception is a permanent error of
// the middleware and of both inboxes: in a real delivery loop whose breaker
// opens on the first failure it counts, the message is dead-lettered, the
// breaker stays closed, and every other message is handled at once.
func TestDataExceptionIsPermanentAndNeverOpensTheBreaker(t *testing.T) {
	p := testPool(t)
	db := stdlib.OpenDBFromPool(p)
	t.Cleanup(func() { db.Close() })
	noop := func(context.Context, *consumer.Message) error { return nil }
	for _, c := range []struct {
		name    string
		handler func(t *testing.T, table string) consumer.Handler
	}{
		{"Middleware", func(t *testing.T, table string) consumer.Handler {
			s, err := pgstore.NewStore(p, pgstore.WithTable(table))
			if err != nil {
				t.Fatal(err)
			}
			dedup, err := idempotency.New(s, "orders-consumer")
			if err != nil {
				t.Fatal(err)
			}
			return dedup.Wrap(consumer.HandlerFunc(noop))
		}},
		{"Inbox", func(t *testing.T, table string) consumer.Handler {
			h, err := pgstore.NewInbox(p, "orders-consumer", func(ctx context.Context, _ pgx.Tx, m *consumer.Message) error {
				return noop(ctx, m)
			}, pgstore.WithTable(table))
			if err != nil {
				t.Fatal(err)
			}
			return h
		}},
		{"SQLInbox", func(t *testing.T, table string) consumer.Handler {
			h, err := pgstore.NewSQLInbox(db, "orders-consumer", func(ctx context.Context, _ *sql.Tx, m *consumer.Message) error {
				return noop(ctx, m)
			}, pgstore.WithTable(table))
			if err != nil {
				t.Fatal(err)
			}
			return h
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			table := freshTable(t, p)
			refuseKey(t, p, table, idempotency.Key("orders-consumer", "refused"))
			h := c.handler(t, table)

			err := h.Handle(testenv.Context(t, 2*time.Minute), storetest.Message("refused", 1))
			var pe *pgconn.PgError
			if !consumer.IsPermanent(err) || !errors.As(err, &pe) || pe.Code != "22023" {
				t.Fatalf("refused key = %v, want a permanent error wrapping SQLSTATE 22023", err)
			}
			storetest.PermanentThroughDeliveryLoop(t, h, "refused")
		})
	}
}
