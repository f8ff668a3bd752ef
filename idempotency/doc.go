// Package idempotency turns at-least-once delivery into exactly-once effects.
//
// # The guarantee
//
// Every broker Ferry speaks to delivers a message at least once: a handler
// that crashes after its work and before the ack runs again, and a publisher
// that retries publishes twice. This package makes the handler's effects
// happen once per key, however often the message arrives, in one of two ways.
//
// The middleware, a [Dedup] built by [New] whose [Dedup.Wrap] is a
// consumer.Middleware, claims the message's key in a [Store] before the
// handler runs, and records the key as done only after the handler returned
// nil:
//
//   - A first delivery claims the key with a lease, runs the handler, then
//     completes the key, which the store keeps for the retention period.
//   - A duplicate of a completed key is acknowledged without running the
//     handler ([Dedup.Duplicates] counts them).
//   - A duplicate of a key whose claim is held elsewhere (another worker is
//     running it right now) is deferred: [consumer.Defer] wrapping
//     [ErrInProgress]. The delivery loop keeps the message and runs it again
//     after a delay, without returning it to the broker. Defer is not a
//     failure: DeadLetter spends none of the message's attempts on it and a
//     [consumer.Breaker] does not count it, so a duplicate that arrives while
//     the first copy runs long is never dead-lettered for waiting
//     ([Dedup.Deferred] counts them).
//   - A handler that fails (an error or a panic) releases its claim, so that
//     the redelivery runs the handler again. The handler's error is returned
//     unchanged, so Retry and DeadLetter middleware outside still see
//     consumer.Permanent and friends.
//   - A worker that dies holding a claim never completes or releases it; the
//     claim expires with its lease and the next delivery takes the key over.
//   - Only the holder of a claim can complete or release it: each claim carries
//     an owner token. A slow worker whose lease expired, and whose key another
//     worker has since claimed, gets [ErrNotOwner] and cannot undo the new
//     holder's claim ([Dedup.ClaimsLost] counts such runs: the effect may
//     have happened twice).
//   - A store that cannot be reached is an error: the message goes back to the
//     broker. It is never skipped, and the handler never runs without a claim.
//     A store that refuses the key or its data, which no retry can fix, is a
//     permanent error ([consumer.Permanent]): the message goes to the
//     dead-letter destination, and a circuit breaker does not count it.
//
// Put the middleware inside the Standard stack, so that the stack's
// dead-letter, retry and breaker see its outcomes:
//
//	dedup, err := idempotency.New(store, "billing")
//	...
//	h := consumer.Chain(handler, stack.Wrap, dedup.Wrap)
//
// A message that is dead-lettered is then never marked done, and redriving
// it later runs it. [Dedup.RegisterMetrics] reports the counters through
// OpenTelemetry.
//
// One gap remains, and it is the reason for the transactional inbox: if the
// handler's effect happened but the worker died (or the store failed) before
// the completion was recorded, the claim expires and the next delivery runs
// the handler again. For effects that are writes to the same database the
// store lives in, the inboxes of pgstore (NewInbox, NewSQLInbox) and
// sqlitestore (NewInbox) close the gap: the key is inserted in the same
// transaction as the handler's own writes, so both commit or neither does,
// and there is no separate completion step to lose.
//
// # Keys
//
// The key is, by default, the event id header that Ferry's outbox sets
// ([EventIDHeader], "ferry-event-id"), and the broker's message id when the
// header is absent. The broker's id is stable across redeliveries of one
// message but not across two publishes of the same event, so publishers that
// may publish twice should set the header (the outbox does). [WithKey]
// replaces both with a function of the message. A message without a key is a
// permanent error ([ErrNoKey]): it cannot be deduplicated, and running it
// unguarded would break the guarantee.
//
// A key is any bytes: NUL, invalid UTF-8 and any length are kept as they are,
// and keys that differ in any byte never meet (the SQL stores keep the
// SHA-256 of the namespaced key, Redis the key itself, and the memory store
// a 128-bit hash of it: see [MemoryStore]).
//
// Keys are namespaced by the consumer's name: two different consumers of one
// event (billing and shipping, say) each handle it once, because each looks up
// its own "billing:<id>" and "shipping:<id>" ([Key]).
//
// # Lease and retention: the trade-offs
//
// The lease ([WithLease], default 5 minutes) must be longer than the handler
// can take. If a handler outlives its lease, a redelivery elsewhere claims the
// key and the effect happens twice; the slow worker then learns, too late,
// that its claim was lost (ErrNotOwner on completion). Set it above your
// per-message timeout. A longer lease costs only this: when a worker dies
// mid-handler, the message waits for the lease to end before it runs again.
//
// A duplicate that finds the key in progress is deferred for
// [WithInProgressDelay] (default 2s, or less when the holder's lease ends
// sooner), again and again until the holder completes, releases or loses
// its claim. Deferring spends no attempt, on any broker.
//
// Completed keys are kept for the retention ([WithRetention], default 15
// days). A duplicate that arrives after its key was removed runs the handler
// again, so the retention must outlive the longest time the broker can
// redeliver a message: SQS keeps a message up to 14 days, hence the default
// of 15 days. Kafka can replay anything within its log retention when a
// group's offsets are reset; choose the retention to cover that if you reset
// offsets. The cost of a long retention is storage: one small row (or Redis
// key) per message handled in the period. Stores remove expired keys with
// [Cleaner]; run it periodically ([CleanEvery]).
//
// # Stores
//
// The [Store] interface has three methods (claim, complete, release), and
// each store costs one round trip for each. This package holds the in-memory
// store ([NewMemoryStore]: tests and single processes; the middleware calls
// it directly, at no allocation per message). Stores that need a driver
// live in their own packages, so that a program using one store does not
// link the drivers of the others:
//
//   - idempotency/pgstore: PostgreSQL over pgx/v5 (pgstore.NewStore), with
//     the transactional inbox for pgx.Tx and for database/sql.
//   - idempotency/redisstore: Redis over go-redis/v9 (redisstore.NewStore).
//   - idempotency/sqlitestore: SQLite through database/sql with
//     modernc.org/sqlite (sqlitestore.NewStore), the embedded single-node
//     default, with its transactional inbox.
//
// idempotency/storetest is the conformance suite every Store passes.
package idempotency
