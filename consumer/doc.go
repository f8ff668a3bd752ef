// Package consumer is the core of Ferry: one [Handler] that runs unchanged on
// Amazon SQS, RabbitMQ, Apache Kafka or the in-process memory broker, and the
// delivery loop that gives every broker the same guarantees.
//
// # The guarantee
//
// Delivery is at least once. A message is acknowledged (deleted, acked, its
// offset committed) only after its handler returned nil. A handler error, a
// panic, a lost connection or a shutdown mid-handler leaves the message with
// the broker, and it is delivered again with [Message.Attempt] one higher. A
// handler that crashes after its work and before the ack therefore runs
// twice: exactly-once effects come from idempotent handling (package
// idempotency), never from the broker. The at-most-once mode
// ([WithDeliveryMode]([AtMostOnce])) acks before the handler runs, for data where
// a gap is better than a duplicate.
//
// What the loop does with a handler's result:
//
//   - nil: ack.
//   - [Permanent](err): no retry can help. The [DeadLetter] middleware moves the
//     message to a dead-letter destination; without it the loop logs an error
//     and returns the message like any failure (nothing is ever dropped).
//   - [RetryAfter](err, d): delivered again no sooner than d from now.
//   - [Hold](err, d): not attempted at all (a circuit breaker is open). The loop
//     keeps the message and its lease, pauses fetching for d, and runs it
//     again; Attempt does not grow.
//   - [Defer](err, d): not attempted (a duplicate of it runs elsewhere). The
//     loop keeps it and runs it again after d; fetching goes on, and deferred
//     messages do not take room from fresh ones. Up to MaxInFlight of them
//     wait beside MaxInFlight others, so up to twice the bound can be
//     unsettled at once; beyond that a broker that takes messages back gets
//     them back with the delay.
//   - any other error, or a panic: delivered again after the redelivery
//     backoff ([WithRedeliveryBackoff]).
//
// [IsPermanent], [IsRetryAfter], [IsHeld] and [IsDeferred] tell the outcomes
// apart, as do errors.Is with [ErrPermanent], [ErrRetryAfter], [ErrHeld] and
// [ErrDeferred]; errors.As gives the delay ([RetryAfterError], [HeldError],
// [DeferredError]).
//
// Where the broker can take a message back (SQS, RabbitMQ, memory), the loop
// returns it with the delay. Where it cannot (a Kafka log), or where it would
// come back behind later messages of its lane (a RabbitMQ single-active-consumer
// queue, whose delayed retries go through a delay queue), the loop runs it
// again in place after the delay and holds its lane meanwhile, so no later
// message of the lane overtakes it.
//
// # Order and parallelism
//
// A lane is what the broker keeps in order: a Kafka partition, an SQS FIFO
// message group, nothing for a standard queue. By default ([OrderByLane]) a lane
// runs one message at a time, in order, while different lanes and unlaned
// messages run in parallel on [WithConcurrency] workers. [OrderByKey] runs one
// message at a time per key inside each lane, for a partition that carries
// many keys. A later message of a key never completes before an earlier one.
//
// # Bounds, leases and shutdown
//
// A handler's result is acted on as soon as it returns: its worker hands the
// message back at once, not in a batch that waits to fill, and the loop
// sends the settlement with its next settle call (with one call out at a
// time, while the one before it is made; acks decided meanwhile go together
// in the next). No ack waits for another handler to finish.
//
// The loop holds at most [WithMaxInFlight] unsettled messages (running, queued
// behind their key, or waiting for a retry) and stops fetching while it is
// full, so slow handlers slow the fetch instead of growing memory. While it
// holds a message whose broker lease runs out (an SQS visibility timeout) it
// extends the lease in the background, so nobody else gets the message while
// it is being worked on.
//
// Cancelling Run's context stops fetching and runs what was already fetched,
// within the shutdown grace period, acking what succeeds: every message
// handed back counts as a delivery on SQS and RabbitMQ, so a graceful
// restart hands back only what it cannot finish. What waits to run later (a
// retry, a hold, a deferral) goes back at once with its delay. Handlers still
// running when the grace ends have their context cancelled and their
// messages are returned (or, if they do not return at all, left to their
// lease) for redelivery, with the messages not yet started.
//
// # Counting attempts
//
// Message.Attempt counts handler runs, exactly where they can be known: in
// process, and across redeliveries where this Loop or the broker kept the
// count (see Message.Attempt). [Message.Deliveries] is the broker's own count.
// The dead-letter middleware judges a message by its runs, and its headers
// carry both figures.
//
// # At most once
//
// WithDeliveryMode(AtMostOnce) acks a message, and waits until the ack is
// made, before its handler runs; a crash then loses the message instead of
// running it twice. The circuit breakers of the handler chain (found through
// the middleware's Unwrap methods) are asked first, so that a message a
// breaker would hold is kept, not acked and dropped. What fails after the
// ack is lost, as the mode allows, and never hidden: a run that fails, or a
// retry inside the chain that meets a breaker opened meanwhile, counts in
// Stats.Dropped and the ferry.consumer.dropped metric, and is logged at
// WARN with the message id (a few lines a minute, with the count of those
// left out).
//
// # Writing handlers
//
// A Handler is one method; [HandlerFunc] turns a function into one; a
// [Middleware] wraps one; [Chain] composes them, the first listed outermost. [JSON]
// gives a typed handler whose undecodable bodies are permanent errors.
//
// # Options
//
// Every constructor here that takes options takes them one way: a variadic
// list of its own option type, a function that sets one setting of an
// unexported configuration, applied in order (a nil option is skipped).
// Each option checks its value, and a bad one makes the constructor fail
// with a *[ConfigError] naming the setting; each option's doc says its
// default. The Loop's options, of type [Option], are named With and the
// setting ([WithConcurrency], [WithLogger]), as in every broker package; a
// middleware's are named for the middleware and the setting
// ([RetryAttempts], [BreakerOpenFor], [DeadLetterMaxAttempts],
// [StandardTimeout]), since one package holds them all and a WithLogger
// could mean only one of them. All of New's options are in options.go.
package consumer

