// Package pgstore keeps idempotency keys in PostgreSQL, over pgx/v5.
//
// It offers two ways to make a handler's effects happen once.
//
// [Store] (from [NewStore]) is an [idempotency.Store] for the idempotency
// middleware ([idempotency.New]): a claim is one statement (one round trip),
// and so are completion and release. Any handler can use it, whatever its
// effects are: calls to other services, e-mails, writes to another database.
// Its one gap is the window between the handler's effect and the recorded
// completion: a worker that dies in it leaves a claim that expires, and the
// redelivery runs the handler again.
//
// The transactional inbox ([NewInbox] for pgx.Tx, [NewSQLInbox] for
// database/sql) closes that gap for handlers whose effects are writes to this
// same database: the handler receives a transaction in which the key was
// already inserted, makes its own writes in it, and the key and the writes
// commit together or not at all. A redelivery finds the key committed and is
// acknowledged without running the handler; a failed handler rolls back, key
// included, and the redelivery runs it. There is no lease and no completion
// step: a duplicate that arrives while the first delivery's transaction is
// still open waits for it (on the key's row lock) and then either finds the
// key committed or takes it over after a rollback. The inbox costs one
// statement beyond the handler's own transaction.
//
// Both keep their keys in one table (default [DefaultTable]), whose schema
// is the SQL migration in [Migrations]: [Migrate] (pgx) or [MigrateSQL]
// (database/sql) applies it, and [Schema] returns it for another table name,
// for your own migration tool. Expired keys stay in the table, counted as
// absent, until [Store.Cleanup] deletes them; run it periodically
// ([idempotency.CleanEvery]). Use one namespace with either the middleware
// or the inbox, never both: the inbox reads any live row as done.
//
// The table keeps the SHA-256 of each namespaced key (bytea), not the key:
// keys are arbitrary bytes, NUL and invalid UTF-8 included, which a text
// column refuses, and of any length, which an index entry is not. An error
// that no retry can fix (SQLSTATE class 22, data exception) is returned
// marked [consumer.Permanent], so its message is dead-lettered and a circuit
// breaker does not count it; any other error of the database is retryable.
//
// Times are the database server's clock (now()), so workers on machines with
// skewed clocks agree on when a lease ends.
package pgstore

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/idempotency/internal/keytable"
)

// DefaultTable is the name of the keys table unless WithTable says otherwise.
const DefaultTable = "ferry_idempotency_keys"

//go:embed migrations/*.sql
var migrations embed.FS

// Migrations holds the schema as SQL files, applied in name order, for the
// default table name. Use them with your own migration tool, or call Migrate.
var Migrations fs.FS = migrations

// DB is the handle the package takes, for the Store, the inbox and Migrate:
// *pgxpool.Pool and *pgx.Conn are one, and so is a pgx.Tx (the inbox and
// Migrate then work in a savepoint).
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Option configures NewStore, NewInbox, NewSQLInbox, Migrate and
// MigrateSQL. An invalid value makes the function fail with a
// *consumer.ConfigError naming the field. An option that does not apply to
// a function (WithRetention or WithKey given to NewStore or Migrate) is
// ignored, so one list of options can serve an inbox and its migration.
type Option func(*config) error

type config = keytable.Config

// WithTable sets the keys table: lower-case letters, digits and '_', at most
// 40 characters, unqualified (it is found through the search_path). Default
// DefaultTable (ferry_idempotency_keys).
func WithTable(name string) Option {
	return Option(keytable.Table(name))
}

// WithRetention sets how long the inbox keeps a key (NewInbox and
// NewSQLInbox only; the middleware's retention is
// idempotency.WithRetention). It must be > 0. Default
// idempotency.DefaultRetention (15 days).
func WithRetention(d time.Duration) Option {
	return Option(keytable.Retention(d))
}

// WithKey sets how the inbox derives a message's key (NewInbox and
// NewSQLInbox only; the middleware's is idempotency.WithKey). It must not be
// nil. Default idempotency.DefaultKey (the ferry-event-id header, else the
// broker's message id).
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

// migrateLock serialises Migrate and MigrateSQL across processes.
const migrateLock = "SELECT pg_advisory_xact_lock(hashtext('ferry-idempotency-migrate'))"

// Migrate creates the keys table (WithTable) if it does not exist, in one
// transaction on db. It is safe to call from many processes at once (it
// serialises on an advisory lock) and to call again.
func Migrate(ctx context.Context, db DB, opts ...Option) error {
	if db == nil {
		return consumer.ConfigErrorf("DB", "must not be nil")
	}
	c, schema, err := migration(opts)
	if err != nil {
		return err
	}
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, migrateLock); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, schema)
		return err
	})
	if err != nil {
		return fmt.Errorf("pgstore: migrate table %s: %w", c.Table, err)
	}
	return nil
}

// MigrateSQL is Migrate for database/sql over PostgreSQL (the pgx stdlib
// driver, lib/pq).
func MigrateSQL(ctx context.Context, db *sql.DB, opts ...Option) error {
	if db == nil {
		return consumer.ConfigErrorf("DB", "must not be nil")
	}
	c, schema, err := migration(opts)
	if err != nil {
		return err
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("pgstore: migrate table %s: %w", c.Table, err)
	}
	defer func() { _ = tx.Rollback() }() // a no-op after Commit
	if _, err := tx.ExecContext(ctx, migrateLock); err != nil {
		return fmt.Errorf("pgstore: migrate table %s: %w", c.Table, err)
	}
	if _, err := tx.ExecContext(ctx, schema); err != nil {
		return fmt.Errorf("pgstore: migrate table %s: %w", c.Table, err)
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("pgstore: migrate table %s: %w", c.Table, err)
	}
	return nil
}

