// Package pgoutbox keeps the outbox in PostgreSQL: the schema
// ([Migrations], applied by [Migrate], or [MigrateSQL] over database/sql), a
// [Writer] that adds events in the caller's transaction (pgx.Tx through
// [Writer.Add], *sql.Tx of any PostgreSQL driver through [Writer.AddSQL]),
// and a [Store] over a pgx pool for the [outbox.Relay], which wakes on
// LISTEN/NOTIFY ([Channel]).
//
// [Writer.Add] takes a transaction-scoped advisory lock per key of the events it
// writes, pg_advisory_xact_lock(0x46455259, hash of the key), after the
// outbox's write lock in shared mode,
// pg_advisory_xact_lock_shared(0x46455259+2, oid of the ferry_outbox table).
// An Add of more than 1,000 distinct keys takes the write lock in exclusive
// mode instead of a lock per key, so that no Add runs PostgreSQL out of lock
// table space. Either way two transactions writing one key commit one after
// the other, so that ids follow commit order per key (see the outbox package
// documentation). The locks are held until the caller's transaction ends;
// keep those short.
//
// Ids, destinations, keys, bodies and headers are stored as bytea, so events
// round-trip byte for byte.
//
// The tables (ferry_outbox, ferry_outbox_failed, ferry_outbox_lanes,
// ferry_outbox_relays, ferry_outbox_migrations) are created in the first
// schema of the connection's search_path; give each outbox a schema of its
// own to run several in one database.
package pgoutbox
