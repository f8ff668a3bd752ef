package demo

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/idempotency/pgstore"
	"github.com/ferrymq/ferry/idempotency/sqlitestore"
	"github.com/ferrymq/ferry/outbox"
	"github.com/ferrymq/ferry/outbox/pgoutbox"
	"github.com/ferrymq/ferry/outbox/sqliteoutbox"
)

// This file is where the two services keep their rows: SQLite files in the
// run's temporary folder (the default), or a schema of the run's own in
// the PostgreSQL of Config.DB.

// ErrBadDBURL is what Run fails with when Config.DB is not a PostgreSQL
// URL.
var ErrBadDBURL = errors.New("demo: the database URL is not a PostgreSQL URL")

// databases opens the services' databases.
type databases struct {
	dir string // SQLite: the folder of the files

	// PostgreSQL: one pool over the run's schema, and its database/sql view
	// for the code both databases share.
	url    string
	schema string
	pool   *pgxpool.Pool
	sqlDB  *sql.DB
}

// pgMaxConns bounds the run's PostgreSQL connections: the relay's LISTEN
// holds one, and both consumers' handlers claim keys and write payments at
// once.
const pgMaxConns = 20

func openDatabases(ctx context.Context, cfg Config, dir string) (_ *databases, err error) {
	d := &databases{dir: dir}
	if cfg.DB == "" {
		return d, nil
	}
	d.url = cfg.DB
	pcfg, err := pgxpool.ParseConfig(cfg.DB)
	if err != nil {
		// pgx's message may quote the URL.
		return nil, fmt.Errorf("%w: %s", ErrBadDBURL, ferry.Redact(err.Error()))
	}
	d.schema = "ferry_demo_" + runID()
	conn, err := pgx.ConnectConfig(ctx, pcfg.ConnConfig.Copy())
	if err != nil {
		return nil, fmt.Errorf("demo: connect to PostgreSQL: %s", ferry.Redact(err.Error()))
	}
	_, err = conn.Exec(ctx, "CREATE SCHEMA "+d.schema)
	_ = conn.Close(ctx)
	if err != nil {
		return nil, fmt.Errorf("demo: create schema %s: %w", d.schema, err)
	}
	defer func() {
		if err != nil {
			d.close(context.WithoutCancel(ctx))
		}
	}()
	pcfg.ConnConfig.RuntimeParams["search_path"] = d.schema
	pcfg.MaxConns = pgMaxConns
	if d.pool, err = pgxpool.NewWithConfig(ctx, pcfg); err != nil {
		return nil, fmt.Errorf("demo: PostgreSQL pool: %s", ferry.Redact(err.Error()))
	}
	d.sqlDB = stdlib.OpenDBFromPool(d.pool)
	return d, nil
}

// postgres reports whether the services keep their rows in PostgreSQL.
func (d *databases) postgres() bool { return d.pool != nil }

// describe names the database, for the first lines.
func (d *databases) describe() string {
	if !d.postgres() {
		return "SQLite"
	}
	return fmt.Sprintf("PostgreSQL (schema %s, made for this run)", d.schema)
}

// q rewrites a query's ? placeholders as PostgreSQL's $1, $2, ...
func (d *databases) q(query string) string {
	if !d.postgres() {
		return query
	}
	var b strings.Builder
	n := 0
	for _, r := range query {
		if r == '?' {
			n++
			b.WriteString("$" + strconv.Itoa(n))
			continue
		}
		b.WriteRune(r)
	}
	return b.String()
}

// addFunc adds events in the caller's transaction.
type addFunc func(ctx context.Context, tx *sql.Tx, events ...outbox.Event) error

