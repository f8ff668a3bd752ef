package outbox_test

import (
	"context"
	"errors"
	"io/fs"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/memory"
	"github.com/ferrymq/ferry/outbox"
	"github.com/ferrymq/ferry/outbox/pgoutbox"
)

// TestPostgresDatabaseSQLWriter writes through database/sql (pgx's stdlib
// driver here; any PostgreSQL driver works) into a schema made by MigrateSQL,
// and a relay over pgx publishes what committed.
func TestPostgresDatabaseSQLWriter(t *testing.T) {
	url := testenv.RequirePostgres(t)
	ctx := testenv.Context(t, 60*time.Second)
	schema := strings.ReplaceAll(testenv.UniqueName(t, "outbox-sql"), "-", "_")
	admin, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, `CREATE SCHEMA `+schema); err != nil {
		t.Fatal(err)
	}
	defer func() {
		admin.Exec(context.Background(), `DROP SCHEMA `+schema+` CASCADE`)
		admin.Close(context.Background())
	}()

	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	db := stdlib.OpenDB(*cfg.ConnConfig.Copy())
	defer db.Close()
	for range 2 { // Migrate twice: the second run has nothing to do
		if err := pgoutbox.MigrateSQL(ctx, db); err != nil {
			t.Fatal(err)
		}
	}
	files, err := fs.Glob(pgoutbox.Migrations, "migrations/*.sql")
	if err != nil {
		t.Fatal(err)
	}
	var versions int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM ferry_outbox_migrations`).Scan(&versions); err != nil || versions != len(files) {
		t.Fatalf("migrations recorded: %d, %v; want one per file, %d", versions, err, len(files))
	}

	w, err := pgoutbox.NewWriter(outbox.WriterMaxEventSize(40))
	if err != nil {
		t.Fatal(err)
	}
	write := func(ev outbox.Event, commit bool) error {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer tx.Rollback()
		if err := w.AddSQL(ctx, tx, ev); err != nil {
			return err
		}
		if commit {
			return tx.Commit()
		}
		return nil
	}
	if err := write(outbox.Event{ID: "big", Destination: queue, Body: []byte("more than forty bytes with its id and destination")}, true); !errors.Is(err, outbox.ErrInvalidEvent) {
		t.Fatalf("oversized event: %v", err)
	}
	if err := write(outbox.Event{ID: "rolled-back", Destination: queue, Key: "k"}, false); err != nil {
		t.Fatal(err)
	}
	if err := write(outbox.Event{ID: "committed", Destination: queue, Key: "k", Body: []byte("hi"),
		Headers: map[string]string{"a": "b"}}, true); err != nil {
		t.Fatal(err)
	}
	// Bytes that are not text go through database/sql unchanged too.
	odd := outbox.Event{ID: "\x00\xff", Destination: queue, Key: "k\x00\xfe", Body: []byte("\xff"),
		Headers: map[string]string{"h\xff": "v\xff\xfe", "h\xfe": "\x00"}}
	w, err = pgoutbox.NewWriter()
	if err != nil {
		t.Fatal(err)
	}
	if err := write(odd, true); err != nil {
		t.Fatal(err)
	}

	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	st, err := pgoutbox.NewStore(pool)
	if err != nil {
		t.Fatal(err)
	}
	br, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer br.Close()
	_, stop := runRelay(t, st, br, fast()...)
	defer stop()
	testenv.WaitFor(t, 30*time.Second, "the committed event was not published", func() bool {
		bl, err := st.Backlog(ctx)
		return err == nil && bl.Events == 0
	})
	msgs := br.Messages(queue)
	if len(msgs) != 2 || msgs[0].ID != "committed" || msgs[0].Header("a") != "b" || string(msgs[0].Body) != "hi" {
		t.Fatalf("published %+v", msgs)
	}
	m := msgs[1]
	if m.ID != odd.ID || m.Key != odd.Key || string(m.Body) != string(odd.Body) || len(m.Headers) != 3 ||
		m.Header("h\xff") != "v\xff\xfe" || m.Header("h\xfe") != "\x00" {
		t.Fatalf("published id %q key %q body %q headers %q, want %+q", m.ID, m.Key, m.Body, m.Headers, odd)
	}
}
