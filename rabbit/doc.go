// Package rabbit runs Ferry's delivery loop over RabbitMQ (AMQP 0-9-1,
// through github.com/rabbitmq/amqp091-go) and publishes to it with
// publisher confirms.
//
// # What it guarantees
//
// A message is acked only after its handler returned nil (manual acks, never
// auto-ack). Until then the broker holds it as unacked on the consumer's
// channel; when that channel or its connection is lost, by a crash, a
// network failure or a broker restart, the broker requeues it and delivers
// it again. A Publish returns nil only once the broker confirmed every
// message (on a quorum queue: a majority of its replicas wrote it), and
// every message is published mandatory, so one that no queue takes is an
// error, never a silent drop.
//
// # How RabbitMQ maps onto the loop
//
//   - Connect: the consuming connection (opened if need be) and a passive
//     queue.declare of the queue, or, for a queue of the Topology, its
//     declaration with its exchanges and bindings, within
//     [driver.ReportWithin]; see "When it cannot consume" below.
//   - Fetch: deliveries of basic.consume on a channel of the Broker's
//     consuming connection, with basic.qos prefetch equal to the loop's
//     MaxInFlight, so the broker never pushes more than the loop may hold.
//     Message.ID is the AMQP message-id (a hash of exchange, routing key
//     and body when the publisher set none), Key the [HeaderKey] header, else
//     the routing key of a message that came through an exchange (through
//     the default exchange, a plain destination's, the routing key is the
//     queue's name, and no Key), Headers the string, number and boolean
//     header values (tables such as x-death stay in the *amqp091.Delivery
//     that Message.As gives), Offset -1, PublishedAt the timestamp
//     property.
//   - Lane: "" (competing consumers keep no useful order), except on a
//     queue declared with [Queue.SingleActiveConsumer], where one consumer at
//     a time receives in queue order and Lane is the message's Key: the
//     loop then keeps each key's order while running keys in parallel,
//     and retries a failed message in place (see Retries on an ordered
//     queue). Partitioned spreads keys over several such queues through
//     the consistent-hash exchange.
//   - Deliveries: the x-delivery-count header of quorum queues plus one
//     (absent on the first delivery), plus the deliveries a delayed retry
//     carried over; classic queues count nothing but the redelivered flag.
//   - Settle Ack: basic.ack; acks of the lowest unsettled delivery tags go
//     out as one basic.ack with multiple set. Return with no delay:
//     basic.reject with requeue, or basic.nack with requeue when the
//     handler never ran (a breaker held it, or the loop stopped first).
//     Return with a delay: see Retries below. Capabilities.Redelivers is
//     true, except on a single-active-consumer queue, where a Return leaves
//     the delivery to go back when the channel closes (see Retries on an
//     ordered queue); Capabilities.System is "rabbitmq", and
//     Capabilities.Source the queue.
//   - At most once: AMQP confirms no basic.ack, so an ack the loop makes
//     before running the handler (Settlement.BeforeRun) is followed by a
//     basic.qos round trip on the same channel, and Settle returns nil only
//     once the broker has answered it, that is, once the broker's channel
//     has processed the ack: the message is no longer the consumer's and
//     will not be redelivered by a lost channel or connection. When ctx
//     ends or the channel closes first, Settle fails and the loop does not
//     run the message (the broker may still have taken the ack: at most
//     once, it is then run zero times). On a quorum queue the settlement is
//     then applied through the queue's log: a broker crash in that instant
//     can still redeliver it, so "at most once" on RabbitMQ is "acked on
//     the broker's channel before the handler runs", not "durably
//     removed".
//   - Extend: none. A delivery stays with its channel until it is settled
//     or the channel closes; the broker's consumer_timeout (30 minutes by
//     default) bounds the work. A channel closed for an ack timeout (406
//     PRECONDITION_FAILED) is logged with that advice and reopened like any
//     lost channel.
//   - Revoked: when the channel closes, every unsettled delivery of it is
//     gone (the broker requeued them). The driver sends a [driver.Revocation]
//     (lane "", or the keys in flight on a single-active-consumer queue),
//     waits until the loop cancelled their handlers, and only then opens a
//     new channel. A delivery tag carries its channel: one of a closed
//     channel is never acked on a new one (where it would name another
//     delivery, or close the channel with 406), and Settle reports it with
//     ErrStaleDelivery.
//   - Lag: Messages is the queue's ready messages (a passive
//     queue.declare), InFlight this consumer's unacked deliveries: those
//     the broker pushed ahead that the loop has not fetched yet (the
//     prefetch) and those the loop holds (running, queued, being
//     settled). Their sum, the loop's Health.Lag, is every message not
//     yet done when the consumer is the queue's only one. AMQP tells no
//     one else's unacked deliveries, nor the age of the oldest message:
//     the ferry.consumer.lag metric and ferry lag (from another process)
//     show Messages, the ready messages, and ferry lag says its in flight
//     is unknown.
//
// # Connections, reconnects and the topology
//
// Dial opens a publishing connection at once (with [WithLazyConnect]: at
// the first Publish) and a consuming connection when the first consumer
// starts; one blocked by a memory or disk alarm (publishers only) never
// holds back the other's acks. A lost connection or channel is reopened
// with exponential backoff and full jitter ([WithReconnectBackoff]). A dial
// runs on a goroutine of its own, bounded by the dial timeout (TCP
// connect, TLS and AMQP handshakes and the topology's declarations) and
// ended by Close; every caller needing the connection waits for that one
// dial only as long as its own context allows (a consumer at most
// [driver.ReportWithin], then it reports), and failed dials are spaced by a
// backoff shared by the publishers and the consumers of the connection. A
// Publish call dials at most once: when it fails, the call's messages not
// yet sent fail with its error. Each new connection declares the Topology
// again, and each consuming channel declares its own queue again, with its
// exchanges and bindings, so a queue deleted under a consumer comes back.
// A server-side basic.cancel (the queue was deleted) is reported through
// Fetch as [ErrConsumerCancelled] and consuming resumes once the queue
// exists. Lag, and the delay queues' declarations, are bounded by their
// context (Lag by 10 seconds when it has no deadline). Every notification
// channel the package registers is drained by a goroutine of its own, so
// the library's reader never waits on it, and Close cuts a connection the
// broker no longer answers (a blocked one) after 400 ms.
//
// The Topology is data: exchanges, queues (quorum by default; classic on
// request) and bindings, with dead-letter exchanges, delivery limits and
// single active consumer as fields.
//
// RabbitMQ drops a message of a quorum queue with no dead-letter exchange
// when it passes the queue's delivery limit, or is rejected without
// requeue (which the driver does only past DeliveryLimit; see Retries
// below). A Broker warns of it once per queue, when a consumer of it
// first opens a queue of its Topology that is a quorum queue with no
// DeadLetterExchange (nor x-dead-letter-exchange in Args) and a delivery
// limit: DeliveryLimit, an x-delivery-limit in Args, or, on RabbitMQ 4.0
// and later, the broker's default of 20. A queue the Broker only declares
// or publishes to (a dead-letter queue fed by [consumer.DeadLetter]) is not
// warned about: only deliveries pass a limit. Whether Ferry's DeadLetter
// middleware is in front cannot be seen from here, and does not remove the
// risk: a limit below its DeadLetterMaxAttempts (10 by default) is reached
// first, and a message whose every delivery ends before its handler
// returns (a process that crashes in the handler) reaches any limit
// without DeadLetter acting. Nor are policies seen: a dead-letter exchange
// set by a policy still draws the warning, and a queue outside the
// Topology, whose arguments the Broker does not know, never does.
//
// # Opening from a URL
//
//	amqp://USER:PASSWORD@HOST[:PORT][,HOST[:PORT]...]/VHOST
//	amqps://USER:PASSWORD@HOST[:PORT][,HOST[:PORT]...]/VHOST[?ca_file=FILE]
//
// ferry.Open opens RabbitMQ from a URL in a program that imports this
// package (blank, or github.com/ferrymq/ferry/brokers, when the program
// names no rabbit identifier), through Dial with [WithLazyConnect]: it
// connects on first use, as Kafka and SQS do; amqps:// over TLS. The
// path is the vhost ("/" or none is the default vhost; %2F escapes a "/"
// in a vhost's name). Several hosts are the nodes of a cluster (see
// Several nodes). A NewConsumer source is a queue, and a Publish
// destination the queue of that name, as on the other brokers;
// ToExchange(exchange) names an exchange.
// Query parameters:
//
//   - ca_file=FILE: a PEM file of the CA to trust instead of the system's
//     (amqps only). The certificate must name HOST.
//
// # Several nodes
//
// A URL may name the nodes of a cluster, separated by commas, with one
// user, password and vhost for all:
// amqp://u:p@rabbit-1:5672,rabbit-2:5672,rabbit-3:5672/. Give each node its
// port: ferry.Open parses the URL with net/url, which takes a list whose
// last node has no port, or that holds an IPv6 literal, for a bad port
// (Dial itself takes both).
// Each connection (the Broker has one for publishing and one for
// consuming) dials them in turn, starting after the node of its last
// connection, so a node that just died is tried last, and the first that
// accepts is used: when the node under a connection dies, the connection
// is lost as on a restart (see above) and the next dial reaches another
// node at once, with no backoff between nodes. Nodes that failed before
// one accepted are logged at WARN, each with its error; the reconnection's
// INFO names the node reached. When every node fails, the error is the
// last node's, saying that every node failed, and the next round waits the
// reconnect backoff. On amqps each connection verifies the certificate of
// the node it reached, unless a TLS configuration names a ServerName.
//
// Ferry is the only recovery layer: the amqp091-go Config it dials with
// has no Recovery (amqp091-go's own connection and topology recovery, off
// by default, which no option turns on), so a lost connection is
// reconnected, and its topology and consumers declared again, once.
//
// # When it cannot consume
//
// A consumer never looks healthy while it cannot consume, and reports why
// as a Kafka or SQS consumer does: the errors of Connect and Fetch wrap one
// of consumer's three, name the queue and the broker's URL with the
// password hidden, and wrap the client's own error (an *amqp091.Error
// where the broker said why), which the loop puts in Health.Error and in a
// WARN line at once, counting FetchErrors.
//
//   - [consumer.ErrUnreachable], retried with backoff: a dial refused or
//     timed out, a connection or channel lost (320 CONNECTION_FORCED,
//     a missed heartbeat), the broker not answering within
//     [driver.ReportWithin], a vhost refused on a reconnect (what a
//     restarting node answers before its vhosts are up).
//   - [consumer.ErrSourceNotFound], retried with backoff: the queue does not
//     exist (404 NOT_FOUND from Connect's passive declare or from
//     basic.consume), or the broker cancelled the consumer because it was
//     deleted ([ErrConsumerCancelled]). The consumer consumes once it is
//     declared; a queue of the Topology is declared again by the driver
//     itself.
//   - [consumer.ErrRefused], marked [driver.Fatal], so Run ends with it and
//     health says stopped: credentials refused (amqp091.ErrCredentials),
//     the vhost refused at the Broker's first connection (530 NOT_ALLOWED:
//     a wrong URL, or a user without access to it), access refused (403
//     ACCESS_REFUSED on the queue or its declaration; one met on a
//     channel whose connection then closes within a second is a vhost
//     being deleted, and is retried), a declaration the broker rejects
//     (406 PRECONDITION_FAILED: other arguments than the existing queue's),
//     a TLS handshake that fails (a certificate not trusted or not for the
//     host, amqps:// to a plaintext listener, amqp:// to a TLS one).
//
// A channel the broker closes for an ack timeout (406) wraps none of them:
// it is reported as it is, and reopened. After a failure Fetch returns as
// soon as a new channel consumes, so that the loop says it consumes again
// even while the queue is empty.
//
// Dial fails fast (its errors wrap the same kinds), because the Broker is
// also the publisher: a service that publishes finds a wrong URL or a
// broker that is down when it starts. A consumer needs no connection to be
// built, though, and [WithLazyConnect] makes Dial return without one: a
// consumer of such a Broker built while RabbitMQ is down reports it
// (health disconnected, [consumer.ErrUnreachable]) and starts consuming when
// RabbitMQ comes up; what Dial would have refused ends its Run with
// [consumer.ErrRefused] instead. (ferry.Open connects at once, as Dial does.)
// A network that drops packets silently is noticed by the heartbeat
// ([WithHeartbeat]), not within [driver.ReportWithin].
//
// # Publishing
//
// A destination is a queue, as on SQS, Kafka (a topic) and the memory
// broker: Publish(ctx, "orders-dlq", …), or consumer.Standard(b,
// "orders-dlq"), reaches the queue orders-dlq. The message goes through the
// default exchange with the queue's name as routing key, and its Key
// travels in the [HeaderKey] header, from which consumers read it. A name no
// queue has fails the message with [ErrUnroutable] and an error naming the
// queue; it closes no channel, and the next publish goes on as before.
//
// An exchange is used where the destination says so: ToExchange(exchange)
// (the string "amq.exchange/" and the exchange's name, for configuration)
// publishes to the exchange, with Message.Key as the routing key, which is
// what its bindings route (and what Partitioned's consistent-hash exchange
// hashes). Declaring an exchange in the Topology does not make its name a
// destination: a plain name stays a queue, whether or not an exchange has
// it too (an exchange bound to a queue of the same name is common), so that
// a name means one thing whatever the Topology. A plain name that no queue
// has, but an exchange of the Topology does, fails with an error saying to
// publish to ToExchange(name). [ToQueue] and the "amq.default/" prefix, from
// when a plain name was an exchange, still name a queue, and are
// deprecated. In traces and metrics ([consumer.TracePublisher]) the
// destination is the queue or the exchange as the user named it
// ([Broker.DestinationName]), never a prefix. Messages are persistent and
// carry the ID as message-id.
//
// Publishing is pipelined: a call sends its messages on a confirm-mode
// channel without waiting, within a window of unconfirmed messages shared by
// every call ([WithConfirmWindow]), then waits for the confirms. A message
// returned unroutable fails with [ErrUnroutable] (a message's basic.return
// comes before its confirm on the channel, and the returns are all recorded
// before any confirmed message of the call is reported published), one
// nacked with [ErrNacked],
// both in a *[consumer.PublishError] that names them while the rest
// succeeds. A message waits for the confirm of the message of the same Key
// before it in the call, and is never sent when that one failed
// ([ErrEarlierFailed]), so a key's messages never overtake each other. While
// the broker blocks the connection (connection.blocked, a memory or disk
// alarm), Publish waits; when its context ends first, the error matches
// both [ErrBlocked] and the context's error.
//
// One bad message fails alone. What AMQP or the broker cannot take without
// closing the channel, or the whole connection, and with it every message
// in flight of every other call, is checked before sending: a message id,
// header name, routing key, exchange or other string property over 255
// bytes ([MaxShortString]) fails with [ErrTooLong], a body over
// [WithMaxMessageSize] (default 128 MiB, the broker's max_message_size) or
// headers and properties over what a frame holds fail with [ErrTooLarge],
// each a *LimitError naming the limit, and the message is never sent. What
// the broker refuses by closing the channel (404 NOT_FOUND for a missing
// exchange, 403 ACCESS_REFUSED) fails with [ErrRefused] and the broker's
// *amqp091.Error, its code and text: the broker did not take it. Each
// destination publishes on a channel of its own, so such a refusal fails
// only the messages to that destination, which the broker refuses anyway,
// never those of other destinations: a channel per destination rather than
// one shared channel and a recovery that re-sends what was unconfirmed,
// because a re-send duplicates what the broker had taken (on a quorum queue
// a confirm trails the write), in healthy destinations, every time any
// destination is refused, and cannot tell which message the broker
// refused. [ErrNotConfirmed] is left for a connection lost before the
// confirms came: those messages may or may not have been taken.
//
// A dead letter (a message [consumer.DeadLetter] publishes, which carries
// [consumer.HeaderDLQReason]) is made to fit instead: its original's key, id
// or header names may be longer than AMQP's 255 bytes (another broker's,
// or a queue's [HeaderKey]), and a dead letter that could never be published
// would come back to fail again for ever. A key over 255 bytes that is
// the routing key (to an exchange) is routed cut to 255 bytes (at a rune)
// and travels whole in [HeaderKey], from which consumers read Key; an id over 255 bytes becomes its SHA-256 (the whole
// id is in [consumer.HeaderDLQMessageID]); a header name over 255 bytes is
// cut and suffixed with its hash.
//
// # Delayed publish
//
// A message published to a queue with a NotBefore ahead
// ([consumer.Message].NotBefore) reaches the queue at that time, to the
// second (the delay is rounded up to whole seconds), up to [MaxDelay]
// (about eight and a half years), with no plugin (the delayed-message
// exchange is archived and does not run on RabbitMQ 4.3). It waits in
// levels of delay, as NServiceBus's transport does: level n, a topic
// exchange and a quorum queue named ferry.delay.level.NN, holds a message
// 2^n seconds, and a message passes the levels of its delay's bits, from
// level 27 down, then the exchange ferry.delay.deliver routes it to its
// queue, bound there by a hash of the queue's name. Every queue of the
// levels holds messages of one time to live, which RabbitMQ expires in
// order; each dead-letters at least once (x-dead-letter-strategy
// at-least-once), so a message is always in a level or in its queue, across
// restarts (TestBrokerRestartKeepsDelayedMessages) and node failures; a
// hop may repeat a message after a node failure or a lost confirm, so a
// delayed message comes at least once, like any other. A message whose
// queue was deleted while it waited goes, when its time comes, to the
// quorum queue ferry.delay.orphans (the delivery exchange's alternate
// exchange), to inspect or move with the tools for dead letters: kept in
// its level instead, RabbitMQ would retry it for ever, and 32 such
// messages stop every later message of the level for the whole vhost.
// Nothing consumes that queue, so a Broker that published a delayed
// message counts it every [DefaultOrphanCheck], reports the count in the
// gauge [MetricDelayOrphans], logs a warning each time it grows, and
// declares the queue again if it was deleted. On RabbitMQ 4 it has no
// delivery limit, so that looking at its messages does not drop them.
// Quorum queues keep a little memory per message, so a backlog of millions
// of delayed messages costs the broker memory in proportion.
//
// The levels are declared at the first delayed publish of a connection,
// the queue's binding at every call that holds a message (a queue that does
// not exist fails those messages with [consumer.ErrSourceNotFound]). The
// user needs configure, write and read permission on the names that start
// with ferry.delay. (and write on the queue); a user that may not configure
// them uses levels an administrator declared (checked passively), and
// otherwise gets an [ErrRefused] that says so.
// Delays past [MaxDelay] fail with [consumer.ErrDelayTooLong]; a delayed
// message to an exchange ([ToExchange]) with [consumer.ErrDelayNotSupported]
// (its routing key spells the delay, so an exchange's own routing would be
// lost). A delayed message keeps its key, id, headers and body; the headers
// of the levels' dead-lettering (x-first-death-*, x-last-death-*) are taken
// off, and the x-death table keeps their records. A key's order holds only
// among messages of one delay: a later message with a shorter delay comes
// first.
//
// # Retries after a delay
//
// No plugin is needed. A Return with a delay publishes a copy of the
// message, confirmed, to a classic delay queue named
// "<queue>.ferry-delay.<ms>ms" whose x-message-ttl is the delay and whose
// dead-letter exchange routes it back to the source queue, then acks the
// original. Delays are rounded up to the next of [WithRetryDelays] (default
// [DefaultRetryDelays], 1s to 1h), so there is one delay queue per step, and
// a message never comes back early. The copy carries the deliveries it had
// and the loop's count of handler runs in headers, so Message.Attempt and
// Message.Deliveries stay exact. On a queue with a DeliveryLimit, a delayed
// return past the limit is rejected without requeue instead: the queue
// dead-letters it like the broker would. A copy that is not confirmed
// within 10 seconds, or that would wait on a blocked connection, is not
// waited for: the original is requeued at once (redelivered early, never
// lost) and Settle reports why. A copy returned unroutable (its delay queue
// was deleted) declares the delay queue again and is published once more
// before that; the original is never acked unless its copy was confirmed
// and not returned.
//
// # Retries on an ordered queue
//
// On a single-active-consumer queue the delay queue would break the order:
// the copy comes back behind the rest of its key, which completes first.
// So the driver reports Capabilities.Redelivers false there, and the loop
// retries a failed message in place, as on a Kafka partition: it keeps the
// delivery unacked, waits out the delay (the redelivery backoff, or
// RetryAfter's) and runs it again, holding its key (the lane) so that
// nothing behind it overtakes it; other keys go on. What
// this costs: the message and the key's messages queued behind it hold
// places of MaxInFlight (and of the prefetch) while it waits; the delay is
// bounded by the broker's consumer_timeout (30 minutes by default), past
// which the broker closes the channel and redelivers everything it had
// delivered, at once and in order; and a queue's DeliveryLimit counts
// deliveries, not runs in place, so it no longer bounds a poison message:
// use [consumer.DeadLetter] ([consumer.Standard]), which counts runs.
//
// When the consumer stops while a message waits in place, by a shutdown or
// a crash, the message goes back to its place at the head of the queue,
// ahead of the rest of its key: Settle sends nothing for a Return there,
// and the broker requeues the delivery, in order, when the channel closes.
// (A basic.reject or basic.nack with requeue would put it behind the ready
// messages on a RabbitMQ 3.10 quorum queue.) Its delay is given up for its
// place: the next consumer runs it at once. Its runs in place are not
// carried over, as on Kafka: on a quorum queue the broker counts the
// delivery (x-delivery-count), which the loop counts as one run, so after
// any number of runs in place the next is Attempt 2 with Deliveries 2; on a
// classic queue, the redelivered flag says as much.
//
// # RabbitMQ 3.10 and 4.x
//
// The tests run on RabbitMQ 3.10, the version Debian bookworm ships, and
// the package's whole suite runs again on RabbitMQ 4.0 (make test-rabbit4,
// both in CI). On 4.x:
//
//   - Quorum queues have a delivery limit of 20 by default. A queue declared
//     with DeliveryLimit 0 then dead-letters (or, without a dead-letter
//     exchange, drops) a message on its 21st delivery; on 3.10 it has no
//     limit. Declare a DeadLetterExchange on every quorum queue.
//   - From 4.3 only basic.reject raises x-delivery-count; basic.nack does
//     not. The driver rejects what a handler failed and nacks what no
//     handler ran (held by a breaker, or handed back at shutdown), so on
//     4.3 a breaker holding messages burns none of their delivery limit; on
//     3.10 both count.
//   - Newer brokers add x-last-death-* headers to dead-lettered messages;
//     3.10 sets only x-first-death-* and the x-death table, whose first
//     entry is the newest death.
//   - Classic queue mirroring is gone in 4.0; quorum queues (the default
//     here) are unaffected.
package rabbit
