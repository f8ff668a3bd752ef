// Package sqliteoutbox keeps the outbox in a SQLite database through
// database/sql and modernc.org/sqlite (pure Go, no cgo): the schema
// ([Migrations], applied by [Migrate]), a [Writer] that adds events in the
// caller's *sql.Tx ([Writer.Add]), and a [Store] for the [outbox.Relay]. It
// is the embedded default for the demo and small services.
//
// SQLite runs one write transaction at a time, so events of one key get
// their ids in commit order without locks of ours. [Open] sets the database
// up for that: WAL, a busy timeout, BEGIN IMMEDIATE, and a pool of one
// connection, so that writers and the relay queue fairly in the process
// rather than race for the file lock (which can starve the relay). With one
// connection, code inside a transaction must use the *sql.Tx, never the
// *sql.DB, or it waits for itself.
//
// Ids, destinations, keys, bodies and headers are stored as BLOBs, so events
// round-trip byte for byte.
//
// Relays in the process that writes are woken by Add; relays in other
// processes poll. Lane leases use this host's clock.
package sqliteoutbox
