// Package sqlitestore keeps idempotency keys in SQLite, through database/sql
// with modernc.org/sqlite (pure Go, no cgo): the embedded default for a
// single node.
//
// [Store] (from [NewStore]) is an [idempotency.Store] for the idempotency
// middleware ([idempotency.New]); claim, completion and release are one
// statement each. [NewInbox] builds the transactional inbox: the handler
// receives a *sql.Tx in which the message's key was already inserted, so the
// key and the handler's own writes commit together or not at all, and there
// is no completion step to lose (see package idempotency for the guarantee).
// Both keep their keys in one table (default [DefaultTable]), whose schema
// is the SQL migration in [Migrations]: [Migrate] applies it, and [Schema]
// returns it for another table name, for your own migration tool.
//
// SQLite allows one writer at a time, and its busy handler (which makes a
// writer sleep and try again while another holds the lock) is neither fair
// nor quick: many goroutines writing through many connections starve one
// another into SQLITE_BUSY. [Open] therefore returns a *sql.DB with a single
// connection, so that goroutines queue in database/sql, in order, instead of
// in SQLite; with a WAL journal, a busy timeout of 10 s (for other processes
// that open the file) and BEGIN IMMEDIATE transactions. With one connection,
// an inbox's handler must do its work through the *sql.Tx it receives, never
// through the *sql.DB (which would wait for the connection the transaction
// holds). A *sql.DB opened otherwise should be set up the same way.
//
// The table keeps the SHA-256 of each namespaced key (a BLOB), so that keys
// of any bytes and any length take 32 bytes of the primary key. An error no
// retry can fix (SQLITE_TOOBIG, SQLITE_MISMATCH) is returned marked
// [consumer.Permanent], so its message is dead-lettered and a circuit
// breaker does not count it; any other error of the database is retryable.
//
// Leases and retention are measured with this process's clock, which is
// right for a database file that one node uses. Expired keys stay in the
// table, counted as absent, until [Store.Cleanup] deletes them; run it
// periodically ([idempotency.CleanEvery]). Use one namespace with either the middleware or
// the inbox, never both: the inbox reads any live row as done.
package sqlitestore

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"time"

	"modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/idempotency/internal/keytable"
	"github.com/ferrymq/ferry/internal/sqlitedb"
)

// DefaultTable is the name of the keys table unless WithTable says otherwise.
const DefaultTable = "ferry_idempotency_keys"

//go:embed migrations/*.sql
var migrations embed.FS

// Migrations holds the schema as SQL files, applied in name order, for the
// default table name. Use them with your own migration tool, or call Migrate.
var Migrations fs.FS = migrations

// Open opens (creating it if needed) the SQLite database file at path with
// the settings the package documentation describes.
func Open(path string) (*sql.DB, error) {
	db, err := sqlitedb.Open(path)
	if err != nil {
		return nil, fmt.Errorf("sqlitestore: %w", err)
	}
	return db, nil
}

// Option configures NewStore, NewInbox and Migrate. An invalid value makes
// the function fail with a *consumer.ConfigError naming the field. An
// option that does not apply to a function (WithRetention or WithKey given
// to NewStore or Migrate) is ignored, so one list of options can serve an
// inbox and its migration.
type Option func(*config) error

type config = keytable.Config

// WithTable sets the keys table: lower-case letters, digits and '_', at most
// 40 characters. Default DefaultTable (ferry_idempotency_keys).
func WithTable(name string) Option {
	return Option(keytable.Table(name))
}

// WithRetention sets how long the inbox keeps a key (NewInbox only; the
// middleware's retention is idempotency.WithRetention). It must be > 0.
// Default idempotency.DefaultRetention (15 days).
func WithRetention(d time.Duration) Option {
	return Option(keytable.Retention(d))
}

