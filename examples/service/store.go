package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

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

// store is where the service keeps its rows: orders with the outbox that
// ships their events, and payments with the inbox keys that make each one
// happen once. It is PostgreSQL, or SQLite in a temporary folder; the code
// above it is the same for both, over database/sql.
type store struct {
	db       *sql.DB // the service's queries, the outbox writer, the inbox
	postgres bool
	pool     *pgxpool.Pool // PostgreSQL: the pool db is a view of
	dir      string        // SQLite: the temporary folder

	add    func(ctx context.Context, tx *sql.Tx, events ...outbox.Event) error // writes events in tx
	outbox outbox.Store                                                        // what the relay reads
	keys   idempotency.Cleaner                                                 // removes expired inbox keys
}

// txHandler handles a message in the inbox's transaction.
type txHandler = func(ctx context.Context, tx *sql.Tx, m *consumer.Message) error

// schema is the service's own tables, for both databases.
const schema = `
CREATE TABLE IF NOT EXISTS orders (
    order_id     TEXT   PRIMARY KEY,
    amount_cents BIGINT NOT NULL,
    placed_at    TEXT   NOT NULL
);
CREATE TABLE IF NOT EXISTS payments (
    order_id     TEXT   NOT NULL, -- no unique constraint: the inbox is what pays once
    event_id     TEXT   NOT NULL,
    amount_cents BIGINT NOT NULL,
    paid_at      TEXT   NOT NULL
);
CREATE INDEX IF NOT EXISTS payments_order ON payments (order_id);
`

// openStore opens PostgreSQL at dbURL, or SQLite when it is "", and
// creates the tables (the outbox's, the inbox keys', the service's).
// Replicas may do it at once.
func openStore(ctx context.Context, dbURL string) (_ *store, err error) {
	s := &store{}
	defer func() {
		if err != nil {
			s.close()
		}
	}()
	if dbURL == "" {
		if s.dir, err = os.MkdirTemp("", "ferry-service-"); err != nil {
			return nil, err
		}
		if s.db, err = sqliteoutbox.Open(filepath.Join(s.dir, "service.db")); err != nil {
			return nil, err
		}
		if err := sqliteoutbox.Migrate(ctx, s.db); err != nil {
			return nil, err
		}
		if err := sqlitestore.Migrate(ctx, s.db); err != nil {
			return nil, err
		}
		w, err := sqliteoutbox.NewWriter()
		if err != nil {
			return nil, err
		}
		s.add = w.Add
		if s.outbox, err = sqliteoutbox.NewStore(s.db); err != nil {
			return nil, err
		}
		keys, err := sqlitestore.NewStore(s.db)
		if err != nil {
			return nil, err
		}
		s.keys = keys
	} else {
		s.postgres = true
		if s.pool, err = pgxpool.New(ctx, dbURL); err != nil {
			// pgx's message may quote the URL, password and all.
			return nil, errors.New("FERRY_DB_URL: " + ferry.Redact(err.Error()))
		}
		if err := s.pool.Ping(ctx); err != nil {
			return nil, fmt.Errorf("PostgreSQL: %s", ferry.Redact(err.Error()))
		}
		s.db = stdlib.OpenDBFromPool(s.pool)
		if err := pgoutbox.Migrate(ctx, s.pool); err != nil {
			return nil, err
		}
		if err := pgstore.Migrate(ctx, s.pool); err != nil {
			return nil, err
		}
		w, err := pgoutbox.NewWriter()
		if err != nil {
			return nil, err
		}
		s.add = w.AddSQL
		if s.outbox, err = pgoutbox.NewStore(s.pool); err != nil {
			return nil, err
		}
		if s.keys, err = pgstore.NewStore(s.pool); err != nil {
			return nil, err
		}
	}
	for stmt := range strings.SplitSeq(schema, ";") {
		if strings.TrimSpace(stmt) == "" {
			continue
		}
		if _, err := s.db.ExecContext(ctx, stmt); err != nil {
			return nil, fmt.Errorf("create the service's tables: %w", err)
		}
	}
	return s, nil
}

// inbox returns the transactional inbox over h, with keys in namespace.
func (s *store) inbox(namespace string, h txHandler) (consumer.Handler, error) {
	if s.postgres {
		return pgstore.NewSQLInbox(s.db, namespace, h)
	}
	return sqlitestore.NewInbox(s.db, namespace, h)
}

// q rewrites a query's ? placeholders as PostgreSQL's $1, $2, ...
func (s *store) q(query string) string {
	if !s.postgres {
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

// describe names the database, for the log.
func (s *store) describe() string {
	if s.postgres {
		return "PostgreSQL"
	}
	return "SQLite in " + s.dir
}

func (s *store) close() {
	if c, ok := s.keys.(io.Closer); ok {
		_ = c.Close()
	}
	if s.db != nil {
		_ = s.db.Close()
	}
	if s.pool != nil {
		s.pool.Close()
	}
	if s.dir != "" {
		_ = os.RemoveAll(s.dir)
	}
}