// orders opens the order service's database with the outbox's tables:
// its handle, how to add events, and the relay's store.
func (d *databases) orders(ctx context.Context) (*sql.DB, addFunc, outbox.Store, error) {
	if !d.postgres() {
		db, err := sqliteoutbox.Open(filepath.Join(d.dir, "orders.db"))
		if err != nil {
			return nil, nil, nil, err
		}
		fail := func(err error) (*sql.DB, addFunc, outbox.Store, error) {
			db.Close()
			return nil, nil, nil, fmt.Errorf("demo: order service: %w", err)
		}
		if err := sqliteoutbox.Migrate(ctx, db); err != nil {
			return fail(err)
		}
		w, err := sqliteoutbox.NewWriter()
		if err != nil {
			return fail(err)
		}
		st, err := sqliteoutbox.NewStore(db)
		if err != nil {
			return fail(err)
		}
		return db, w.Add, st, nil
	}
	if err := pgoutbox.Migrate(ctx, d.pool); err != nil {
		return nil, nil, nil, fmt.Errorf("demo: order service: %w", err)
	}
	w, err := pgoutbox.NewWriter()
	if err != nil {
		return nil, nil, nil, err
	}
	st, err := pgoutbox.NewStore(d.pool)
	if err != nil {
		return nil, nil, nil, err
	}
	return d.shared(), w.AddSQL, st, nil
}

// billing opens the billing service's database. With idempotency, it
// creates the keys tables of the middleware's store and of the inbox (which
// must not share one), and returns the store.
func (d *databases) billing(ctx context.Context, withKeys bool) (*sql.DB, idempotency.Store, error) {
	if !d.postgres() {
		db, err := sqlitestore.Open(filepath.Join(d.dir, "billing.db"))
		if err != nil {
			return nil, nil, err
		}
		if !withKeys {
			return db, nil, nil
		}
		for _, table := range []string{sqlitestore.DefaultTable, inboxTable} {
			if err := sqlitestore.Migrate(ctx, db, sqlitestore.WithTable(table)); err != nil {
				db.Close()
				return nil, nil, err
			}
		}
		st, err := sqlitestore.NewStore(db)
		if err != nil {
			db.Close()
			return nil, nil, err
		}
		return db, st, nil
	}
	if !withKeys {
		return d.shared(), nil, nil
	}
	for _, table := range []string{pgstore.DefaultTable, inboxTable} {
		if err := pgstore.Migrate(ctx, d.pool, pgstore.WithTable(table)); err != nil {
			return nil, nil, err
		}
	}
	st, err := pgstore.NewStore(d.pool)
	if err != nil {
		return nil, nil, err
	}
	return d.shared(), st, nil
}

// inbox returns the transactional inbox over db, on its own keys table.
func (d *databases) inbox(db *sql.DB, h func(ctx context.Context, tx *sql.Tx, m *consumer.Message) error) (consumer.Handler, error) {
	if !d.postgres() {
		return sqlitestore.NewInbox(db, billingNamespace, h, sqlitestore.WithTable(inboxTable))
	}
	return pgstore.NewSQLInbox(db, billingNamespace, h, pgstore.WithTable(inboxTable))
}

// paymentsSchema is the payments table. It has no unique constraint on
// purpose: the verdict counts double payments.
func (d *databases) paymentsSchema() string {
	id := "INTEGER PRIMARY KEY AUTOINCREMENT"
	if d.postgres() {
		id = "BIGSERIAL PRIMARY KEY"
	}
	return `CREATE TABLE IF NOT EXISTS payments (
    id           ` + id + `,
    order_id     TEXT   NOT NULL,  -- no unique constraint: the verdict counts double payments
    event_id     TEXT   NOT NULL,
    amount_cents BIGINT NOT NULL,
    consumer     TEXT   NOT NULL,
    paid_at      BIGINT NOT NULL
)`
}

// shared is the PostgreSQL pool's database/sql view, which the services
// share: closing it is close's job.
func (d *databases) shared() *sql.DB { return d.sqlDB }

// closeDB closes db unless it is the PostgreSQL pool's shared view.
func (d *databases) closeDB(db *sql.DB) error {
	if db == nil || (d.postgres() && db == d.sqlDB) {
		return nil
	}
	return db.Close()
}

// closeStore closes an idempotency store that holds resources of its own.
func closeStore(st idempotency.Store) {
	if c, ok := st.(io.Closer); ok {
		_ = c.Close()
	}
}

// close drops the run's schema and closes the pool.
func (d *databases) close(ctx context.Context) {
	if d.schema == "" {
		return // SQLite: the folder goes with the run
	}
	if d.sqlDB != nil {
		_ = d.sqlDB.Close()
	}
	if d.pool != nil {
		d.pool.Close()
	}
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	cfg, err := pgx.ParseConfig(d.url)
	if err != nil {
		return
	}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return
	}
	defer conn.Close(ctx)
	_, _ = conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+d.schema+" CASCADE")
}