// WithKey sets how the inbox derives a message's key (NewInbox only; the
// middleware's is idempotency.WithKey). It must not be nil. Default
// idempotency.DefaultKey (the ferry-event-id header, else the broker's
// message id).
func WithKey(f idempotency.KeyFunc) Option {
	return Option(keytable.Key(f))
}

func buildConfig(opts []Option) (config, error) {
	return keytable.Build(DefaultTable, opts)
}

// Schema returns the schema migration for the keys table named table (all
// the files of Migrations, in order, with the default table name replaced),
// for use with your own migration tool. A name that WithTable would refuse
// is a *consumer.ConfigError naming Table.
func Schema(table string) (string, error) {
	c, err := buildConfig([]Option{WithTable(table)})
	if err != nil {
		return "", err
	}
	return render(c.Table)
}

func render(table string) (string, error) {
	return keytable.Render(migrations, "migrations/*.sql", DefaultTable, table)
}

// Migrate creates the keys table (WithTable) if it does not exist, in one
// transaction. It is safe to call again.
func Migrate(ctx context.Context, db *sql.DB, opts ...Option) error {
	if db == nil {
		return consumer.ConfigErrorf("DB", "must not be nil")
	}
	c, err := buildConfig(opts)
	if err != nil {
		return err
	}
	schema, err := render(c.Table)
	if err != nil {
		return fmt.Errorf("sqlitestore: migrate: %w", err)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("sqlitestore: migrate table %s: %w", c.Table, err)
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(ctx, schema); err != nil {
		return fmt.Errorf("sqlitestore: migrate table %s: %w", c.Table, err)
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("sqlitestore: migrate table %s: %w", c.Table, err)
	}
	return nil
}

// Store is an idempotency.Store and idempotency.Cleaner in SQLite. Build one
// with NewStore.
type Store struct {
	db                              *sql.DB
	now                             func() time.Time
	claim, complete, release, clean *sql.Stmt
}

var _ interface {
	idempotency.Store
	idempotency.Cleaner
} = (*Store)(nil)

// NewStore returns a Store over db, in the table (WithTable) that Migrate
// created, with its statements prepared (so it fails if the table does not
// exist). Of the options, only WithTable applies. Close releases the
// statements.
func NewStore(db *sql.DB, opts ...Option) (*Store, error) {
	if db == nil {
		return nil, consumer.ConfigErrorf("DB", "must not be nil")
	}
	c, err := buildConfig(opts)
	if err != nil {
		return nil, err
	}
	t := c.Table
	s := &Store{db: db, now: time.Now}
	for _, p := range []struct {
		dst  **sql.Stmt
		text string
	}{
		// ?1 key, ?2 token, ?3 now, ?4 lease end. An expired row is taken
		// over, a live one left as it was; the row is always returned.
		{&s.claim, `INSERT INTO ` + t + ` (key_hash, token, done, expires_at) VALUES (?1, ?2, 0, ?4)
ON CONFLICT (key_hash) DO UPDATE SET
  token      = CASE WHEN expires_at <= ?3 THEN excluded.token      ELSE token      END,
  done       = CASE WHEN expires_at <= ?3 THEN 0                   ELSE done       END,
  expires_at = CASE WHEN expires_at <= ?3 THEN excluded.expires_at ELSE expires_at END
RETURNING token = ?2, done, expires_at - ?3`},
		{&s.complete, `UPDATE ` + t + ` SET token = '', done = 1, expires_at = ?3 WHERE key_hash = ?1 AND token = ?2 AND done = 0`},
		{&s.release, `DELETE FROM ` + t + ` WHERE key_hash = ?1 AND token = ?2 AND done = 0`},
		{&s.clean, `DELETE FROM ` + t + ` WHERE key_hash IN (SELECT key_hash FROM ` + t + ` WHERE expires_at <= ?1 LIMIT ?2)`},
	} {
		stmt, err := db.PrepareContext(context.Background(), p.text)
		if err != nil {
			s.Close()
			return nil, fmt.Errorf("sqlitestore: prepare (has Migrate created table %s?): %w", t, err)
		}
		*p.dst = stmt
	}
	return s, nil
}

// Close releases the store's prepared statements. It does not close the
// *sql.DB.
func (s *Store) Close() error {
	var errs []error
	for _, st := range []*sql.Stmt{s.claim, s.complete, s.release, s.clean} {
		if st != nil {
			errs = append(errs, st.Close())
		}
	}
	return errors.Join(errs...)
}

// Claim implements idempotency.Store.
func (s *Store) Claim(ctx context.Context, key string, lease time.Duration) (idempotency.Claim, error) {
	tok := idempotency.NewToken()
	now := s.now().UnixMilli()
	var (
		mine, done bool
		leftMS     int64
	)
	err := s.claim.QueryRowContext(ctx, keytable.Hash(key), tok, now, now+lease.Milliseconds()).Scan(&mine, &done, &leftMS)
	if err != nil {
		return idempotency.Claim{}, storeErr("claim", err)
	}
	switch {
	case mine:
		return idempotency.Claim{Status: idempotency.Claimed, Token: tok}, nil
	case done:
		return idempotency.Claim{Status: idempotency.Done}, nil
	}
	return idempotency.Claim{Status: idempotency.InProgress, LeaseLeft: time.Duration(max(leftMS, 0)) * time.Millisecond}, nil
}

// Complete implements idempotency.Store.
func (s *Store) Complete(ctx context.Context, key, token string, retention time.Duration) error {
	return s.settle(ctx, "complete", s.complete, key, token, s.now().UnixMilli()+retention.Milliseconds())
}

// Release implements idempotency.Store.
func (s *Store) Release(ctx context.Context, key, token string) error {
	return s.settle(ctx, "release", s.release, key, token)
}

func (s *Store) settle(ctx context.Context, op string, st *sql.Stmt, key, token string, args ...any) error {
	if token == "" {
		return idempotency.ErrNotOwner
	}
	res, err := st.ExecContext(ctx, append([]any{keytable.Hash(key), token}, args...)...)
	if err != nil {
		return storeErr(op, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return storeErr(op, err)
	}
	if n == 0 {
		return idempotency.ErrNotOwner
	}
	return nil
}

// cleanupBatch bounds the rows one DELETE of Cleanup removes, so that it
// never holds the write lock for long.
const cleanupBatch = 5000

// Cleanup implements idempotency.Cleaner: it deletes the rows whose lease or
// retention ended, in batches, and returns how many it deleted.
func (s *Store) Cleanup(ctx context.Context) (int64, error) {
	var total int64
	now := s.now().UnixMilli()
	for {
		res, err := s.clean.ExecContext(ctx, now, cleanupBatch)
		if err != nil {
			return total, fmt.Errorf("sqlitestore: cleanup: %w", err)
		}
		n, err := res.RowsAffected()
		if err != nil {
			return total, fmt.Errorf("sqlitestore: cleanup: %w", err)
		}
		total += n
		if n < cleanupBatch {
			return total, nil
		}
	}
}

// unfixable reports whether err is an SQLite error that running the
// statement again cannot fix: a string or blob too big (SQLITE_TOOBIG) or a
// datatype mismatch (SQLITE_MISMATCH).
func unfixable(err error) bool {
	var e *sqlite.Error
	if !errors.As(err, &e) {
		return false
	}
	switch e.Code() & 0xff { // the primary result code
	case sqlite3.SQLITE_TOOBIG, sqlite3.SQLITE_MISMATCH:
		return true
	}
	return false
}

// storeErr wraps an error of the database for op. One that no retry can fix
// is marked consumer.Permanent, so that its message goes to the dead-letter
// destination and a circuit breaker does not count it; any other (the
// database locked or closed, a missing table) stays retryable.
func storeErr(op string, err error) error {
	err = fmt.Errorf("sqlitestore: %s: %w", op, err)
	if unfixable(err) {
		return consumer.Permanent(err)
	}
	return err
}
