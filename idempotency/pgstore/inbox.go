package pgstore

import (
	"context"
	"database/sql"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/idempotency/internal/inboxcount"
	"github.com/ferrymq/ferry/idempotency/internal/keytable"
)

// TxHandler handles a message inside the inbox's transaction (NewInbox): its
// writes through tx commit together with the message's key, or not at all.
// It must not commit or roll back tx.
type TxHandler func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error

// SQLTxHandler is TxHandler for database/sql, for NewSQLInbox.
type SQLTxHandler func(ctx context.Context, tx *sql.Tx, m *consumer.Message) error

type inbox struct {
	prefix    string
	key       idempotency.KeyFunc
	insertSQL string
	retention int64 // milliseconds
}

func newInbox(namespace string, opts []Option) (inbox, error) {
	if namespace == "" {
		return inbox{}, consumer.ConfigErrorf("Namespace", "must not be empty")
	}
	if strings.Contains(namespace, ":") {
		return inbox{}, consumer.ConfigErrorf("Namespace", "must not contain ':', got %q", namespace)
	}
	c, err := buildConfig(opts)
	if err != nil {
		return inbox{}, err
	}
	return inbox{
		prefix:    idempotency.Key(namespace, ""),
		key:       c.Key,
		retention: c.Retention.Milliseconds(),
		// A key whose retention ended (not yet cleaned up) is taken over;
		// a live one inserts nothing. A concurrent, uncommitted insert of the
		// same key makes this wait for its transaction to end.
		insertSQL: `INSERT INTO ` + c.Table + ` AS k (key_hash, token, done, expires_at)
VALUES ($1, '', true, now() + $2::bigint * interval '1 millisecond')
ON CONFLICT (key_hash) DO UPDATE SET token = '', done = true, expires_at = excluded.expires_at
WHERE k.expires_at <= now()`,
	}, nil
}

func (in inbox) keyOf(m *consumer.Message) (string, error) {
	k, err := in.key(m)
	if err != nil {
		return "", consumer.Permanent(fmt.Errorf("%w: %w", idempotency.ErrNoKey, err))
	}
	if k == "" {
		return "", consumer.Permanent(fmt.Errorf("%w (message %q from %q)", idempotency.ErrNoKey, m.ID, m.Source))
	}
	return in.prefix + k, nil
}

// NewInbox returns a Handler that runs h once per key, in a transaction that
// also records the key: see the package documentation. namespace is the
// consumer's name, as for idempotency.New. WithTable, WithRetention and
// WithKey apply.
//
// A handler error rolls back and is returned unchanged; a duplicate is
// acknowledged (nil) without calling h; a database that cannot be reached is
// a wrapped error, and h is not called; a key the database refuses for good
// (a data exception) is a permanent error. A message without a key is a
// permanent error wrapping idempotency.ErrNoKey.
func NewInbox(db DB, namespace string, h TxHandler, opts ...Option) (consumer.Handler, error) {
	if db == nil {
		return nil, consumer.ConfigErrorf("DB", "must not be nil")
	}
	if h == nil {
		return nil, consumer.ConfigErrorf("Handler", "must not be nil")
	}
	in, err := newInbox(namespace, opts)
	if err != nil {
		return nil, err
	}
	counts := &inboxcount.Counts{}
	return &inboxcount.Handler{Counts: counts, Fn: func(ctx context.Context, m *consumer.Message) (err error) {
		key, err := in.keyOf(m)
		if err != nil {
			counts.NoKey.Add(1)
			return err
		}
		tx, err := db.Begin(ctx)
		if err != nil {
			return counts.StoreErr(storeErr, "inbox: begin", err)
		}
		defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }() // a no-op after Commit
		tag, err := tx.Exec(ctx, in.insertSQL, keytable.Hash(key), in.retention)
		if err != nil {
			return counts.StoreErr(storeErr, "inbox: record key "+keytable.Quote(key), err)
		}
		if tag.RowsAffected() == 0 {
			counts.Duplicates.Add(1)
			return nil // committed before: a duplicate
		}
		if err := h(ctx, tx, m); err != nil {
			return err
		}
		if err := tx.Commit(ctx); err != nil {
			return counts.StoreErr(storeErr, "inbox: commit "+keytable.Quote(key), err)
		}
		counts.Completed.Add(1)
		return nil
	}}, nil
}

// NewSQLInbox is NewInbox for database/sql over PostgreSQL (the pgx stdlib
// driver, lib/pq): the same table, the same guarantee, with a *sql.Tx.
func NewSQLInbox(db *sql.DB, namespace string, h SQLTxHandler, opts ...Option) (consumer.Handler, error) {
	if db == nil {
		return nil, consumer.ConfigErrorf("DB", "must not be nil")
	}
	if h == nil {
		return nil, consumer.ConfigErrorf("Handler", "must not be nil")
	}
	in, err := newInbox(namespace, opts)
	if err != nil {
		return nil, err
	}
	counts := &inboxcount.Counts{}
	return &inboxcount.Handler{Counts: counts, Fn: func(ctx context.Context, m *consumer.Message) error {
		key, err := in.keyOf(m)
		if err != nil {
			counts.NoKey.Add(1)
			return err
		}
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return counts.StoreErr(storeErr, "inbox: begin", err)
		}
		defer func() { _ = tx.Rollback() }() // a no-op after Commit
		res, err := tx.ExecContext(ctx, in.insertSQL, keytable.Hash(key), in.retention)
		if err != nil {
			return counts.StoreErr(storeErr, "inbox: record key "+keytable.Quote(key), err)
		}
		n, err := res.RowsAffected()
		if err != nil {
			return counts.StoreErr(storeErr, "inbox: record key "+keytable.Quote(key), err)
		}
		if n == 0 {
			counts.Duplicates.Add(1)
			return nil // committed before: a duplicate
		}
		if err := h(ctx, tx, m); err != nil {
			return err
		}
		if err := tx.Commit(); err != nil {
			return counts.StoreErr(storeErr, "inbox: commit "+keytable.Quote(key), err)
		}
		counts.Completed.Add(1)
		return nil
	}}, nil
}
