// Package driver is the small interface a broker implements beneath Ferry's
// delivery loop. Users do not import it; broker adapters (kafka, sqs, rabbit,
// memory) and users writing their own adapter do.
//
// The delivery loop in package consumer does everything that must be the same
// on every broker, once: the worker pool, the bound on messages in flight,
// ordering per lane and per key, acking only after success, retry after a
// delay, holding messages while a breaker is open, lease extension, revocation,
// draining on shutdown, and the counters. A driver only moves messages:
//
//   - Fetch a batch of deliveries (blocking until at least one is there or ctx ends).
//   - Settle a batch: acknowledge, or return for redelivery after a delay.
//   - Extend the lease of deliveries whose handler still runs (optional, Extender).
//   - Tell the loop when the broker took lanes away (optional, Revoker).
//   - Report lag (optional, LagReporter).
//
// A driver's methods are called from several goroutines of the loop at once
// (Fetch from one, Settle from another, Extend from a third). Fetch and
// Extend are never called concurrently with themselves, and neither is
// Settle, unless the driver asks for more (Capabilities.Settlers).
//
// # How the brokers map onto it
//
// Each adapter's package documentation says how its broker maps onto these
// interfaces: [github.com/ferrymq/ferry/kafka] (a partition is a lane, acks
// become commits of the offset below which every record is done, a
// rebalance revokes lanes), [github.com/ferrymq/ferry/sqs] (a FIFO message
// group is a lane, the lease is the visibility timeout, acks and returns
// are batch calls), [github.com/ferrymq/ferry/rabbit] (deliveries of a
// channel are revoked when it dies, a delayed return goes through a delay
// queue). [github.com/ferrymq/ferry/memory] is the reference: the smallest
// complete driver, with leases, redelivery and FIFO lanes.
//
// # Errors, and never failing silently
//
// Errors from Fetch are retried by the loop with backoff and reported, except
// errors wrapped by Fatal, which end Run. A Settle or Extend error is counted
// and logged; the broker then redelivers the message after its lease, which is
// always safe under at-least-once delivery.
//
// The loop can only report what the driver tells it, so a driver never
// retries silently: while it cannot reach the broker or its source, Fetch
// (and Connect) return an error within ReportWithin of the cause, wrapping
// consumer.ErrUnreachable or consumer.ErrSourceNotFound, naming the source,
// the broker's address (never a secret) and what the client last saw. A
// refusal no retry can fix (credentials, permissions, a TLS mismatch) is
// Fatal and wraps consumer.ErrRefused. A Fetch that reached the broker and
// found nothing may block (a long poll); the loop takes any Fetch that
// returns without an error as the broker answering.
package driver

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Message is one delivery as a driver hands it to the loop.
type Message struct {
	ID          string
	Key         string
	Body        []byte
	Headers     map[string]string
	Source      string
	Lane        string
	Offset      int64 // -1 where the broker has no offset
	PublishedAt time.Time

	// Deliveries is how many times the broker has delivered the message,
	// this delivery included: SQS ApproximateReceiveCount, a quorum queue's
	// x-delivery-count plus one. A broker that does not count reports 1 (or
	// 0, read as 1).
	Deliveries int

	// Known is what the broker carried of the message's earlier handler
	// runs, for a driver that can carry it when the message is returned (see
	// Settlement.History): the memory broker keeps it with the message, a
	// RabbitMQ delayed retry republishes it in a header. The zero value
	// says nothing is known; the loop then counts each earlier delivery
	// (Deliveries-1 of them) as one run.
	Known History

	// Handle is the driver's own reference to the delivery (a receipt handle,
	// a delivery tag, a record), given back to Settle, Extend and As.
	Handle any

	// Generation is the generation of its lane's assignment the message
	// was fetched under, for a driver whose revocations say which
	// generations they end (Revocation.Before); 0 when it does not say.
	Generation uint64
}

