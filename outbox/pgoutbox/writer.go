package pgoutbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/ferrymq/ferry/outbox"
	"github.com/ferrymq/ferry/outbox/internal/row"
)

// Channel is the LISTEN/NOTIFY channel a commit that wrote events notifies.
const Channel = "ferry_outbox"

// lockNamespace is the first key of the transaction-scoped advisory locks
// that serialise writers of one key (the second key is the key's hash).
const lockNamespace = 0x46455259 // "FERY"

// maxRowsPerInsert keeps one INSERT under PostgreSQL's 65535 parameters.
const maxRowsPerInsert = 1000

// Writer adds events to the outbox inside the caller's transaction. It is
// safe for concurrent use and holds no connection.
type Writer struct {
	cfg row.Config
}

// NewWriter returns a Writer. It fails with a *consumer.ConfigError naming
// the field when an option is invalid.
func NewWriter(opts ...outbox.WriterOption) (*Writer, error) {
	cfg, err := row.Apply(opts)
	if err != nil {
		return nil, err
	}
	return &Writer{cfg: cfg}, nil
}

// Add writes events in tx, a pgx transaction: they are published once tx
// commits, and never if it rolls back. An invalid event fails the whole call
// with an *outbox.EventError before anything is written.
//
// Add takes a transaction-scoped advisory lock per key, so that two
// transactions writing events of one key commit one after the other; a
// transaction that writes several keys should write them in one Add call, or
// always in the same order, to stay clear of deadlocks with others.
func (w *Writer) Add(ctx context.Context, tx pgx.Tx, events ...outbox.Event) error {
	if tx == nil {
		return errors.New("outbox/pgoutbox: Add: nil transaction")
	}
	return w.add(ctx, func(ctx context.Context, q string, args ...any) error {
		_, err := tx.Exec(ctx, q, args...)
		return err
	}, events)
}

// AddSQL is Add for a database/sql transaction over any PostgreSQL driver
// (pgx's stdlib, lib/pq).
func (w *Writer) AddSQL(ctx context.Context, tx *sql.Tx, events ...outbox.Event) error {
	if tx == nil {
		return errors.New("outbox/pgoutbox: AddSQL: nil transaction")
	}
	return w.add(ctx, func(ctx context.Context, q string, args ...any) error {
		_, err := tx.ExecContext(ctx, q, args...)
		return err
	}, events)
}

func (w *Writer) add(ctx context.Context, exec execer, events []outbox.Event) error {
	if len(events) == 0 {
		return nil
	}
	rows, err := prepare(w.cfg, events)
	if err != nil {
		return err
	}
	if q, args := lockAndNotify(rows, w.cfg.Notify); q != "" {
		if err := exec(ctx, q, args...); err != nil {
			return fmt.Errorf("outbox/pgoutbox: lock keys: %w", err)
		}
	}
	for len(rows) > 0 {
		n := min(len(rows), maxRowsPerInsert)
		q, args := insert(rows[:n])
		if err := exec(ctx, q, args...); err != nil {
			return fmt.Errorf("outbox/pgoutbox: insert %d events: %w", n, err)
		}
		rows = rows[n:]
	}
	return nil
}

func prepare(cfg row.Config, events []outbox.Event) ([]row.Row, error) {
	in := make([]row.Event, len(events))
	for i, e := range events {
		in[i] = row.Event(e)
	}
	return row.Prepare(cfg, in, func(i int, id, field, reason string) error {
		return &outbox.EventError{Index: i, ID: id, Field: field, Reason: reason}
	})
}

// lockAndNotify builds the statement that takes the per-key locks in hash
// order and queues the commit notification.
func lockAndNotify(rows []row.Row, notify bool) (string, []any) {
	hashes := row.KeyHashes(rows)
	switch {
	case len(hashes) == 0 && !notify:
		return "", nil
	case len(hashes) == 0:
		return `SELECT pg_notify('` + Channel + `', '')`, nil
	}
	var b strings.Builder
	b.WriteString(`SELECT pg_advisory_xact_lock(` + strconv.Itoa(lockNamespace) + `, v)`)
	if notify {
		b.WriteString(`, pg_notify('` + Channel + `', '')`)
	}
	b.WriteString(` FROM (VALUES `)
	args := make([]any, len(hashes))
	for i, h := range hashes {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(`($` + strconv.Itoa(i+1) + `::int4)`)
		args[i] = h
	}
	b.WriteString(`) AS k(v)`)
	return b.String(), args
}

func insert(rows []row.Row) (string, []any) {
	var b strings.Builder
	b.WriteString(`INSERT INTO ferry_outbox (event_id, lane, destination, key, body, headers) VALUES `)
	args := make([]any, 0, 6*len(rows))
	for i, r := range rows {
		if i > 0 {
			b.WriteByte(',')
		}
		n := 6 * i
		fmt.Fprintf(&b, "($%d::bytea,$%d::int2,$%d::bytea,$%d::bytea,$%d::bytea,$%d::bytea)", n+1, n+2, n+3, n+4, n+5, n+6)
		var hdr any // NULL without headers
		if r.Headers != nil {
			hdr = r.Headers
		}
		args = append(args, r.EventID, int32(r.Lane), r.Destination, r.Key, r.Body, hdr)
	}
	return b.String(), args
}