// migration returns the configuration opts make and its schema.
func migration(opts []Option) (config, string, error) {
	c, err := buildConfig(opts)
	if err != nil {
		return c, "", err
	}
	schema, err := render(c.Table)
	if err != nil {
		return c, "", fmt.Errorf("pgstore: migrate: %w", err)
	}
	return c, schema, nil
}

// Store is an idempotency.Store and idempotency.Cleaner in PostgreSQL. Claim,
// Complete and Release are one statement each. Build one with NewStore.
type Store struct {
	db                                DB
	table                             string
	claimSQL, completeSQL, releaseSQL string
	cleanupSQL                        string
}

var _ interface {
	idempotency.Store
	idempotency.Cleaner
} = (*Store)(nil)

// NewStore returns a Store over db, in the table (WithTable) that Migrate
// created. Of the options, only WithTable applies.
func NewStore(db DB, opts ...Option) (*Store, error) {
	if db == nil {
		return nil, consumer.ConfigErrorf("DB", "must not be nil")
	}
	c, err := buildConfig(opts)
	if err != nil {
		return nil, err
	}
	t := c.Table
	return &Store{
		db:    db,
		table: t,
		// An expired row is taken over; a live one is left as it was (the
		// CASEs), and the statement always returns the row as it is now, so a
		// claim is one round trip whatever it finds.
		claimSQL: `INSERT INTO ` + t + ` AS k (key_hash, token, done, expires_at)
VALUES ($1, $2, false, now() + $3::bigint * interval '1 millisecond')
ON CONFLICT (key_hash) DO UPDATE SET
  token      = CASE WHEN k.expires_at <= now() THEN excluded.token      ELSE k.token      END,
  done       = CASE WHEN k.expires_at <= now() THEN false               ELSE k.done       END,
  expires_at = CASE WHEN k.expires_at <= now() THEN excluded.expires_at ELSE k.expires_at END
RETURNING k.token = $2, k.done, (extract(epoch FROM k.expires_at - now()) * 1000)::bigint`,
		completeSQL: `UPDATE ` + t + ` SET token = '', done = true, expires_at = now() + $3::bigint * interval '1 millisecond'
WHERE key_hash = $1 AND token = $2 AND NOT done`,
		releaseSQL: `DELETE FROM ` + t + ` WHERE key_hash = $1 AND token = $2 AND NOT done`,
		cleanupSQL: `DELETE FROM ` + t + ` WHERE key_hash IN (
  SELECT key_hash FROM ` + t + ` WHERE expires_at <= now() FOR UPDATE SKIP LOCKED
) AND expires_at <= now()`,
	}, nil
}

// Claim implements idempotency.Store.
func (s *Store) Claim(ctx context.Context, key string, lease time.Duration) (idempotency.Claim, error) {
	tok := idempotency.NewToken()
	var (
		mine, done bool
		leftMS     int64
	)
	err := s.db.QueryRow(ctx, s.claimSQL, keytable.Hash(key), tok, lease.Milliseconds()).Scan(&mine, &done, &leftMS)
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
	return s.settle(ctx, "complete", s.completeSQL, key, token, retention.Milliseconds())
}

// Release implements idempotency.Store.
func (s *Store) Release(ctx context.Context, key, token string) error {
	return s.settle(ctx, "release", s.releaseSQL, key, token)
}

func (s *Store) settle(ctx context.Context, op, sql, key, token string, args ...any) error {
	if token == "" {
		return idempotency.ErrNotOwner
	}
	tag, err := s.db.Exec(ctx, sql, append([]any{keytable.Hash(key), token}, args...)...)
	if err != nil {
		return storeErr(op, err)
	}
	if tag.RowsAffected() == 0 {
		return idempotency.ErrNotOwner
	}
	return nil
}

// Cleanup implements idempotency.Cleaner: it deletes the rows whose lease
// or retention ended, in one statement (a scan of the table), and returns how
// many it deleted. Rows locked by a claim taking an expired key over are
// skipped.
func (s *Store) Cleanup(ctx context.Context) (int64, error) {
	tag, err := s.db.Exec(ctx, s.cleanupSQL)
	if err != nil {
		return 0, storeErr("cleanup", err)
	}
	return tag.RowsAffected(), nil
}

// sqlStater is what the errors of PostgreSQL drivers have in common
// (*pgconn.PgError of pgx and its database/sql driver, *pq.Error of
// lib/pq): the SQLSTATE code.
type sqlStater interface{ SQLState() string }

// dataException reports whether err carries an SQLSTATE of class 22, data
// exception: the statement's data is wrong (bytes invalid in the encoding, a
// value out of range or too long for its column), and running it again
// fails again.
func dataException(err error) bool {
	var s sqlStater
	return errors.As(err, &s) && strings.HasPrefix(s.SQLState(), "22")
}

// storeErr wraps an error of the database for op. One that no retry can fix
// (a data exception) is marked consumer.Permanent, so that its message goes
// to the dead-letter destination and a circuit breaker does not count it;
// any other (the database unreachable, a timeout, a missing table) stays
// retryable.
func storeErr(op string, err error) error {
	err = fmt.Errorf("pgstore: %s: %w", op, err)
	if dataException(err) {
		return consumer.Permanent(err)
	}
	return err
}
