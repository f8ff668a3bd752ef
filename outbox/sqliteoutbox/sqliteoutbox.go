package sqliteoutbox

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/sqlitedb"
	"github.com/ferrymq/ferry/outbox"
	"github.com/ferrymq/ferry/outbox/internal/row"
)

// Open opens the SQLite database file at path with modernc.org/sqlite and the
// settings the outbox relies on: WAL journal (the relay reads while writers
// write), a 10s busy timeout, and write transactions that take the write lock
// when they begin (BEGIN IMMEDIATE), so that concurrent writers wait their
// turn instead of failing. An in-memory database cannot be shared by writer
// and relay connections; use a file.
func Open(path string) (*sql.DB, error) {
	db, err := sqlitedb.Open(path)
	if err != nil {
		return nil, fmt.Errorf("outbox/sqliteoutbox: %w", err)
	}
	return db, nil
}

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations holds the schema as plain SQL files, migrations/NNNN_name.sql,
// applied in that order, for teams that run their own migration tool.
// [Migrate] applies them and records each version in ferry_outbox_migrations.
var Migrations fs.FS = migrationFiles

// Migrate creates or upgrades the outbox tables in one transaction, through
// db: the database a [Store] is given.
func Migrate(ctx context.Context, db *sql.DB) error {
	files, err := fs.Glob(Migrations, "migrations/*.sql")
	if err != nil {
		return err
	}
	sort.Strings(files)
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("outbox/sqliteoutbox: migrate: %w", err)
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS ferry_outbox_migrations (
		version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at INTEGER NOT NULL)`); err != nil {
		return fmt.Errorf("outbox/sqliteoutbox: migrate: %w", err)
	}
	for _, f := range files {
		name := strings.TrimPrefix(f, "migrations/")
		v, err := strconv.Atoi(strings.SplitN(name, "_", 2)[0])
		if err != nil {
			return fmt.Errorf("outbox/sqliteoutbox: migration %s: no version number: %w", name, err)
		}
		var n int
		if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM ferry_outbox_migrations WHERE version = ?`, v).Scan(&n); err != nil {
			return fmt.Errorf("outbox/sqliteoutbox: migrate: %w", err)
		}
		if n > 0 {
			continue
		}
		b, err := fs.ReadFile(Migrations, f)
		if err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, string(b)); err != nil {
			return fmt.Errorf("outbox/sqliteoutbox: migration %s: %w", name, err)
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO ferry_outbox_migrations (version, name, applied_at) VALUES (?, ?, ?)`,
			v, name, time.Now().UnixMicro()); err != nil {
			return fmt.Errorf("outbox/sqliteoutbox: migration %s: record: %w", name, err)
		}
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("outbox/sqliteoutbox: migrate: commit: %w", err)
	}
	return nil
}

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

// One INSERT takes at most maxRowsPerInsert events (7 parameters each, under
// SQLite's limit) and at most maxBytesPerInsert bytes of them, unless one
// event is larger.
const (
	maxRowsPerInsert  = 100
	maxBytesPerInsert = 32 << 20
)

// Add writes events in tx: they are published once tx commits, and never if
// it rolls back. An invalid event fails the whole call with an
// *outbox.EventError before anything is written. SQLite runs one write
// transaction at a time, so events of one key are numbered in commit order
// without any lock of ours.
func (w *Writer) Add(ctx context.Context, tx *sql.Tx, events ...outbox.Event) error {
	if tx == nil {
		return errors.New("outbox/sqliteoutbox: Add: nil transaction")
	}
	if len(events) == 0 {
		return nil
	}
	in := make([]row.Event, len(events))
	for i, e := range events {
		in[i] = row.Event(e)
	}
	rows, err := row.Prepare(ctx, w.cfg, in, func(i int, id, field, reason string) error {
		return &outbox.EventError{Index: i, ID: id, Field: field, Reason: reason}
	})
	if err != nil {
		return err
	}
	now := time.Now().UnixMicro()
	var first int64 // the id of the call's first event
	for _, c := range row.Chunks(rows, maxRowsPerInsert, maxBytesPerInsert) {
		n := len(c)
		var b strings.Builder
		b.WriteString(`INSERT INTO ferry_outbox (event_id, lane, destination, key, body, headers, created_at, not_before) VALUES `)
		args := make([]any, 0, 8*n)
		for i, r := range c {
			if i > 0 {
				b.WriteByte(',')
			}
			b.WriteString(`(?,?,?,?,?,?,?,?)`)
			var hdr any // NULL without headers
			if r.Headers != nil {
				hdr = r.Headers
			}
			var nb any // NULL: at once
			if !r.NotBefore.IsZero() {
				nb = r.NotBefore.UnixMicro()
			}
			args = append(args, r.EventID, r.Lane, r.Destination, r.Key, r.Body, hdr, now, nb)
		}
		res, err := tx.ExecContext(ctx, b.String(), args...)
		if err != nil {
			return fmt.Errorf("outbox/sqliteoutbox: insert %d events: %w", n, err)
		}
		if first == 0 {
			// The transaction writes alone, and AUTOINCREMENT numbers a
			// statement's rows one after the other.
			last, err := res.LastInsertId()
			if err != nil {
				return fmt.Errorf("outbox/sqliteoutbox: insert %d events: %w", n, err)
			}
			first = last - int64(n) + 1
		}
	}
	// A key's events fall due in their order: an event written behind a
	// held event of its key waits at least as long. One statement for the
	// call, which does nothing when no event is held (one probe of
	// ferry_outbox_scheduled), else probes ferry_outbox_scheduled_key once
	// an event: a subquery per row of the INSERT made SQLite parse and
	// plan one per event, three times the cost of the insert.
	if _, err := tx.ExecContext(ctx, `UPDATE ferry_outbox AS n SET not_before = (
			SELECT max(o.not_before) FROM ferry_outbox o
			WHERE o.lane = n.lane AND o.key = n.key AND o.not_before IS NOT NULL AND o.id < n.id)
		WHERE EXISTS (SELECT 1 FROM ferry_outbox WHERE not_before IS NOT NULL) AND n.id >= ? AND n.key <> x'' AND coalesce(n.not_before, 0) < (
			SELECT max(o.not_before) FROM ferry_outbox o
			WHERE o.lane = n.lane AND o.key = n.key AND o.not_before IS NOT NULL AND o.id < n.id)`, first); err != nil {
		return fmt.Errorf("outbox/sqliteoutbox: hold events behind their key's: %w", err)
	}
	if w.cfg.Notify {
		wakeAll()
	}
	return nil
}

// The in-process wake: Add signals every Store's Listen in the process.
var (
	subsMu sync.Mutex
	subs   = map[chan struct{}]struct{}{}
)

func wakeAll() {
	subsMu.Lock()
	defer subsMu.Unlock()
	for c := range subs {
		select {
		case c <- struct{}{}:
		default:
		}
	}
}

// Store is the relay's access to the outbox tables of a SQLite database. It
// implements outbox.Store and outbox.Listener (the in-process wake).
type Store struct {
	db *sql.DB
}

var (
	_ outbox.Store    = (*Store)(nil)
	_ outbox.Listener = (*Store)(nil)
)

// NewStore returns a Store over db (best opened with Open). Apply Migrate
// first. It fails with a *consumer.ConfigError when db is nil.
func NewStore(db *sql.DB) (*Store, error) {
	if db == nil {
		return nil, &consumer.ConfigError{Field: "DB", Reason: "must not be nil"}
	}
	return &Store{db: db}, nil
}

// followUps are the extra wakes after an Add: Add runs before its
// transaction commits, so the relay looks again a little later.
var followUps = []time.Duration{time.Millisecond, 4 * time.Millisecond, 20 * time.Millisecond, 100 * time.Millisecond}

// Listen implements outbox.Listener with the in-process wake: a Writer's Add
// in this process wakes the relay, which then looks again over the next
// 100ms while the writer's transaction commits. Writers in other processes
// are found by polling.
func (s *Store) Listen(ctx context.Context, wake func()) error {
	c := make(chan struct{}, 1)
	subsMu.Lock()
	subs[c] = struct{}{}
	subsMu.Unlock()
	defer func() {
		subsMu.Lock()
		delete(subs, c)
		subsMu.Unlock()
	}()
	wake()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-c:
		}
		wake()
		// Look again while the transaction commits; a new Add restarts
		// the series with a wake of its own.
		for i := 0; i < len(followUps); i++ {
			t := time.NewTimer(followUps[i])
			select {
			case <-ctx.Done():
				t.Stop()
				return nil
			case <-c:
				t.Stop()
				i = -1
			case <-t.C:
			}
			wake()
		}
	}
}

func placeholders(n int) string {
	return strings.TrimSuffix(strings.Repeat("?,", n), ",")
}

// Lease implements outbox.Store, with this host's clock for expiries.
func (s *Store) Lease(ctx context.Context, owner string, ttl time.Duration) ([]int, error) {
	held, err := s.lease(ctx, owner, ttl)
	if err != nil {
		return nil, fmt.Errorf("outbox/sqliteoutbox: lease lanes: %w", err)
	}
	return held, nil
}

func (s *Store) lease(ctx context.Context, owner string, ttl time.Duration) ([]int, error) {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	defer tx.Rollback()
	now := time.Now().UnixMilli()
	exp := now + ttl.Milliseconds()
	if _, err := tx.ExecContext(ctx, `INSERT INTO ferry_outbox_relays (owner, expires_at) VALUES (?, ?)
		ON CONFLICT (owner) DO UPDATE SET expires_at = excluded.expires_at`, owner, exp); err != nil {
		return nil, err
	}
	if _, err := tx.ExecContext(ctx, `DELETE FROM ferry_outbox_relays WHERE expires_at < ?`, now-60_000); err != nil {
		return nil, err
	}
	var live int
	if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM ferry_outbox_relays WHERE expires_at > ?`, now).Scan(&live); err != nil {
		return nil, err
	}
	held, err := lanes(tx.QueryContext(ctx, `UPDATE ferry_outbox_lanes SET expires_at = ? WHERE owner = ? RETURNING lane`, exp, owner))
	if err != nil {
		return nil, err
	}
	share := (outbox.Lanes + max(live, 1) - 1) / max(live, 1)
	switch {
	case len(held) > share:
		give := held[share:]
		args := []any{owner}
		for _, l := range give {
			args = append(args, l)
		}
		if _, err := tx.ExecContext(ctx, `UPDATE ferry_outbox_lanes SET owner = NULL, expires_at = NULL
			WHERE owner = ? AND lane IN (`+placeholders(len(give))+`)`, args...); err != nil {
			return nil, err
		}
		held = held[:share]
	case len(held) < share:
		more, err := lanes(tx.QueryContext(ctx, `UPDATE ferry_outbox_lanes SET owner = ?, expires_at = ?
			WHERE lane IN (SELECT lane FROM ferry_outbox_lanes WHERE owner IS NULL OR expires_at <= ?
				ORDER BY lane LIMIT ?)
			RETURNING lane`, owner, exp, now, share-len(held)))
		if err != nil {
			return nil, err
		}
		held = append(held, more...)
		slices.Sort(held)
	}
	return held, tx.Commit()
}