// History is what is known of a message's handler runs over its
// deliveries.
type History struct {
	// Runs is how many times a handler ran the message.
	Runs int
	// Deliveries is how many deliveries those runs were counted over.
	Deliveries int
	// Unseen is how many of those deliveries nobody counted the runs of
	// (another process had them): each is counted as one run in Runs.
	Unseen int
	// FirstFailure is when the first of those runs failed; zero when none
	// failed or it is not known.
	FirstFailure time.Time
}

// Action is what Settle does with a delivery.
type Action uint8

const (
	// Ack removes the message for good (delete, ack, commit).
	Ack Action = iota
	// Return gives the message back to the broker to be delivered again after
	// Delay.
	Return
)

// Settlement is one delivery's outcome.
type Settlement struct {
	Handle any
	Action Action
	Delay  time.Duration // for Return

	// NotAttempted is true for a Return whose handler did not run on this
	// delivery: held by an open breaker, deferred, or left unstarted when
	// the consumer stopped. A broker that can give a message back without
	// counting a delivery should do so for these (RabbitMQ 4.3 and later
	// count basic.reject but not basic.nack).
	NotAttempted bool

	// History is what the loop knows of the message's runs, this delivery's
	// included. A driver that can carry it with a returned message (in the
	// message itself, or in a header of a republished copy) hands it back
	// as Message.Known on the next delivery, so that Message.Attempt stays
	// exact across redeliveries. Drivers that cannot carry it ignore it.
	History History

	// BeforeRun is true for the ack of an at-most-once delivery, which the
	// loop makes before the handler runs and only then runs it: the ack
	// must be durable when Settle returns. A driver that makes acks durable
	// later (a Kafka commit on a timer) makes this one durable before
	// Settle returns, or fails it.
	BeforeRun bool
}

// Capabilities says what a broker can do, so that the loop can do the rest.
type Capabilities struct {
	// Redelivers is true when the broker can take a message back and deliver
	// it again later (SQS, RabbitMQ, memory). When false (a Kafka log, or a
	// RabbitMQ single-active-consumer queue, where a delayed message comes
	// back behind the rest of its lane) the loop retries a failed message in
	// place, holding its lane, and returns messages only when it stops.
	Redelivers bool

	// Source is the topic or queue the driver consumes, as the user named
	// it: the loop names it in its logs, its Health and its metrics
	// (messaging.destination.name). Empty for a driver that does not say.
	Source string

	// System names the broker in traces: OpenTelemetry's messaging.system
	// ("kafka", "aws_sqs", "rabbitmq"; the memory broker says
	// "ferry_memory"). Empty leaves the attribute out.
	System string

	// Settlers is how many Settle calls the loop may have with the driver
	// at once. 0 or 1: one at a time, in the order the loop decided them.
	// More suits a broker whose settlements of different messages are
	// independent, each call a round trip (SQS): acks decided while a call
	// is out need not wait for it. The driver's Settle must then be safe
	// for concurrent use.
	Settlers int

	// SettleBatch, with Settlers above 1, is how many settlements one
	// broker call takes (SQS: 10). While a Settle call is out, the loop
	// makes another only with at least this many settlements, and a call
	// of more takes whole batches (the rest wait for the next call), so
	// that overlapping calls do not shrink the broker's batches. A
	// shutdown's last settlements go as they are.
	SettleBatch int
}

// Driver is what every broker implements.
type Driver interface {
	// Fetch appends up to max deliveries to dst and returns it. It blocks until
	// at least one delivery is available or ctx ends (then it returns ctx's
	// error); it may return early with none.
	Fetch(ctx context.Context, dst []Message, max int) ([]Message, error)

	// Settle applies outcomes to deliveries. The loop never settles one
	// delivery twice.
	Settle(ctx context.Context, batch []Settlement) error

	// Capabilities reports what the broker can do.
	Capabilities() Capabilities

	// Close releases the driver's resources. The loop calls it when Run ends.
	Close() error
}

