package sqlitestore

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/idempotency/internal/inboxcount"
	"github.com/ferrymq/ferry/idempotency/internal/keytable"
)

// TxHandler handles a message inside the inbox's transaction (NewInbox): its
// writes through tx commit together with the message's key, or not at all.
// It must not commit or roll back tx.
type TxHandler func(ctx context.Context, tx *sql.Tx, m *consumer.Message) error

// NewInbox returns a Handler that runs h once per key, in a transaction that
// also records the key: see the package documentation. namespace is the
// consumer's name, as for idempotency.New. WithTable, WithRetention and
// WithKey apply.
//
// The key's insert is prepared here, so Inbox fails if the table does not
// exist; the statement lives as long as db.
//
// A handler error rolls back and is returned unchanged; a duplicate is
// acknowledged (nil) without calling h; a database error is returned wrapped,
// and h is not called (permanent when no retry can fix it). A message without
// a key is a permanent error wrapping idempotency.ErrNoKey.
func NewInbox(db *sql.DB, namespace string, h TxHandler, opts ...Option) (consumer.Handler, error) {
	if db == nil {
		return nil, consumer.ConfigErrorf("DB", "must not be nil")
	}
	if h == nil {
		return nil, consumer.ConfigErrorf("Handler", "must not be nil")
	}
	if namespace == "" {
		return nil, consumer.ConfigErrorf("Namespace", "must not be empty")
	}
	if strings.Contains(namespace, ":") {
		return nil, consumer.ConfigErrorf("Namespace", "must not contain ':', got %q", namespace)
	}
	c, err := buildConfig(opts)
	if err != nil {
		return nil, err
	}
	prefix := idempotency.Key(namespace, "")
	retention := c.Retention.Milliseconds()
	// ?1 key, ?2 now, ?3 retention end. A key whose retention ended (not yet
	// cleaned up) is taken over; a live one inserts nothing.
	insertSQL := `INSERT INTO ` + c.Table + ` (key_hash, token, done, expires_at) VALUES (?1, '', 1, ?3)
ON CONFLICT (key_hash) DO UPDATE SET token = '', done = 1, expires_at = excluded.expires_at
WHERE expires_at <= ?2`
	insert, err := db.PrepareContext(context.Background(), insertSQL)
	if err != nil {
		return nil, fmt.Errorf("sqlitestore: inbox: prepare (has Migrate created table %s?): %w", c.Table, err)
	}
	counts := &inboxcount.Counts{}
	return &inboxcount.Handler{Counts: counts, Fn: func(ctx context.Context, m *consumer.Message) error {
		k, err := c.Key(m)
		if err != nil {
			counts.NoKey.Add(1)
			return consumer.Permanent(fmt.Errorf("%w: %w", idempotency.ErrNoKey, err))
		}
		if k == "" {
			counts.NoKey.Add(1)
			return consumer.Permanent(fmt.Errorf("%w (message %q from %q)", idempotency.ErrNoKey, m.ID, m.Source))
		}
		key := prefix + k
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return counts.StoreErr(storeErr, "inbox: begin", err)
		}
		defer func() { _ = tx.Rollback() }() // a no-op after Commit
		now := time.Now().UnixMilli()
		res, err := tx.StmtContext(ctx, insert).ExecContext(ctx, keytable.Hash(key), now, now+retention)
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
