package sqlitestore_test

import (
	"context"
	"database/sql"
	"errors"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"go.uber.org/goleak"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/idempotency/sqlitestore"
	"github.com/ferrymq/ferry/idempotency/storetest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// openDB opens a fresh database file for t, migrated.
func openDB(t testing.TB) *sql.DB {
	t.Helper()
	db, err := sqlitestore.Open(filepath.Join(t.TempDir(), "ferry.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	if err := sqlitestore.Migrate(context.Background(), db); err != nil {
		t.Fatal(err)
	}
	return db
}

// effectTable is the handler's effect: a row per run, in a table with no
// unique constraint, so that a second run shows as a second row. Its key is
// a BLOB: the keys of the tests are arbitrary bytes.
type effectTable struct{ db *sql.DB }

const effectInsert = "INSERT INTO effects (key) VALUES (?)"

func newEffect(t testing.TB, db *sql.DB) *effectTable {
	t.Helper()
	if _, err := db.Exec("CREATE TABLE effects (key BLOB NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	return &effectTable{db: db}
}

func (e *effectTable) Apply(ctx context.Context, key string) error {
	_, err := e.db.ExecContext(ctx, effectInsert, []byte(key))
	return err
}

func (e *effectTable) Counts(ctx context.Context) (map[string]int, error) {
	rows, err := e.db.QueryContext(ctx, "SELECT key, count(*) FROM effects GROUP BY key")
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	m := map[string]int{}
	for rows.Next() {
		var k []byte
		var n int
		if err := rows.Scan(&k, &n); err != nil {
			return nil, err
		}
		m[string(k)] = n
	}
	return m, rows.Err()
}

func TestStore(t *testing.T) {
	dbs := map[*testing.T]*sql.DB{}
	dbOf := func(t *testing.T) *sql.DB {
		if db, ok := dbs[t]; ok {
			return db
		}
		dbs[t] = openDB(t)
		return dbs[t]
	}
	storetest.Run(t, storetest.Config{
		NewStore: func(t *testing.T) idempotency.Store {
			s, err := sqlitestore.NewStore(dbOf(t))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			return s
		},
		NewEffect: func(t *testing.T) storetest.Effect { return newEffect(t, dbOf(t)) },
	})
}

func TestInboxExactlyOnce(t *testing.T) {
	db := openDB(t)
	e := newEffect(t, db)
	ins, err := db.Prepare(effectInsert)
	if err != nil {
		t.Fatal(err)
	}
	h, err := sqlitestore.NewInbox(db, "inbox", func(ctx context.Context, tx *sql.Tx, m *consumer.Message) error {
		_, err := tx.StmtContext(ctx, ins).ExecContext(ctx, []byte(m.Header(idempotency.EventIDHeader)))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	storetest.ExactlyOnce(t, h, e, 10000, 3, 16)
}

func TestInboxHandlerErrorRollsBackKeyAndWrites(t *testing.T) {
	db := openDB(t)
	ctx := context.Background()
	e := newEffect(t, db)
	boom := consumer.Permanent(errors.New("boom"))
	var calls atomic.Int32
	h, err := sqlitestore.NewInbox(db, "inbox", func(ctx context.Context, tx *sql.Tx, m *consumer.Message) error {
		if _, err := tx.ExecContext(ctx, effectInsert, []byte(m.Header(idempotency.EventIDHeader))); err != nil {
			return err
		}
		if calls.Add(1) == 1 {
			return boom // after its write: the write must roll back too
		}
		return nil
	})
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

func TestDatabaseErrorIsNotAckedAndHandlerNotCalled(t *testing.T) {
	db := openDB(t)
	s, err := sqlitestore.NewStore(db)
	if err != nil {
		t.Fatal(err)
	}
	dedup, err := idempotency.New(s, "billing")
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int32
	handler := func(context.Context, *sql.Tx, *consumer.Message) error { calls.Add(1); return nil }
	in, err := sqlitestore.NewInbox(db, "inbox", handler)
	if err != nil {
		t.Fatal(err)
	}
	h := dedup.Wrap(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { calls.Add(1); return nil }))
	db.Close() // the database is gone
	for _, h := range []consumer.Handler{h, in} {
		err := h.Handle(context.Background(), storetest.Message("ev", 1))
		if err == nil || consumer.IsPermanent(err) {
			t.Fatalf("delivery = %v, want a plain error", err)
		}
	}
	if n := calls.Load(); n != 0 {
		t.Fatalf("handler ran %d times without a store", n)
	}
}

func TestMigrateIsRepeatable(t *testing.T) {
	db := openDB(t)
	if err := sqlitestore.Migrate(context.Background(), db); err != nil {
		t.Fatalf("Migrate again: %v", err)
	}
	if err := sqlitestore.Migrate(context.Background(), db, sqlitestore.WithTable("other_keys")); err != nil {
		t.Fatalf("Migrate other table: %v", err)
	}
	s, err := sqlitestore.NewStore(db, sqlitestore.WithTable("other_keys"))
	if err != nil {
		t.Fatal(err)
	}
	if cl, err := s.Claim(context.Background(), "k", 1e9); err != nil || cl.Status != idempotency.Claimed {
		t.Fatalf("claim in other_keys = %v, %v", cl.Status, err)
	}
}

func TestSchemaRendersTheTableName(t *testing.T) {
	text, err := sqlitestore.Schema("my_keys")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(text, "CREATE TABLE IF NOT EXISTS my_keys (") || strings.Contains(text, sqlitestore.DefaultTable) {
		t.Fatalf("Schema(my_keys) =\n%s", text)
	}
}

func TestBadConfigurationNamesTheField(t *testing.T) {
	var ce *consumer.ConfigError
	if _, err := sqlitestore.Schema("x; drop"); !errors.As(err, &ce) || ce.Field != "Table" {
		t.Errorf("Schema(bad name) = %v, want a ConfigError naming Table", err)
	}
	if _, err := sqlitestore.NewStore(nil); !errors.As(err, &ce) || ce.Field != "DB" {
		t.Errorf("NewStore(nil) = %v, want a ConfigError naming DB", err)
	}
	if _, err := sqlitestore.Open(""); !errors.As(err, &ce) || ce.Field != "Path" {
		t.Errorf("Open(\"\") = %v, want a ConfigError naming Path", err)
	}
	db := openDB(t)
	noop := func(context.Context, *sql.Tx, *consumer.Message) error { return nil }
	if _, err := sqlitestore.NewInbox(db, "a:b", noop); !errors.As(err, &ce) || ce.Field != "Namespace" {
		t.Errorf("NewInbox(bad namespace) = %v, want a ConfigError naming Namespace", err)
	}
	if _, err := sqlitestore.NewInbox(db, "x", noop, sqlitestore.WithKey(nil)); !errors.As(err, &ce) || ce.Field != "Key" {
		t.Errorf("NewInbox(nil key) = %v, want a ConfigError naming Key", err)
	}
}