// ReportWithin is how soon after it stops reaching the broker or its source
// a driver's Fetch or Connect returns an error saying so, instead of
// retrying inside the client.
const ReportWithin = 5 * time.Second

// Config is what a delivery loop, built from its options, tells the
// driver it opens (see Opener): a driver is made for the loop that runs it,
// not patched after consumer.New.
type Config struct {
	// Name is the consumer's name as given by consumer.WithName, or "" when
	// none was given. On Kafka it is the group id, and required.
	Name string
	// MaxInFlight is the most messages the loop holds unsettled at once; a
	// driver whose broker pushes deliveries sizes its prefetch from it. 0
	// leaves the driver's default.
	MaxInFlight int
}

// Opener opens drivers over a broker's sources: every adapter's Broker
// implements it, and consumer.NewOn builds a delivery loop over it. The
// source is a queue or a topic, as the broker names them.
type Opener interface {
	// Driver returns a new driver over source, made for a loop with cfg.
	// A source the broker cannot name, or a cfg it cannot serve, is a
	// *consumer.ConfigError. Driver need not reach the broker: the loop
	// calls Connect (when the driver is a Connector) or Fetch, and reports
	// while they fail.
	Driver(ctx context.Context, source string, cfg Config) (Driver, error)
}

// Connector is implemented by drivers that can check, before the first
// Fetch, that the broker answers and the source exists. The loop calls
// Connect when Run starts, and again with backoff after each non-fatal
// error, before it fetches: until Connect succeeds the consumer's health is
// "starting", and after a failure "disconnected" with the error as its
// cause. Connect returns within ReportWithin (or ctx's deadline); its
// errors follow the rules of Fetch's (see the package doc). Constructors
// therefore need not reach the broker: a consumer built while the broker
// is down starts consuming when it comes up.
type Connector interface {
	Connect(ctx context.Context) error
}

// MinLease is the shortest lease the loop can keep alive: consumer.New
// refuses an Extender whose Lease is shorter, because the extensions could
// not land before the leases run out.
const MinLease = time.Second

// Extender is implemented by drivers whose deliveries hold a lease that runs
// out (an SQS visibility timeout). The loop extends the lease of every
// message it still holds (running, queued behind its key, waiting to run
// again, or waiting for its settlement to be sent) before a third of it is
// left. Extend may be called while a Settle is in progress, but never with
// a handle whose settlement is being made.
type Extender interface {
	// Lease is how long a fetched or extended delivery stays with this consumer.
	Lease() time.Duration
	// Extend gives each delivery a fresh lease of length d from now.
	Extend(ctx context.Context, handles []any, d time.Duration) error
}

// Aser is implemented by drivers that let a handler reach the broker's own
// representation of a delivery through consumer.Message.As.
type Aser interface {
	// As sets target, a pointer to a type the driver documents, from the
	// delivery behind handle, and reports whether it did. It must return
	// false, leaving target alone, for a type it does not know.
	As(handle, target any) bool
}

// Revoker is implemented by drivers whose broker can take lanes away while
// their messages are being handled (a Kafka rebalance, a lost AMQP channel).
type Revoker interface {
	// Revoked delivers each revocation. The loop cancels the handlers of
	// those lanes, settles nothing for them, drops their queued messages, and
	// then closes Done.
	Revoked() <-chan Revocation
}

// Revocation names lanes the broker took away. The loop closes Done once
// every running handler of those lanes has returned and every outcome it
// decided before the revocation has been passed to Settle; after that it
// settles nothing of those lanes. A driver may wait on Done (a Kafka
// rebalance callback does, then commits what was acked) before it lets the
// broker move on. Done may be nil.
//
// A batch the driver fetched from a lane before revoking it may still reach
// the loop after Done. When the driver numbers its lanes' assignments
// (Message.Generation, Revocation.Before), the loop drops such messages
// without running them. Otherwise it cannot tell them from a new
// assignment of the same lane and runs them, and a driver must refuse to
// settle handles of a lane generation it no longer owns (franz-go's commit
// of an offset for a partition it lost is refused by the group
// coordinator; an AMQP delivery tag carries its channel generation).
type Revocation struct {
	Lanes []string
	Done  chan struct{}
	// Before, when not 0, says that every message of these lanes with a
	// Generation below it belongs to the assignment revoked here (or an
	// earlier one): one arriving after the revocation is dropped.
	Before uint64
}

