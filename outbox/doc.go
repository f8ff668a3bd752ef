// Package outbox publishes events if and only if the database transaction
// that wrote them commits: the transactional outbox, with a relay that ships
// committed events to any [consumer.Publisher] with no gap and no loss.
//
// # The guarantee
//
// A service writes its row and the events that describe it in one
// transaction (Writer.Add in package [github.com/ferrymq/ferry/outbox/pgoutbox]
// or [github.com/ferrymq/ferry/outbox/sqliteoutbox]). Rolled back, neither
// exists; committed, both do, and a [Relay] publishes each event at least
// once, after the commit:
//
//   - An event is deleted from the outbox only after the Publisher returned
//     nil for it, that is, after the broker holds it durably. A relay that
//     dies between the publish and the delete leaves the event in place, and
//     it is published again. Nothing is lost; duplicates are possible.
//   - Every published message carries the event's id in the [EventIDHeader]
//     header ("ferry-event-id", the header the idempotency middleware reads
//     by default) and in [consumer.Message].ID, so the consumer handles a
//     republished event once.
//   - Events of one key are published in the order their transactions
//     committed, by whichever relays run. Events with an empty key are
//     ordered with nothing.
//   - Events round-trip byte for byte: ids, destinations, keys, header names
//     and values may hold any bytes (NUL and invalid UTF-8 included) and are
//     stored as bytes, so the Publisher gets exactly what Add was given.
//   - An event the Publisher refuses for good (a [consumer.Permanent] error,
//     such as a message too large for SQS) is moved to the failed-events
//     table with the reason, and the relay carries on. Any other failure
//     leaves the events in place and is retried with exponential backoff;
//     each delay is drawn from the upper half of its range, so a relay never
//     spins on a broker that is down.
//   - An event without a Destination, larger than the writer's size limit
//     ([WriterMaxEventSize]) or with an [EventIDHeader] header of its own is
//     refused by Add with an [*EventError] naming it and the field, before
//     anything is sent to the database: the caller's transaction stays
//     usable, to roll back or to carry on without the event.
//
// # Order without gaps
//
// Events get an id from a sequence when they are inserted, but transactions
// commit in their own order: two transactions writing the same key could
// commit in the opposite order of their ids, and a relay that remembered "I
// published up to id N" would skip the late committer for good (the classic
// outbox gap). Two things close it:
//
//   - Writers of one key take turns. On PostgreSQL, Add takes a
//     transaction-scoped advisory lock on the key's hash (or, for an Add of
//     more than 1,000 keys, the outbox's write lock), so a second transaction
//     writing the key waits until the first commits or rolls back and only
//     then draws its ids; per key, id order is commit order. SQLite runs one
//     write transaction at a time, which gives the same for free.
//   - The relay keeps no high-water mark. Published events are deleted, and
//     every read takes the lowest remaining ids of the relay's lanes. A row
//     that commits late is simply among them at the next read. Rows of other
//     keys may overtake it, which is fine; rows of its own key cannot,
//     because they did not exist before it committed.
//
// # Several relays
//
// Events are spread over [Lanes] (64) lanes by the hash of their key. Relays
// lease lanes in a table (ferry_outbox_lanes: lane, owner, expires_at) and
// only publish events of lanes they hold, so a key is published by one relay
// at a time. Each relay renews its leases every third of the lease TTL
// ([WithLeaseTTL], default 5s), records itself as live in
// ferry_outbox_relays, and takes its fair share: Lanes divided by the number
// of live relays, rounded up. A relay above its share gives lanes back; one
// below claims free or expired lanes (FOR UPDATE SKIP LOCKED on PostgreSQL,
// so relays never wait on each other). A relay that stops gives its lanes
// back at once; one that dies loses them when its lease expires, and the
// others take them at their next renewal: within the TTL plus a third of it.
//
// A relay publishes only while its lease has a tenth of the TTL left by its
// own clock, counted from before the renewal was sent, so it has stopped
// before the database (whose clock decides the expiry on PostgreSQL) hands
// the lane to another. A publish call gets the publish timeout
// ([WithPublishTimeout], default half the TTL, at most four fifths of it):
// the relay renews its lease before a call when less than that is left, and
// ends the call at the timeout. Leases in a table were chosen over session
// advisory locks because a session lock lives as long as the server thinks
// the connection does, which after a network failure can be minutes; a
// lease expires when it says.
//
// # Waking up
//
// On PostgreSQL, Add queues a NOTIFY on the channel ferry_outbox, delivered
// at commit; the relay LISTENs on a connection of its own and reads at once,
// and polls ([WithPollInterval], default 1s) as a fallback for lost
// connections and missed notifications. On SQLite, Add wakes relays in the
// same process, which read again over the next 100ms while the transaction
// commits; relays in other processes poll.
//
// # Events held until a time
//
// An event with a NotBefore ahead ([Event].NotBefore) stays in the outbox
// until then, on any broker and however far ahead: a reminder next week, a
// retry tomorrow, a message for Kafka, which cannot delay one. The relay
// publishes it at its first read after the time, so within the poll
// interval when nothing else wakes it; nothing polls faster for it. The
// message it publishes carries no NotBefore.
//
// A key's events keep their order. An event written behind a held event of
// its key (in the same Add or in a later transaction) is held at least as
// long: its NotBefore becomes the later of the two. Writers of a key take
// turns (see above), so the held event they wait behind is always seen.
// Events with an empty key are held by their own NotBefore only.
//
// A relay keeps the order also where a writer cannot: a transaction under
// REPEATABLE READ or SERIALIZABLE whose snapshot predates a held event of
// its key writes its event due at once, and the relay holds it back behind
// the held one all the same.
//
// Upgrading: migration 2 must run, and every relay and writer must run a
// release that knows NotBefore, before any event sets it. A relay of an
// earlier release publishes held events at once, and a writer of one does
// not hold an event behind its key's held event.
//
// Held events cost the relay nothing to read past: a read takes the events
// to publish at once and the held events that are due, each through an
// index of its own (migration 2 adds them). [Backlog] counts held events in
// Events and in Scheduled, and OldestAge is how long the longest-waiting
// event has been due (since it was written, or since its NotBefore), so an
// alert on the age fires for an event whose time passed unpublished and not
// for one scheduled ahead.
//
// # Observing
//
// [Relay.Stats] counts events published, publish calls and failures, events
// moved to the failed table and database errors; [Relay.Backlog] (or
// Store.Backlog) reports the events waiting, the age of the oldest and the
// size of the failed table, counting up to [BacklogCountLimit] so that its
// cost does not grow with the backlog. While it runs ([Relay.Run]), a relay
// reports the same as OpenTelemetry metrics ([MetricPublished],
// [MetricPublishFailures], [MetricFailed], [MetricBacklog],
// [MetricOldestAge], [MetricScheduled], [MetricLanes]; see
// [WithMeterProvider]). Alert on the
// age of the oldest event: a backlog that grows without errors is the silent
// failure.
//
// # Packages
//
// This package holds what does not depend on a database: [Event], the
// [Relay] and its options ([Option]), the writers' options ([WriterOption]),
// and the [Store] interface a relay reads through. Each database lives in a
// package of its own, so that a service pulls in only the driver it uses:
// [github.com/ferrymq/ferry/outbox/pgoutbox] (pgx/v5, and writing through
// database/sql with any PostgreSQL driver) and
// [github.com/ferrymq/ferry/outbox/sqliteoutbox] (modernc.org/sqlite, pure
// Go, the embedded default for the demo and small services). Each has the
// schema as SQL migration files (Migrations), a Migrate function that
// applies them, a Writer (NewWriter) and a Store (NewStore).
package outbox
