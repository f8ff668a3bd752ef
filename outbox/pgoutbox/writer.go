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

// One INSERT takes at most maxRowsPerInsert events, under PostgreSQL's 65535
// parameters, and at most maxBytesPerInsert bytes of them (unless one event
// is larger), well under its 1 GB limit on one message.
const (
	maxRowsPerInsert  = 1000
	maxBytesPerInsert = 32 << 20
)

// Writer adds events to the outbox inside the caller's transaction. It is
// safe for concurrent use and holds no connection.
type Writer struct {
	cfg row.Config
}

// NewWriter returns a Writer configured by opts ([outbox.WriterMaxEventSize],
// [outbox.WriterNotify]). It fails with a *consumer.ConfigError naming the
// field when an option is invalid.
func NewWriter(opts ...outbox.WriterOption) (*Writer, error) {
	cfg, err := row.Apply(opts)
	if err != nil {
		return nil, err
	}
	return &Writer{cfg: cfg}, nil
}

// Add writes events in tx, a pgx transaction: they are published once tx
// commits, and never if it rolls back. An invalid event fails the whole call
// with an *outbox.EventError before anything is sent to the database, so tx
// stays usable. Any number of events fits in one call.
//
// Add takes transaction-scoped advisory locks, so that two transactions
// writing events of one key commit one after the other: up to 1,000 distinct
// keys, a lock per key (and the outbox's write lock, shared); above that, the
// outbox's write lock alone, exclusive, which waits for the transactions
// writing events now and holds every other writer back until tx ends. Every
// Add takes its locks in one order, so single Add calls never deadlock; a
// transaction that writes several keys should write them in one Add call (or
// always in the same order), and a large batch in an Add of its own.
func (w *Writer) Add(ctx context.Context, tx pgx.Tx, events ...outbox.Event) error {
	if tx == nil {
		return errors.New("outbox/pgoutbox: Add: nil transaction")
	}
	return w.add(ctx, func(ctx context.Context, q string, args ...any) error {
		_, err := tx.Exec(ctx, q, args...)
		return err
	}, events)
}

// AddSQL is [Writer.Add] for a database/sql transaction over any PostgreSQL driver
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
	rows, err := prepare(ctx, w.cfg, events)
	if err != nil {
		return err
	}
	if q, args := lockAndNotify(rows, w.cfg.Notify); q != "" {
		if err := exec(ctx, q, args...); err != nil {
			return fmt.Errorf("outbox/pgoutbox: lock keys: %w", err)
		}
	}
	for _, c := range row.Chunks(rows, maxRowsPerInsert, maxBytesPerInsert) {
		q, args := insert(c)
		if err := exec(ctx, q, args...); err != nil {
			return fmt.Errorf("outbox/pgoutbox: insert %d events: %w", len(c), err)
		}
	}
	return nil
}

func prepare(ctx context.Context, cfg row.Config, events []outbox.Event) ([]row.Row, error) {
	in := make([]row.Event, len(events))
	for i, e := range events {
		in[i] = row.Event(e)
	}
	return row.Prepare(ctx, cfg, in, func(i int, id, field, reason string) error {
		return &outbox.EventError{Index: i, ID: id, Field: field, Reason: reason}
	})
}

// maxKeyLocks is the most keys one Add locks one by one. An Add of more
// keys takes the outbox's write lock instead, so that no Add needs more
// locks than PostgreSQL's lock table holds.
const maxKeyLocks = 1000

// writeLock is the advisory lock that writers of the outbox table (the one
// the search_path resolves ferry_outbox to) take, shared by an Add that locks
// its keys one by one, exclusive by an Add of more than maxKeyLocks keys.
const writeLock = `(%d, 'ferry_outbox'::regclass::oid::int4)`

var (
	writeLockShared    = `pg_advisory_xact_lock_shared` + fmt.Sprintf(writeLock, lockNamespace+2)
	writeLockExclusive = `pg_advisory_xact_lock` + fmt.Sprintf(writeLock, lockNamespace+2)
	notifySQL          = `pg_notify('` + Channel + `', '')`
)

// lockAndNotify builds the statement that takes the locks of an Add and
// queues the commit notification. Up to maxKeyLocks keys, it takes the
// write lock shared and then a lock per key in hash order; above, the write
// lock exclusive, which waits for every other writer and keeps them waiting
// until the transaction ends. Either way, two transactions writing one key
// take turns, and two single Add calls never deadlock: every Add takes its
// locks in one global order (the write lock, then keys by hash). The keys
// travel as one text parameter, which any driver sends.
func lockAndNotify(rows []row.Row, notify bool) (string, []any) {
	hashes := row.KeyHashes(rows)
	n := ""
	if notify {
		n = ", " + notifySQL
	}
	switch {
	case len(hashes) == 0 && !notify:
		return "", nil
	case len(hashes) == 0:
		return `SELECT ` + notifySQL, nil
	case len(hashes) > maxKeyLocks:
		return `SELECT ` + writeLockExclusive + n, nil
	}
	var b strings.Builder
	for i, h := range hashes {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(int(h)))
	}
	return `WITH w AS MATERIALIZED (SELECT ` + writeLockShared + n + `)
		SELECT count(pg_advisory_xact_lock(` + strconv.Itoa(lockNamespace) + `, k))
		FROM w, unnest(string_to_array($1::text, ',')::int4[]) AS k`, []any{b.String()}
}

// insert builds the INSERT of rows, in their order (the ids a key's events
// draw are their order). An event of a key that has events still waiting
// for their not_before waits at least as long as the latest of them: the
// caller holds the key's lock, so no other writer adds one meanwhile. The
// look-up is a probe of ferry_outbox_scheduled_key an event, which holds
// only held events: about 7% of an Add of 100 events (BenchmarkWriterAdd);
// gating it on any event being held, or a second statement, cost more.
func insert(rows []row.Row) (string, []any) {
	var b strings.Builder
	b.WriteString(`INSERT INTO ferry_outbox (event_id, lane, destination, key, body, headers, not_before)
		SELECT v.e, v.l, v.d, v.k, v.b, v.h, CASE WHEN v.k = ''::bytea THEN v.nb ELSE greatest(v.nb,
			(SELECT max(o.not_before) FROM ferry_outbox o WHERE o.lane = v.l AND o.key = v.k AND o.not_before IS NOT NULL)) END
		FROM (VALUES `)
	args := make([]any, 0, 7*len(rows))
	for i, r := range rows {
		if i > 0 {
			b.WriteByte(',')
		}
		n := 7 * i
		fmt.Fprintf(&b, "(%d,$%d::bytea,$%d::int2,$%d::bytea,$%d::bytea,$%d::bytea,$%d::bytea,$%d::timestamptz)", i, n+1, n+2, n+3, n+4, n+5, n+6, n+7)
		var hdr any // NULL without headers
		if r.Headers != nil {
			hdr = r.Headers
		}
		var nb any // NULL: at once
		if !r.NotBefore.IsZero() {
			nb = r.NotBefore
		}
		args = append(args, r.EventID, int32(r.Lane), r.Destination, r.Key, r.Body, hdr, nb)
	}
	b.WriteString(`) AS v(i, e, l, d, k, b, h, nb) ORDER BY v.i`)
	return b.String(), args
}
