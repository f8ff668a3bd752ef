package pgoutbox

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/outbox"
	"github.com/ferrymq/ferry/outbox/internal/row"
)

// Store is the relay's access to the outbox tables over a pgx pool. It
// implements outbox.Store and outbox.Listener.
type Store struct {
	pool *pgxpool.Pool
}

var (
	_ outbox.Store    = (*Store)(nil)
	_ outbox.Listener = (*Store)(nil)
)

// NewStore returns a Store over pool. The tables are those of the pool's
// search_path; apply Migrate first. It fails with a *consumer.ConfigError when
// pool is nil.
func NewStore(pool *pgxpool.Pool) (*Store, error) {
	if pool == nil {
		return nil, consumer.ConfigErrorf("Pool", "must not be nil")
	}
	return &Store{pool: pool}, nil
}

func secs(d time.Duration) float64 { return d.Seconds() }

// Lease implements outbox.Store. It runs in one transaction, using the
// database's clock for every expiry.
func (s *Store) Lease(ctx context.Context, owner string, ttl time.Duration) ([]int, error) {
	var held []int
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		held = held[:0]
		if _, err := tx.Exec(ctx, `INSERT INTO ferry_outbox_relays (owner, expires_at)
			VALUES ($1, now() + make_interval(secs => $2))
			ON CONFLICT (owner) DO UPDATE SET expires_at = excluded.expires_at`, owner, secs(ttl)); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `DELETE FROM ferry_outbox_relays WHERE expires_at < now() - interval '1 minute'`); err != nil {
			return err
		}
		var live int
		if err := tx.QueryRow(ctx, `SELECT count(*) FROM ferry_outbox_relays WHERE expires_at > now()`).Scan(&live); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, `UPDATE ferry_outbox_lanes SET expires_at = now() + make_interval(secs => $2)
			WHERE owner = $1 RETURNING lane::int`, owner, secs(ttl))
		if err != nil {
			return err
		}
		if held, err = pgx.CollectRows(rows, pgx.RowTo[int]); err != nil {
			return err
		}
		slices.Sort(held)
		share := (outbox.Lanes + max(live, 1) - 1) / max(live, 1)
		switch {
		case len(held) > share:
			give := held[share:]
			if _, err := tx.Exec(ctx, `UPDATE ferry_outbox_lanes SET owner = NULL, expires_at = NULL
				WHERE owner = $1 AND lane = ANY($2::int4[])`, owner, give); err != nil {
				return err
			}
			held = held[:share]
		case len(held) < share:
			rows, err := tx.Query(ctx, `UPDATE ferry_outbox_lanes SET owner = $1, expires_at = now() + make_interval(secs => $2)
				WHERE lane IN (SELECT lane FROM ferry_outbox_lanes
					WHERE owner IS NULL OR expires_at <= now()
					ORDER BY lane LIMIT $3 FOR UPDATE SKIP LOCKED)
				RETURNING lane::int`, owner, secs(ttl), share-len(held))
			if err != nil {
				return err
			}
			more, err := pgx.CollectRows(rows, pgx.RowTo[int])
			if err != nil {
				return err
			}
			held = append(held, more...)
			slices.Sort(held)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("outbox/pgoutbox: lease lanes: %w", err)
	}
	return held, nil
}

// Release implements outbox.Store.
func (s *Store) Release(ctx context.Context, owner string) error {
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `UPDATE ferry_outbox_lanes SET owner = NULL, expires_at = NULL WHERE owner = $1`, owner); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `DELETE FROM ferry_outbox_relays WHERE owner = $1`, owner)
		return err
	})
	if err != nil {
		return fmt.Errorf("outbox/pgoutbox: release lanes: %w", err)
	}
	return nil
}

