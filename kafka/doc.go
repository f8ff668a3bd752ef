// Package kafka runs Ferry consumers and publishers on Apache Kafka, over
// franz-go (github.com/twmb/franz-go/pkg/kgo).
//
// # What it guarantees
//
// A consumer is one member of a consumer group: every consumer of one topic
// with one name ([consumer.WithName], the group id) shares the topic's
// partitions with the others, and each partition belongs to one member at a
// time. The name is therefore required: NewConsumer without
// [consumer.WithName] fails with a *[consumer.ConfigError] for "Name", since a
// default would have two services that forgot it split each other's
// partitions. Records of a partition are handled in offset order by default
// ([consumer.OrderByLane], a lane is a partition); with [consumer.OrderByKey],
// records of different keys in one partition run at once while each key
// keeps its order.
//
// A record is committed only after its handler returned nil (or, in
// [consumer.AtMostOnce] mode, before it ran). Per partition, the consumer
// commits the highest offset below which every fetched record is finished:
// a record that finished before an earlier one (another key, under
// OrderByKey) never moves the commit past the unfinished one. Commits
// happen every second ([WithCommitInterval]), when partitions are revoked and
// when Run ends. A member commits only for partitions it owns now; a
// committed offset never goes down; when the group takes partitions away
// without a clean handover (partitions lost: the member was too slow to
// heartbeat, or the coordinator moved on), the member commits nothing for
// them. A crash therefore costs at most a second of finished work, which
// runs again on the partition's next owner: delivery is at least once.
//
// In [consumer.AtMostOnce] mode a record's offset is committed, synchronously,
// before its handler runs: Settle returns only once the coordinator has the
// commit, and a record whose commit failed does not run. That costs a
// commit round trip to the group coordinator per settle batch (several
// records acked at once share one commit), on the handler's path: at most
// once on Kafka is slower than at least once, which commits on a timer. A
// record commits only once every earlier record of its partition was
// acked, so under OrderByKey or Unordered a record that starts ahead of an
// earlier, not yet started one is committed with it, not before its run.
//
// A failed record is retried in place after its delay: a log cannot skip a
// record without losing its order, so its partition (or, under OrderByKey,
// its key) waits for it. Use [consumer.DeadLetter] (part of [consumer.Standard])
// so that a record that fails for good goes to a dead-letter topic and its
// partition moves on. While a [consumer.Breaker] is open, held records do not
// count as attempts, fetching stops, and the member stays in its group:
// heartbeats run in the background, never on the handler's path, so a slow
// handler does not cost the membership either.
//
// # How Kafka maps onto the delivery loop
//
//   - Fetch: PollRecords off the handlers' path, at most as many records as
//     the loop has room for; a record becomes a [consumer.Message] with Lane the
//     partition number, Offset the record offset, Key, Body and Headers as
//     produced, PublishedAt the record timestamp, and ID the header
//     [HeaderMessageID] when the producer set one (Publish does, for a
//     Message.ID; whoever wrote it, that header is the ID and not one of
//     Headers), otherwise topic/partition/offset. Deliveries is always 1:
//     Kafka keeps no delivery count; the loop counts attempts in process.
//   - Settle Ack marks the record finished (the commit point moves at the
//     next commit). There is no Return: the loop retries in place
//     ([driver.Capabilities.Redelivers] is false); at shutdown a Return leaves
//     the record uncommitted, to be read again by the partition's next owner.
//   - Backpressure: one partition holds at most half of the loop's fetch
//     batch (itself at most the loop's in-flight bound) of fetched,
//     unfinished records; what a poll brings beyond that waits in the
//     driver, in order, until the partition's records finish, so that a
//     partition whose oldest record does not progress (a retry in place, a
//     hold, a slow key) never takes the whole loop's room and the other
//     partitions keep flowing. While two fetch batches wait in the driver
//     it stops polling, and franz-go keeps at most one buffered fetch: lag
//     grows, memory does not. A partition with more records waiting than it
//     finished in the last half second ([StuckAfter]), or its share
//     unfinished with none finished for half a second, is paused
//     (PauseFetchPartitions) until half of them are done, so that a slow
//     partition does not hold polling back for the others;
//     [WithPartitionBuffer] sets the share and pauses at it at once. When the
//     loop is full or a breaker holds, it stops polling too. Pauses are lifted when a
//     partition is revoked or assigned, since franz-go keeps them across
//     rebalances.
//   - Rebalances: cooperative-sticky by default, so only the partitions that
//     move stop; KIP-848 (WithGroupProtocol([NextGen])) as an option. On
//     revoke, the loop cancels the handlers of the partitions' records and
//     drops what it had queued (and records of those partitions fetched
//     before the revocation that reach it after: each record carries the
//     assignment it was fetched under); the rebalance waits for those
//     handlers to return (at most a few seconds less than the rebalance
//     timeout), commits what finished, and lets the partitions go.
//   - Static membership ([WithInstanceID], instance_id in a URL): a member
//     that stops does not leave its group, and one that comes back with the
//     same id within the session timeout gets its partitions back with no
//     rebalance, so a rolling restart moves nothing. Two processes given
//     one id fence each other: the one fenced ends its Run with [ErrFenced].
//   - Lag: per partition, the high watermark minus the group's committed
//     offset, as kadm reports it and ferry lag prints it: what the group has
//     not done. Of it, InFlight counts the records this member fetched past
//     the committed offset (being handled, waiting in the driver, or done
//     and waiting for the next commit) and Messages the rest, which no
//     consumer took yet, so that the loop's Health adds them up to the same
//     number; OldestAge is the age of the oldest unfinished record.
//
// # Retry topics: failures that do not hold their partition
//
// A record whose handler fails is retried in place: its partition waits
// for it, which keeps the partition's order. Where order matters less than
// the partition going on, [Broker.NewRetryingConsumer] runs a consumer
// with retry topics (as Spring Kafka's retryable topics do): a record
// whose runs failed (the handler's own [consumer.Retry] spent) is
// published to the retry topic of the first delay tier, and its partition
// goes on. A consumer of each tier, running the same handler, runs it once
// the tier's delay has passed since it was sent there (the record waits in
// its tier's loop, deferred, without a run); a failure sends it to the next
// tier, and a failure on the last tier, or a permanent one anywhere, to the
// dead-letter topic, through a [consumer.DeadLetter] whose headers name the
// topic the record was first consumed from and count every run it had.
// The HeaderRetry headers travel with it: tier, due time, runs so far,
// origin partition, offset and publish time, first failure, last error. A
// record held by an open breaker stays where it is, and so does one whose
// run failed while a breaker of the handler's chain is not closed (the
// failure that opened it, a failed half-open trial): an outage pauses
// consumption rather than running the records through the tiers into the
// dead-letter topic. The handler brings its own Retry, Breaker and Timeout
// but no DeadLetter (Run refuses one): the consumer dead-letters.
//
// Each hop publishes the record to the next topic before it acknowledges
// it where it was: a consumer killed between the two runs it again (at
// least once, as everywhere in Ferry), and loses nothing. Records overtake
// a record in the tiers, later records of its key included: the consumer
// refuses to start with an ordering that keeps order unless
// RetryTopics.GiveUpOrder says so. The retry topics and the dead-letter
// topic are made, with the topic's partition count, if they do not exist.
// Each tier's consumer is a [consumer.Loop] of its own (Loops: for Health,
// Lag and metrics), named after the consumer; a tier's lag counts the
// records waiting out their delay. The topic's loop reports the handler's
// middleware (retries, breakers, the dead letters) in its Health and
// metrics, once; the tiers' loops their own figures. Each hop is logged at
// WARN (a few a minute) and counted in the publish metrics of its retry
// topic. Not on share groups, and not at most once: both are refused.
//
// # Share groups: Kafka as a queue
//
// With [WithGroupProtocol]([Share]) (group_protocol=share in a URL), every
// consumer of the Broker consumes through a share group (KIP-932, Kafka 4.2
// and later), named by [consumer.WithName] as a consumer group is. The
// broker hands each record to one member under an acquisition lock, and
// the member acknowledges each record by itself; there are no offsets to
// commit and no order, so any handler and middleware run unchanged, with
// the ordering options ordering nothing across members. Members share a
// partition once there are more members than partitions (the group's
// assignor gives whole partitions to members while they are fewer): ten
// members on one partition all get work, which a consumer group cannot
// do.
//
// A consumer is up to four members of the group ("sessions", each a
// franz-go client; fewer when its [consumer.WithMaxInFlight] bound is
// below four), because franz-go accepts, at a client's next poll, every
// record of its last poll that has no final acknowledgement yet: a client
// polls again only once every record of its last poll is settled. A
// consumer starts with one, which polls up to the in-flight bound; when
// every session has held records for a tenth of a second while the loop
// has room (a slow handler, a record retried in place during an outage),
// it makes another, which polls up to a quarter of the bound, so it goes
// on taking records, and the circuit breaker hears of an outage from
// records other than the one held. A new session gets its share of the
// partitions at the group's next heartbeat (group.share.heartbeat.interval.ms,
// 5 s by default), so it helps within seconds, not at once. Such a
// consumer may hold up to 1.75 times the bound, the excess waiting under
// renewed locks; sessions last until the consumer stops. Count them against the
// group's member limit (group.share.max.size, 200 by default): a session
// the group refuses is given up with a WARN line, and the consumer goes on
// with those it has. Where a topic has more partitions than the group has
// members, the assignor splits the partitions among the sessions too, and
// the other records of a partition whose session holds a record wait for
// it (or for another process's members): more partitions than members
// make a share group work more like a consumer group.
//
//   - Ack is ACCEPT, sent before Settle returns; a record whose
//     acknowledgement the broker refused is delivered again when its lock
//     runs out, and Settle says so.
//   - A running handler's record is renewed (RENEW, KIP-1222) before its
//     lock runs out, as the loop extends an SQS visibility timeout: the
//     lease is the group's share.record.lock.duration.ms.
//   - A failed record is retried in place after its delay, under a
//     renewed lock, as on a consumer group, and a record held by an open
//     breaker is renewed too: neither is given back, so the broker's
//     delivery count (Message.Deliveries; Attempt counts the runs) grows
//     only when a member dies, loses its session or stops with the record,
//     and the dead-letter middleware spends its budget on one delivery.
//     (RELEASE would hand the record to any member at once, with no delay,
//     one delivery closer to the group's limit.)
//   - A consumer that stops gives back (RELEASE) what it did not finish.
//     A record given back on the last delivery the group allows
//     (share.delivery.count.limit, 5 by default) is archived by the
//     broker, not delivered again: to the group's dead-letter topic
//     (errors.deadletterqueue.topic.name, KIP-1191) when it has one,
//     otherwise dropped. The consumer logs it at WARN, naming which.
//   - Connect reads the group's lock duration, delivery limit and
//     dead-letter topic, and logs them; a member not allowed to read them
//     takes Kafka's defaults and says so at WARN. The lease follows the
//     lock each poll shows, so a lock changed at run time is kept. A
//     group nobody configured starts at the latest records; the consumer
//     sets share.auto.offset.reset to earliest on it first, as Ferry's
//     consumer groups start at the earliest (a user who may not alter the
//     group's configuration gets a WARN line instead).
//   - The broker refuses a request's acknowledgements of a partition as a
//     whole when one of its records lost its lock, so a record whose lock
//     may have run out is acknowledged on its own, and one whose renewal
//     was refused (lost: the broker may hand it to another member, and a
//     WARN says so) is renewed no more.
//   - Lag: per partition, the records the group coordinator counts as not
//     acknowledged (KIP-1226); the position is the end offset less that lag.
//     The broker tells no age of a share group's backlog: OldestAge is that
//     of the oldest record this consumer holds.
//
// # When it cannot consume
//
// A consumer never looks healthy while it cannot consume; NewConsumer and
// New do not need the cluster (a consumer built while it is down starts
// consuming when it comes up), and Run reports what stops it, as the
// delivery loop's Health, its WARN lines, Stats.FetchErrors and the
// ferry.consumer.health metric show it (see consumer/driver):
//
//   - The topic does not exist, or was deleted: an error wrapping
//     [consumer.ErrSourceNotFound], naming the topic and the cluster; Run
//     retries, and consumes once the topic is made. (A topic deleted and
//     made again is consumed again from the group's committed offsets,
//     which Kafka keeps by the topic's name; franz-go alone would not
//     follow the new topic.) Run asks the cluster when it starts, when a
//     fetch says the topic is gone, and every few seconds while no record
//     comes.
//   - No broker answers: when Run starts, and when every connection has
//     failed for a second with none answering since (a refused or failed
//     dial, a lost connection, a host that does not resolve), an error
//     wrapping [consumer.ErrUnreachable] with the address and what the
//     client saw, within [driver.ReportWithin]; Run retries, and franz-go
//     reconnects by itself meanwhile. A broker that drops packets silently
//     is seen once franz-go's dial or request times out (kgo.DialTimeout,
//     10 s by default). While some broker of the cluster answers, nothing
//     is reported: the cluster moves the leadership of partitions to the
//     brokers that are up, and franz-go follows.
//   - The cluster refuses the client, which no retry fixes: Run ends with
//     an error marked [driver.Fatal] wrapping [consumer.ErrRefused], within
//     seconds: a failed authentication (also [ErrAuthentication]: a wrong
//     SASL user or password, a certificate refused), an authorization
//     refused, or a TLS/plaintext mismatch (a TLS client at a plaintext
//     listener, or the reverse), whose error says which side speaks TLS.
//     The Broker dials the brokers itself to tell a mismatch from an
//     outage; with a kgo.Dialer or kgo.DialTLSConfig of your own
//     ([WithClientOpts]), a mismatch is reported as unreachable, with
//     franz-go's diagnosis.
//
// No password appears in any error or log line.
//
// # Publishing
//
// Broker is a [consumer.Publisher]: acks from all in-sync replicas with the
// idempotent producer, so Publish returns nil only once every record is
// durable, the producer's own retries never duplicate or reorder a partition, and records of one
// key keep their order within and across calls: each record of a call is
// checked (its size counted as franz-go counts it) before it is sent, and
// the records of one key in a call are sent one after another, each once
// the cluster has the one before, so that when a record of a key fails,
// here or in the cluster, the key's later records in the call fail too,
// unsent, and a caller retrying what failed keeps the key's order. Records
// of different keys, and records without a key, go out together; a call
// with n records of one key takes n round trips. The key picks the partition
// with murmur2, as the Java client does, so Ferry and Java producers of a
// topic agree. Records the cluster refused come back in a
// *[consumer.PublishError] by index; the cluster refuses whole batches, so a
// record it refuses fails its batch-mates of the same partition too, which
// may be records of other calls made at the same time, each reported by
// its own call. The producer lingers 5 ms, as the Java client does since
// Kafka 4.0, so that concurrent calls share batches; a call does not wait
// out the linger once its records are buffered (after the first call to a
// topic, which waits for the topic's partitions).
//
// Publish fails within seconds, with an error wrapping [consumer.ErrRefused],
// when the cluster refuses the client (a failed authentication, a
// TLS/plaintext mismatch). While the cluster does not answer, it waits for
// it up to its context, and then fails with an error that still matches
// the context's (context.DeadlineExceeded) and says what the client last
// saw: the address and the dial error ([consumer.ErrUnreachable]).
//
// A Publish returns when its context ends, whatever its records are
// waiting for: a partition whose leader died and has no other yet (the
// error then names LEADER_NOT_AVAILABLE, or the broker the producer could
// not reach while others answered), or too few in-sync replicas for
// acks=all (the leader refuses the write with NOT_ENOUGH_REPLICAS, which
// franz-go retries and tells of only at debug level, or does not answer
// while dead followers still count as in sync: the error then gives no
// reason beyond the deadline). franz-go's idempotent producer waits for the
// outcome of a write it sent, past any deadline, and writes the record
// once the cluster takes it: a Publish that failed at its deadline may
// have written some of its records, or write them later, and a retry then
// writes them again (at least once, as on every broker; idempotent
// handling, package idempotency, makes the second one no effect for
// messages with an ID). The call copies its records' bodies, so the
// caller may reuse them at once. Records buffered for a partition fail
// together when the first one's context ends, so a call can fail with
// another call's deadline; its error then says so, and does not match the
// context's.
//
// # Configuration
//
// New takes the bootstrap addresses and options; franz-go options pass
// through [WithClientOpts] (fetch sizes, timeouts, dialers), except those that
// would break the contract above (autocommit, a group or topics of their own,
// rebalance callbacks), which New refuses with a *[consumer.ConfigError]. TLS
// and SASL have options of their own ([WithTLS], [WithSASL]); a wrong password
// or a TLS/plaintext mismatch makes Publish fail and Run return within
// seconds (see above).
//
// # Opening from a URL
//
//	kafka://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...][?PARAMETERS]
//
// ferry.Open opens Kafka from a URL in a program that imports this
// package (blank, or github.com/ferrymq/ferry/brokers, when the program
// names no kafka identifier): New, through the seed brokers listed; each
// needs its port. A NewConsumer source is a topic. Query parameters:
//
//   - client_id=NAME: the client id the brokers see in their logs and
//     quotas. Default "ferry".
//   - group_protocol=classic|consumer|share: the consumer group protocol,
//     classic (the default) or consumer, the KIP-848 protocol of Kafka 4;
//     or share, for share groups (see Share groups above).
//   - instance_id=ID: every consumer joins its group as the static member
//     ID (WithInstanceID): give each process its own, such as its pod's
//     name.
//   - tls=true|false: connect with TLS, trusting the system's roots (or
//     ca_file's). Default false.
//   - ca_file=FILE: a PEM file of the CA to trust instead of the system's;
//     implies tls=true.
//   - sasl=MECHANISM: authenticate with the URL's user and password, by
//     SCRAM-SHA-512, SCRAM-SHA-256 or PLAIN. A user without sasl is an
//     error; use TLS with it, or the password crosses the network in
//     clear (PLAIN) or the session is not private (SCRAM).
//
// CreateTopic and DeleteTopic manage topics for tests and for users' own
// integration tests.
package kafka