// For maintainers. The words of this package's code: "Run" is the method
// (Loop.Run, Consumer.Run) and a call of it ("a Run"). A run, lower case, is
// one run of the handler chain on a message: what Message.Attempt,
// driver.History.Runs, Stats.Failed and the metrics count, and what a
// re-run repeats. The dispatcher is the one goroutine of a Run that owns
// every delivery's state (type dispatcher, receiver dp). A train is the
// deliveries a worker takes along with the one it was handed, to run after
// it without a round trip through the dispatcher: the deliveries queued
// behind an ordered delivery's key (delivery.train), or unordered
// deliveries ready behind an unordered one (looseTrain), which idle workers
// may take back.
//
// The files:
//
//	doc.go            the package doc, these words, this map
//	message.go        Message, Handler, HandlerFunc, Middleware, Chain, Consumer, Publisher, EventIDHeader
//	broker.go         the broker contract: Broker, NewOn, and the optional Admin, Peeker, SystemNamer
//	outcome.go        the outcomes (Permanent, RetryAfter, Hold, Defer), their sentinels and IsX; PanicError, PublishError
//	options.go        New's Options (every WithX), DeliveryMode, Ordering, ConfigError
//	loop.go           Loop, New, Run, Stats, Lag
//	dispatch.go       the dispatcher: admits fetched deliveries, hands them to workers, applies outcomes
//	workers.go        the goroutines around the dispatcher: the fetcher and the workers
//	delivery.go       one delivery as the loop holds it: state, context, order key, the in-flight list
//	waiting.go        deliveries that wait to run again: in-place retries, holds, deferrals
//	settle.go         settlements (acks, returns) and lease extensions, and their goroutines
//	revoke.go         lanes the broker takes away
//	shutdown.go       how a Run ends: the drain, the grace, what goes back
//	ledger.go         the run counts of messages handed back, for when they come back (SQS counts only deliveries)
//	chain.go          what the loop learns from the handler chain: nil layers, breakers, reservations
//	record.go         the per-delivery record the middleware layers share through the context
//	deadline.go       the cheap deadline context behind Timeout, and the monotonic clock
//	backoff.go        exponential backoff with full jitter, for Retry and redeliveries
//	retry.go          Retry and its RetryOptions
//	breaker.go        Breaker and its BreakerOptions
//	ratelimit.go      RateLimit, its RateLimitOptions and its metrics
//	deadletter.go     DeadLetter, its DeadLetterOptions and the HeaderDLQ headers
//	standard.go       Standard, the recommended Stack, and its StandardOptions
//	timeout.go        Timeout and TimeoutError
//	recover.go        Recover
//	json.go           JSON, the typed handler, and DecodeError
//	health.go         Health, HealthState, Verdict, how the loop judges its health, and the probe handlers
//	connectivity.go   whether the broker answers: the connection phase behind Health and the WARN lines
//	metrics.go        the loop's metrics
//	stack_metrics.go  the middleware's metrics, MetricsSource
//	tracing.go        spans for handler runs (WithTracerProvider) and for publishes (TracePublisher)
//	driver/           the interface a broker implements beneath the loop
//	consumertest/     the conformance suite every driver passes
