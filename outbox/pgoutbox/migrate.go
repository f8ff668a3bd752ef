package pgoutbox

import (
	"context"
	"database/sql"
	"embed"
	"fmt"
	"io/fs"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations holds the schema as plain SQL files, migrations/NNNN_name.sql,
// applied in that order, for teams that run their own migration tool.
// [Migrate] and [MigrateSQL] apply them and record each version in
// ferry_outbox_migrations.
var Migrations fs.FS = migrationFiles

type migration struct {
	version int
	name    string
	sql     string
}

func migrations() ([]migration, error) {
	files, err := fs.Glob(Migrations, "migrations/*.sql")
	if err != nil {
		return nil, err
	}
	var out []migration
	for _, f := range files {
		base := strings.TrimPrefix(f, "migrations/")
		v, err := strconv.Atoi(strings.SplitN(base, "_", 2)[0])
		if err != nil {
			return nil, fmt.Errorf("outbox/pgoutbox: migration %s: no version number: %w", base, err)
		}
		b, err := fs.ReadFile(Migrations, f)
		if err != nil {
			return nil, err
		}
		out = append(out, migration{v, base, string(b)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].version < out[j].version })
	return out, nil
}

const migrationsTable = `CREATE TABLE IF NOT EXISTS ferry_outbox_migrations (
	version    integer     PRIMARY KEY,
	name       text        NOT NULL,
	applied_at timestamptz NOT NULL DEFAULT now()
)`

// Beginner starts a pgx transaction: a *pgxpool.Pool, a *pgx.Conn.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// execer is what migrate needs from pgx.Tx or *sql.Tx.
type execer func(ctx context.Context, sql string, args ...any) error

// Migrate creates or upgrades the outbox tables in the current schema (the
// first of the connection's search_path) in one transaction, through db: the
// pool a [Store] is given, or any other [Beginner]. Replicas may call it at
// once at start-up: an advisory lock makes them take turns.
func Migrate(ctx context.Context, db Beginner) error {
	tx, err := db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("outbox/pgoutbox: migrate: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	exec := func(ctx context.Context, sql string, args ...any) error {
		_, err := tx.Exec(ctx, sql, args...)
		return err
	}
	var applied []int
	rows, err := migrateStart(ctx, exec, func(ctx context.Context) ([]int, error) {
		r, err := tx.Query(ctx, `SELECT version FROM ferry_outbox_migrations`)
		if err != nil {
			return nil, err
		}
		return pgx.CollectRows(r, pgx.RowTo[int])
	})
	if err != nil {
		return err
	}
	applied = rows
	if err := migrateApply(ctx, exec, applied); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("outbox/pgoutbox: migrate: commit: %w", err)
	}
	return nil
}

// MigrateSQL is [Migrate] for database/sql, over any PostgreSQL driver.
func MigrateSQL(ctx context.Context, db *sql.DB) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("outbox/pgoutbox: migrate: %w", err)
	}
	defer tx.Rollback()
	exec := func(ctx context.Context, sql string, args ...any) error {
		_, err := tx.ExecContext(ctx, sql, args...)
		return err
	}
	applied, err := migrateStart(ctx, exec, func(ctx context.Context) ([]int, error) {
		r, err := tx.QueryContext(ctx, `SELECT version FROM ferry_outbox_migrations`)
		if err != nil {
			return nil, err
		}
		defer r.Close()
		var out []int
		for r.Next() {
			var v int
			if err := r.Scan(&v); err != nil {
				return nil, err
			}
			out = append(out, v)
		}
		return out, r.Err()
	})
	if err != nil {
		return err
	}
	if err := migrateApply(ctx, exec, applied); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("outbox/pgoutbox: migrate: commit: %w", err)
	}
	return nil
}

func migrateStart(ctx context.Context, exec execer, versions func(context.Context) ([]int, error)) ([]int, error) {
	if err := exec(ctx, `SELECT pg_advisory_xact_lock(`+strconv.Itoa(lockNamespace+1)+`, 0)`); err != nil {
		return nil, fmt.Errorf("outbox/pgoutbox: migrate: lock: %w", err)
	}
	if err := exec(ctx, migrationsTable); err != nil {
		return nil, fmt.Errorf("outbox/pgoutbox: migrate: %w", err)
	}
	v, err := versions(ctx)
	if err != nil {
		return nil, fmt.Errorf("outbox/pgoutbox: migrate: read versions: %w", err)
	}
	return v, nil
}

func migrateApply(ctx context.Context, exec execer, applied []int) error {
	ms, err := migrations()
	if err != nil {
		return err
	}
	done := make(map[int]bool, len(applied))
	for _, v := range applied {
		done[v] = true
	}
	for _, m := range ms {
		if done[m.version] {
			continue
		}
		if err := exec(ctx, m.sql); err != nil {
			return fmt.Errorf("outbox/pgoutbox: migration %s: %w", m.name, err)
		}
		if err := exec(ctx, `INSERT INTO ferry_outbox_migrations (version, name) VALUES ($1, $2)`, m.version, m.name); err != nil {
			return fmt.Errorf("outbox/pgoutbox: migration %s: record: %w", m.name, err)
		}
	}
	return nil
}
