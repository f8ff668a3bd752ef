// Package sqlitedb opens SQLite databases (modernc.org/sqlite, pure Go) the
// way Ferry's SQLite stores need them, so the outbox and the idempotency
// store agree on one set of settings.
package sqlitedb

import (
	"database/sql"
	"fmt"
	"net/url"

	_ "modernc.org/sqlite" // registers the "sqlite" database/sql driver

	"github.com/ferrymq/ferry/consumer"
)

// Open opens (creating it if needed) the SQLite database file at path with:
// the WAL journal, so readers (a relay) read while a writer writes; a 10 s
// busy timeout; synchronous=NORMAL (durable at each checkpoint, safe
// against corruption); write transactions that take the write lock when they
// begin (BEGIN IMMEDIATE), so concurrent writers wait their turn instead of
// failing with "database is locked"; and one connection, because SQLite has
// one writer anyway and a second connection only starves. Code inside a
// transaction must therefore use its *sql.Tx, never the *sql.DB, or it
// waits for itself. An in-memory database cannot be shared this way: use a
// file.
func Open(path string) (*sql.DB, error) {
	if path == "" {
		return nil, &consumer.ConfigError{Field: "Path", Reason: "must not be empty"}
	}
	q := url.Values{}
	q.Add("_pragma", "busy_timeout(10000)")
	q.Add("_pragma", "journal_mode(WAL)")
	q.Add("_pragma", "synchronous(NORMAL)")
	q.Set("_txlock", "immediate")
	db, err := sql.Open("sqlite", "file:"+path+"?"+q.Encode())
	if err != nil {
		return nil, fmt.Errorf("open SQLite database %s: %w", path, err)
	}
	db.SetMaxOpenConns(1)
	return db, nil
}