// Fetch implements outbox.Store.
func (s *Store) Fetch(ctx context.Context, lanes []int, max int) ([]outbox.Record, error) {
	var rows pgx.Rows
	var err error
	// The limit is written into the statement (a relay reads with one batch
	// size), so that PostgreSQL plans it once: with the limit a parameter
	// it planned every read again, which cost more than the read.
	limit := strconv.Itoa(max)
	if len(lanes) == outbox.Lanes {
		rows, err = s.pool.Query(ctx, strings.ReplaceAll(fetchAllSQL, "$1", limit))
	} else {
		rows, err = s.pool.Query(ctx, strings.ReplaceAll(fetchLanesSQL, "$2", limit), lanes)
	}
	if err != nil {
		return nil, fmt.Errorf("outbox/pgoutbox: fetch: %w", err)
	}
	defer rows.Close()
	var out []outbox.Record
	for rows.Next() {
		var (
			r                  outbox.Record
			id, dest, key, hdr []byte
		)
		if err := rows.Scan(&r.Seq, &id, &r.Lane, &dest, &key, &r.Body, &hdr, &r.CreatedAt); err != nil {
			return nil, fmt.Errorf("outbox/pgoutbox: fetch: %w", err)
		}
		r.ID, r.Destination, r.Key = string(id), string(dest), string(key)
		if r.Headers, err = row.DecodeHeaders(hdr); err != nil {
			return nil, fmt.Errorf("outbox/pgoutbox: fetch: headers of event %d: %w", r.Seq, err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("outbox/pgoutbox: fetch: %w", err)
	}
	return out, nil
}

// Delete implements outbox.Store.
func (s *Store) Delete(ctx context.Context, seqs []int64) error {
	if _, err := s.pool.Exec(ctx, `DELETE FROM ferry_outbox WHERE id = ANY($1::int8[])`, seqs); err != nil {
		return fmt.Errorf("outbox/pgoutbox: delete: %w", err)
	}
	return nil
}

// Fail implements outbox.Store.
func (s *Store) Fail(ctx context.Context, seq int64, reason string) error {
	_, err := s.pool.Exec(ctx, `WITH d AS (DELETE FROM ferry_outbox WHERE id = $1 RETURNING *)
		INSERT INTO ferry_outbox_failed (id, event_id, lane, destination, key, body, headers, created_at, reason)
		SELECT id, event_id, lane, destination, key, body, headers, created_at, $2 FROM d
		ON CONFLICT (id) DO NOTHING`, seq, reason)
	if err != nil {
		return fmt.Errorf("outbox/pgoutbox: move event %d to the failed events: %w", seq, err)
	}
	return nil
}

// notBlocked holds back an event of a key that has an earlier event still
// held for later (through ferry_outbox_scheduled_key). Writers give such an
// event the held one's not_before, so this finds nothing, except where a
// writer's snapshot predates the held event's commit: a transaction under
// REPEATABLE READ or SERIALIZABLE that read before Add took its key's lock.
// The reader keeps the key's order then too.
const notBlocked = `(o.key = ''::bytea OR NOT EXISTS (SELECT 1 FROM ferry_outbox h
	WHERE h.lane = o.lane AND h.key = o.key AND h.not_before > now() AND h.id < o.id))`

// fetchAllSQL reads, for a relay that holds every lane, the lowest ids
// among the due events, at most $1 (the batch size, written into the
// statement by Fetch): the lowest ids of the events to publish
// at once, through ferry_outbox_ready_id, and the first due of the held
// events whose not_before has passed, through ferry_outbox_scheduled (so
// that events held for later cost nothing to read past). A key's events
// fall due in id order (see insert and notBlocked), so both keep every
// key's order, and so do the lowest ids of the two. Each half reads an
// index in the order it wants: with a filter on the lanes, PostgreSQL
// sorted whole lanes (24 ms a read at 60,000 events) or, misjudging the
// filter, compiled the plan (JIT, 18 ms a read).
const fetchAllSQL = `SELECT id, event_id, lane::int, destination, key, body, headers, created_at FROM (
	(SELECT * FROM ferry_outbox o WHERE o.not_before IS NULL AND ` + notBlocked + `
		ORDER BY o.id LIMIT $1)
	UNION ALL
	(SELECT * FROM ferry_outbox o WHERE o.not_before IS NOT NULL AND o.not_before <= now()
		AND ` + notBlocked + ` ORDER BY o.not_before, o.id LIMIT $1)
) e ORDER BY id LIMIT $1`

// fetchLanesSQL is fetchAllSQL for a relay that holds some lanes ($1):
// read lane by lane, up to $2 events of each (the batch size, written in), each through
// ferry_outbox_ready in id order, so that a relay reads only its own lanes
// (200,000 events waiting in another relay's lane made a read in id order
// across lanes take 21 ms). The rows of each lane are a prefix of its due
// events, so the lowest ids of them all keep every key's order (a key has
// one lane).
const fetchLanesSQL = `SELECT id, event_id, e.lane::int, destination, key, body, headers, created_at
	FROM unnest($1::int4[]) AS l(n), LATERAL (
		(SELECT * FROM ferry_outbox o WHERE o.lane = l.n AND o.not_before IS NULL AND ` + notBlocked + `
			ORDER BY o.id LIMIT $2)
		UNION ALL
		(SELECT * FROM ferry_outbox o WHERE o.lane = l.n AND o.not_before IS NOT NULL AND o.not_before <= now()
			AND ` + notBlocked + ` ORDER BY o.not_before, o.id LIMIT $2)
	) e ORDER BY id LIMIT $2`

// backlogSQL reads the backlog at a cost that does not grow with it: the
// counts stop at outbox.BacklogCountLimit rows ($1) of an index, the oldest
// event to publish at once is the first of ferry_outbox_ready_id, and the
// longest overdue of the held events the first of ferry_outbox_scheduled.
const backlogSQL = `SELECT
	(SELECT count(*) FROM (SELECT 1 FROM ferry_outbox ORDER BY id LIMIT $1) e),
	greatest(
		(SELECT extract(epoch FROM clock_timestamp() - created_at) FROM ferry_outbox
			WHERE not_before IS NULL ORDER BY id LIMIT 1),
		(SELECT extract(epoch FROM clock_timestamp() - not_before) FROM ferry_outbox
			WHERE not_before IS NOT NULL AND not_before <= now() ORDER BY not_before LIMIT 1),
		0)::float8,
	(SELECT count(*) FROM (SELECT 1 FROM ferry_outbox_failed ORDER BY id LIMIT $1) f),
	(SELECT count(*) FROM (SELECT 1 FROM ferry_outbox WHERE not_before > now() ORDER BY not_before LIMIT $1) s)`

func backlogArgs() []any { return []any{outbox.BacklogCountLimit} }

// Backlog implements outbox.Store.
func (s *Store) Backlog(ctx context.Context) (outbox.Backlog, error) {
	var (
		b   outbox.Backlog
		age float64
	)
	if err := s.pool.QueryRow(ctx, backlogSQL, backlogArgs()...).Scan(&b.Events, &age, &b.Failed, &b.Scheduled); err != nil {
		return b, fmt.Errorf("outbox/pgoutbox: backlog: %w", err)
	}
	b.OldestAge = time.Duration(age * float64(time.Second))
	return b, nil
}

// Listen implements outbox.Listener: it holds one connection of the pool
// (taken out of it for good) listening on Channel.
func (s *Store) Listen(ctx context.Context, wake func()) error {
	c, err := s.pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("outbox/pgoutbox: listen: %w", err)
	}
	conn := c.Hijack()
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, `LISTEN `+Channel); err != nil {
		return fmt.Errorf("outbox/pgoutbox: listen: %w", err)
	}
	wake()
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("outbox/pgoutbox: listen: %w", err)
		}
		wake()
	}
}
