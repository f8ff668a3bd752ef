// Package demo is `ferry demo`: the whole of Ferry on the embedded default,
// or on a real broker, in one run that checks its own result.
//
// # What it shows, and what it checks
//
// An order service commits each order and its OrderPlaced event in one
// SQLite transaction (the transactional outbox); a relay publishes the
// events to the in-process memory broker (or the broker of Config.Broker). Two instances of a billing
// service (billing-1 and billing-2) consume them through the standard
// middleware stack (dead letter, retry with backoff and jitter, a circuit
// breaker shared by both, a timeout, recover) and idempotency, call a
// simulated payments API, and record each payment in their own SQLite
// database. The payments API goes through five phases:
//
//   - steady: it answers in about 50ms;
//   - slow: its latency climbs to 2s; nothing fails, but the lag and the age
//     of the oldest message climb;
//   - failing: it is down; every call fails, retries back off with jitter and
//     the breaker counts failures and opens;
//   - protected: it is still down, and the breaker holds messages instead of
//     failing them: they are not attempted, use up no attempts and never
//     reach the dead-letter queue, and consumption pauses;
//   - recovered: it is back; the breaker closes after a trial call and the
//     backlog drains.
//
// Along the way a few orders are poison: three with bodies that do not
// decode (dead-lettered at once as permanent failures) and one whose
// customer's account is under review for ever (a transient failure that
// never clears, dead-lettered once its attempts are spent). Some events are
// published twice on purpose, as a relay that crashed between publishing and
// deleting would; the idempotency layer suppresses the second copy. And
// billing-2 is killed in the middle of a handler: its connection to the
// broker is cut and its handlers cancelled, and billing-1 takes over every
// message it held.
//
// # On a real broker
//
// Config.Broker is a URL that ferry.Open takes (kafka://, sqs://, amqp://);
// the default is the memory broker. On a real broker the run makes the
// orders queue and its dead-letter queue (on Kafka, topics; six partitions
// for the orders) under names of its own, reads the dead-letter queue back
// with a consumer of its own for the verdict, and deletes them at the end.
// billing-2 has a connection of its own, as another process would, and the
// kill plays out as each broker makes it:
//
//   - memory and SQS: billing-2 sends nothing more (no ack, no visibility
//     change), so its messages stay leased until the queue's visibility
//     timeout (Config.VisibilityTimeout; SQS counts whole seconds), then the
//     broker gives them to billing-1;
//   - RabbitMQ: its channel and connection close, and RabbitMQ requeues its
//     unacknowledged deliveries at once;
//   - Kafka: the two consumers are members of one consumer group; billing-2's
//     client leaves the group without committing what it had not finished,
//     and after the rebalance billing-1 reads its partitions again from the
//     last committed offset. What billing-2 finished but had not committed
//     (commits go out every second) comes again, and idempotency suppresses
//     it. A process that crashed would not leave the group: the coordinator
//     would notice it only after the session timeout (45 s by default), so
//     the demo closes the client instead of waiting for that. On Kafka the
//     consumers keep order per key (consumer.OrderByKey), so that a record
//     retried in place holds back its own order, not its partition.
//
// Config.DB, a PostgreSQL URL, moves the order service's outbox, the
// payments and the idempotency keys from SQLite files in a temporary folder
// to a schema of the run's own (outbox/pgoutbox, idempotency/pgstore),
// dropped at the end.
//
// Every second a status line shows the phase, the events published, the
// payments applied, the lag and the age of the oldest message, the retries,
// the breaker's state, the messages dead-lettered and the duplicates
// suppressed. At the end Run checks four invariants and returns them in a
// Verdict:
//
//   - exactly once: no order was paid twice, and no poison order was paid;
//   - poison dead-lettered: every poison order is in the dead-letter queue
//     with its reason (permanent or max-attempts) and its error;
//   - no good message dead-lettered;
//   - nothing lost: every good order was paid, the outbox and the queue are
//     empty.
//
// # Idempotency, twice
//
// The billing handler charges through a remote API and then writes to its
// own database, so it guards each side with the tool made for it. The
// idempotency middleware (over idempotency/sqlitestore's Store) claims the
// event's id before the handler runs, so a duplicate never calls the
// payments API again. The payment row is written through the transactional
// inbox (sqlitestore.NewInbox, on a table of its own), which records the
// event's id in the same transaction as the row, so even a worker that dies
// between its write and the middleware's completion cannot pay twice. The
// payments table has no unique constraint on purpose: the verdict counts
// rows per order instead of letting the database hide a double payment.
//
// # Reproducibility
//
// Every random choice about the orders (amounts, which are poison, which are
// duplicated) comes from Config.Seed, so two runs with one seed commit the
// same orders and reach the same counts and the same verdict. The
// interleaving of goroutines, and with it the exact moment each line
// changes, varies from run to run.
package demo