// Lag is how far a consumer is behind.
type Lag struct {
	// Messages waiting that no consumer has taken yet (sum over lanes).
	Messages int64
	// Delayed is how many of Messages the broker holds until a time (a
	// publish with NotBefore, a return with a delay), where it says so: no
	// consumer can take them yet, so they are no sign of a stuck one.
	Delayed int64
	// InFlight is how many messages are taken and not yet settled, where the
	// broker says so; -1 where it does not.
	InFlight int64
	// OldestAge is the age of the oldest waiting message, where the broker
	// says so; zero otherwise.
	OldestAge time.Duration
	// Lanes holds the lag per lane where the broker reports it (Kafka: per
	// partition); nil otherwise.
	Lanes map[string]int64
	// Positions holds each lane's committed position where the broker has
	// one (Kafka: the group's committed offset per partition); nil
	// otherwise. The loop's lag verdicts watch it move.
	Positions map[string]int64
	// Approximate says the broker's counts are estimates that may trail
	// the queue by a moment (SQS's ApproximateNumberOfMessages); a tool
	// shows them as "about N".
	Approximate bool
}

// Drainer is implemented by drivers whose broker pushes deliveries ahead of
// Fetch (an AMQP prefetch): when the loop stops fetching, deliveries the
// broker already sent would otherwise go back to it, each counting a
// delivery. Drain stops the broker from sending more and appends to dst
// those already received and not yet fetched, without waiting for new
// ones (a Kafka share group consumer waits, up to a second, for what its
// requests still at the broker bring: those records are acquired for it
// already). The loop calls it once, after its last Fetch returned, when its
// context ends, and runs what it returns within its shutdown grace like
// any fetched delivery. What it returns fits the in-flight bound, as a
// prefetch sized from it does (a Kafka share group consumer whose records
// straggle may hold up to three quarters of the bound more, which it
// returns too: given back, each would count one more delivery).
type Drainer interface {
	Drain(ctx context.Context, dst []Message) ([]Message, error)
}

// LagReporter is implemented by drivers that can say how far behind the
// consumer is.
type LagReporter interface {
	Lag(ctx context.Context) (Lag, error)
}

// SettleError is what Settle returns when some settlements of a batch
// failed and the others were made (SQS batch calls answer this way). Any
// other error from Settle means no settlement of the batch is known to have
// been made.
type SettleError struct {
	// Failed lists the settlements that failed, by index in the batch.
	Failed []int
	// Err says why.
	Err error
}

func (e *SettleError) Error() string {
	return fmt.Sprintf("%d settlement(s) failed: %v", len(e.Failed), e.Err)
}

// Unwrap returns why the settlements failed.
func (e *SettleError) Unwrap() error { return e.Err }

// FatalError marks a driver error after which consuming cannot go on
// (bad credentials, a queue that does not exist). Run returns it.
type FatalError struct{ Err error }

// Fatal marks err as fatal. Fatal(nil) is nil.
func Fatal(err error) error {
	if err == nil {
		return nil
	}
	return &FatalError{Err: err}
}

func (e *FatalError) Error() string { return e.Err.Error() }

// Unwrap returns the marked error.
func (e *FatalError) Unwrap() error { return e.Err }

// IsFatal reports whether err, or an error it wraps, was marked by Fatal.
func IsFatal(err error) bool {
	var f *FatalError
	return errors.As(err, &f)
}
