package consumer

import (
	"context"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
)

// Message is one delivery of a message to a Handler, or one message handed to
// a Publisher.
//
// A Handler may read every field; it must not keep the *Message after it
// returns, because the delivery loop owns it. A Publisher reads ID, Key, Body
// and Headers and ignores the rest.
type Message struct {
	// ID is the broker's identifier for the message: the SQS MessageId, the AMQP
	// message-id property, or for Kafka the record's kafka.HeaderMessageID
	// header (Publish writes it) or else topic/partition/offset. It is stable
	// across redeliveries of the same message.
	ID string

	// Key orders and routes the message: the Kafka record key, the SQS FIFO
	// message group id, the AMQP routing key. It may be empty.
	Key string

	// Body is the payload, byte for byte as published.
	Body []byte

	// Headers are the message's string headers (Kafka record headers, SQS
	// message attributes of type String, AMQP header table entries).
	Headers map[string]string

	// Source is where the message came from: the topic or queue name.
	Source string

	// Lane is what the broker keeps in order: the Kafka partition number, the
	// SQS FIFO message group, or "" where the broker orders nothing.
	Lane string

	// Offset is the message's position in its lane where the broker has one
	// (the Kafka offset); -1 where it has none.
	Offset int64

	// Attempt is the number of this run of the handler: 1 on the first run,
	// one higher on every run after a failure, whether the run came from an
	// in-process retry (Retry, or the loop retrying a Kafka record in place)
	// or from a redelivery. Runs are counted exactly where they can be known:
	// in process, and across redeliveries where the loop or the broker kept
	// the count (the memory broker, RabbitMQ delayed retries, a message that
	// comes back to the same Loop). Where a broker redelivered the message
	// and nothing recorded what happened on the earlier delivery (another
	// process had it, or crashed with it), that delivery counts as one run.
	// Holding a message (an open breaker) or deferring it is not a run.
	Attempt int

	// Deliveries is how many times the broker has delivered the message,
	// this delivery included, where it counts them (SQS
	// ApproximateReceiveCount, RabbitMQ x-delivery-count); 1 where it does
	// not (Kafka).
	Deliveries int

	// PublishedAt is when the broker took the message, where it says so;
	// zero otherwise.
	PublishedAt time.Time

	// NotBefore, on a message to publish, is the earliest time a consumer
	// may receive it: a delayed or scheduled publish. Zero, or a time that
	// has passed, publishes it at once. A broker that cannot hold the
	// message until then refuses it rather than deliver it early: Publish
	// reports it in a *[PublishError] wrapping [ErrDelayNotSupported] (on
	// Kafka, SQS FIFO queues and RabbitMQ exchanges) or [ErrDelayTooLong]
	// (past what the broker can hold: 15 minutes on SQS, about eight and a
	// half years on RabbitMQ), and publishes the others. SQS and RabbitMQ
	// round a delay up to whole seconds. The outbox holds an event for any
	// broker and any time (outbox.Event.NotBefore). On a consumed message
	// it is zero.
	NotBefore time.Time

	// unseen is how many earlier deliveries no run count was known for
	// (each counted as one run in Attempt); set by the loop.
	unseen int

	// aser and handle serve As.
	aser   driver.Aser
	handle any
}

// As reaches the broker's own representation of the delivery without
// importing the broker's client here. target must be a pointer to a type the
// driver documents (for example *kgo.Record for Kafka, *types.Message for SQS,
// *amqp091.Delivery for RabbitMQ, *memory.Delivery for the memory broker).
// It reports whether target was set.
func (m *Message) As(target any) bool {
	if m == nil || m.aser == nil {
		return false
	}
	return m.aser.As(m.handle, target)
}

// Header returns the value of the header named key, or "".
func (m *Message) Header(key string) string {
	return m.Headers[key]
}

// Handler handles one message. Returning nil acknowledges it; any error
// returns it to the broker for redelivery, shaped by the outcome helpers
// [RetryAfter], [Permanent], [Hold] and [Defer].
//
// Middleware returns a Handler that wraps another. Such a Handler should
// also have a method Unwrap() Handler returning the one it wraps, as every
// middleware in Ferry does: the delivery loop follows Unwrap to find the
// circuit breakers in a chain (in at-most-once mode it asks them before it
// acks) and to refuse a chain with a nil handler inside.
type Handler interface {
	Handle(ctx context.Context, m *Message) error
}

// HandlerFunc turns a function into a Handler.
type HandlerFunc func(ctx context.Context, m *Message) error

// Handle calls f(ctx, m).
func (f HandlerFunc) Handle(ctx context.Context, m *Message) error { return f(ctx, m) }

// Middleware wraps a Handler with behaviour of its own: retry, a circuit
// breaker, dead-lettering, idempotency.
type Middleware func(Handler) Handler

// Chain composes middleware around h. The first middleware listed is the
// outermost: Chain(h, A, B) handles a message as A(B(h)), so A sees the
// message first and the final outcome last.
func Chain(h Handler, mws ...Middleware) Handler {
	for i := len(mws) - 1; i >= 0; i-- {
		h = mws[i](h)
	}
	return h
}

// Consumer runs a Handler over incoming messages.
type Consumer interface {
	// Run delivers messages to h until ctx ends, then drains (see the package
	// documentation) and returns nil; it returns an error earlier only when
	// the broker connection fails for good.
	Run(ctx context.Context, h Handler) error
}

// EventIDHeader is the message header that carries an event's id: Ferry's
// outbox sets it on every event it publishes, and the idempotency
// middleware takes its key from it by default, so an event published twice
// is handled once. outbox.EventIDHeader and idempotency.EventIDHeader are
// this constant.
const EventIDHeader = "ferry-event-id"

// Publisher sends messages to a destination (a topic or a queue).
type Publisher interface {
	// Publish returns nil only once the broker holds every message durably.
	// When some messages failed and others did not, the error is a
	// *PublishError that says which. Messages of one key are published in
	// the order given, and when one fails, every later message of the same
	// key in the call fails too (none of them reaches the broker): a later
	// message that got through could not be taken back, and would overtake
	// the failed one when it is published again.
	Publish(ctx context.Context, destination string, msgs ...Message) error
}