func lanes(rows *sql.Rows, err error) ([]int, error) {
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []int
	for rows.Next() {
		var l int
		if err := rows.Scan(&l); err != nil {
			return nil, err
		}
		out = append(out, l)
	}
	slices.Sort(out)
	return out, rows.Err()
}

// Release implements outbox.Store.
func (s *Store) Release(ctx context.Context, owner string) error {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("outbox/sqliteoutbox: release lanes: %w", err)
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(ctx, `UPDATE ferry_outbox_lanes SET owner = NULL, expires_at = NULL WHERE owner = ?`, owner); err != nil {
		return fmt.Errorf("outbox/sqliteoutbox: release lanes: %w", err)
	}
	if _, err := tx.ExecContext(ctx, `DELETE FROM ferry_outbox_relays WHERE owner = ?`, owner); err != nil {
		return fmt.Errorf("outbox/sqliteoutbox: release lanes: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("outbox/sqliteoutbox: release lanes: %w", err)
	}
	return nil
}

// Fetch implements outbox.Store.
func (s *Store) Fetch(ctx context.Context, lanes []int, max int) ([]outbox.Record, error) {
	// The lowest ids among the due events of lanes: those to publish at
	// once and those whose not_before has passed, each through its own
	// index (see the PostgreSQL store's fetchSQL), the lanes as a bit set
	// (bit n for lane n; SQLite's >> keeps the sign, so lane 63 works).
	var set uint64
	for _, l := range lanes {
		set |= 1 << uint(l)
	}
	rows, err := s.db.QueryContext(ctx, `SELECT id, event_id, lane, destination, key, body, headers, created_at FROM (
		SELECT * FROM (SELECT * FROM ferry_outbox WHERE (?1 >> lane) & 1 = 1 AND not_before IS NULL ORDER BY id LIMIT ?2)
		UNION ALL
		SELECT * FROM (SELECT * FROM ferry_outbox WHERE (?1 >> lane) & 1 = 1 AND not_before IS NOT NULL AND not_before <= ?3
			ORDER BY not_before, id LIMIT ?2)
	) ORDER BY id LIMIT ?2`, int64(set), max, time.Now().UnixMicro())
	if err != nil {
		return nil, fmt.Errorf("outbox/sqliteoutbox: fetch: %w", err)
	}
	defer rows.Close()
	var out []outbox.Record
	for rows.Next() {
		var (
			r                  outbox.Record
			id, dest, key, hdr []byte
			created            int64
		)
		if err := rows.Scan(&r.Seq, &id, &r.Lane, &dest, &key, &r.Body, &hdr, &created); err != nil {
			return nil, fmt.Errorf("outbox/sqliteoutbox: fetch: %w", err)
		}
		r.ID, r.Destination, r.Key = string(id), string(dest), string(key)
		if r.Headers, err = row.DecodeHeaders(hdr); err != nil {
			return nil, fmt.Errorf("outbox/sqliteoutbox: fetch: headers of event %d: %w", r.Seq, err)
		}
		r.CreatedAt = time.UnixMicro(created)
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("outbox/sqliteoutbox: fetch: %w", err)
	}
	return out, nil
}

// Delete implements outbox.Store.
func (s *Store) Delete(ctx context.Context, seqs []int64) error {
	for len(seqs) > 0 {
		n := min(len(seqs), 500)
		args := make([]any, n)
		for i, s := range seqs[:n] {
			args[i] = s
		}
		if _, err := s.db.ExecContext(ctx, `DELETE FROM ferry_outbox WHERE id IN (`+placeholders(n)+`)`, args...); err != nil {
			return fmt.Errorf("outbox/sqliteoutbox: delete: %w", err)
		}
		seqs = seqs[n:]
	}
	return nil
}

// Fail implements outbox.Store.
func (s *Store) Fail(ctx context.Context, seq int64, reason string) error {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("outbox/sqliteoutbox: fail event %d: %w", seq, err)
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(ctx, `INSERT OR IGNORE INTO ferry_outbox_failed
		(id, event_id, lane, destination, key, body, headers, created_at, failed_at, reason)
		SELECT id, event_id, lane, destination, key, body, headers, created_at, ?, ? FROM ferry_outbox WHERE id = ?`,
		time.Now().UnixMicro(), reason, seq); err != nil {
		return fmt.Errorf("outbox/sqliteoutbox: fail event %d: %w", seq, err)
	}
	if _, err := tx.ExecContext(ctx, `DELETE FROM ferry_outbox WHERE id = ?`, seq); err != nil {
		return fmt.Errorf("outbox/sqliteoutbox: fail event %d: %w", seq, err)
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("outbox/sqliteoutbox: fail event %d: %w", seq, err)
	}
	return nil
}

// backlogSQL reads the backlog at a cost that does not grow with it: the
// counts stop at outbox.BacklogCountLimit rows (?1) of an index, the oldest
// event to publish at once is the first of ferry_outbox_ready, and the
// longest overdue of the held events (due by ?2, now) the first of
// ferry_outbox_scheduled.
const backlogSQL = `SELECT
	(SELECT count(*) FROM (SELECT 1 FROM ferry_outbox ORDER BY id LIMIT ?1)),
	(SELECT created_at FROM ferry_outbox WHERE not_before IS NULL ORDER BY id LIMIT 1),
	(SELECT min(not_before) FROM ferry_outbox WHERE not_before IS NOT NULL AND not_before <= ?2),
	(SELECT count(*) FROM (SELECT 1 FROM ferry_outbox_failed ORDER BY id LIMIT ?1)),
	(SELECT count(*) FROM (SELECT 1 FROM ferry_outbox WHERE not_before > ?2 ORDER BY not_before LIMIT ?1))`

// Backlog implements outbox.Store.
func (s *Store) Backlog(ctx context.Context) (outbox.Backlog, error) {
	var (
		b               outbox.Backlog
		oldest, overdue sql.NullInt64
	)
	now := time.Now()
	err := s.db.QueryRowContext(ctx, backlogSQL, outbox.BacklogCountLimit, now.UnixMicro()).
		Scan(&b.Events, &oldest, &overdue, &b.Failed, &b.Scheduled)
	if err != nil {
		return b, fmt.Errorf("outbox/sqliteoutbox: backlog: %w", err)
	}
	// The longest wait since an event fell due: its writing, or its
	// not_before.
	for _, t := range []sql.NullInt64{oldest, overdue} {
		if t.Valid {
			b.OldestAge = max(b.OldestAge, now.Sub(time.UnixMicro(t.Int64)))
		}
	}
	return b, nil
}
