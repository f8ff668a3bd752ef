package outbox

import (
	"errors"
	"fmt"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/outbox/internal/row"
)

// EventIDHeader is the header that carries an event's id on every message
// the relay publishes. It is the header the idempotency middleware reads by
// default (idempotency.EventIDHeader has the same value), so an event that is
// published twice (after a relay crash between publish and delete) is handled
// once downstream.
const EventIDHeader = consumer.EventIDHeader

// Lanes is how many lanes events are spread over: an event's lane is the
// FNV-1a hash of its key modulo Lanes (of its id when the key is empty).
// Relays lease whole lanes, so every event of one key is published by one
// relay at a time, in order. The number is part of the schema.
const Lanes = 64

// Event is one event to publish once the caller's transaction commits.
//
// Every field round-trips byte for byte: the id, destination, key, header
// names and values are Go strings and may hold any bytes, NUL and invalid
// UTF-8 included (a Kafka key or header value is bytes); the outbox stores
// them as bytes and the Publisher gets exactly what Add was given.
type Event struct {
	// ID identifies the event for good; it travels in the EventIDHeader
	// header and in consumer.Message.ID. Left empty, a random UUID is
	// assigned when the event is written.
	ID string
	// Destination is the topic or queue the event is published to. Required.
	Destination string
	// Key orders and routes the event: events of one key are published in
	// the order their transactions committed. It may be empty, in which case
	// the event is ordered with nothing.
	Key string
	// Body is the payload.
	Body []byte
	// Headers are published with the event, together with EventIDHeader,
	// which the outbox sets from ID: a header of that name with another
	// value is refused.
	Headers map[string]string
	// NotBefore holds the event in the outbox until this time: the relay
	// publishes it at its first read after it (within the poll interval,
	// WithPollInterval, default 1s), on any broker, however far ahead. The
	// zero time, or one already past when the event is written, publishes
	// it at once. A key's events keep their order: an event written after
	// one of its key that still waits (in the same Add or an earlier
	// transaction) waits at least as long, so a later NotBefore holds back
	// every later event of its key. The message published carries no
	// NotBefore of its own.
	NotBefore time.Time
}

// ErrInvalidEvent matches, through errors.Is, every [*EventError].
var ErrInvalidEvent = errors.New("outbox: invalid event")

// EventError says why an event was refused at write time. Nothing of the
// call that returned it was written, so the caller's transaction can roll
// back or carry on without it.
type EventError struct {
	// Index is the event's position in the call.
	Index int
	// ID is the event's id (assigned when the caller left it empty).
	ID string
	// Field is what was wrong: "Destination" (empty), "Size" (over the
	// writer's limit, see WriterMaxEventSize) or "Headers" (EventIDHeader
	// set to something other than the id).
	Field string
	// Reason says how.
	Reason string
}

// Error says which event was refused, and why.
func (e *EventError) Error() string {
	return fmt.Sprintf("outbox: event #%d (id %q): %s %s", e.Index, e.ID, e.Field, e.Reason)
}

// Is reports whether target is ErrInvalidEvent.
func (e *EventError) Is(target error) bool { return target == ErrInvalidEvent }

// WriterOption configures a Writer (pgoutbox.NewWriter,
// sqliteoutbox.NewWriter). An option given a bad value makes the constructor
// fail with a *consumer.ConfigError naming the field. The zero WriterOption
// changes nothing.
type WriterOption struct {
	apply func(*row.Config) error
}

func init() {
	// The database packages apply writer options through row, which cannot
	// name this type.
	row.OptionFunc = func(o any) func(*row.Config) error { return o.(WriterOption).apply }
}

// WriterMaxEventSize refuses, at write time, events whose id, destination,
// key, body, header names and values add up to more than n bytes, with an
// *EventError (Field "Size"), before anything is written. n must be between 1 and 64 MiB.
// Default 256 KiB.
func WriterMaxEventSize(n int) WriterOption {
	return WriterOption{func(c *row.Config) error {
		if n <= 0 || n > row.MaxEventSizeLimit {
			return &consumer.ConfigError{Field: "MaxEventSize", Reason: fmt.Sprintf("must be between 1 and %d, got %d", row.MaxEventSizeLimit, n)}
		}
		c.MaxEventSize = n
		return nil
	}}
}

// WriterNotify chooses whether a transaction that wrote events wakes the
// relays on commit (PostgreSQL NOTIFY; SQLite an in-process wake). Default
// true. Without it relays find new events by polling only, and commits do
// not take PostgreSQL's notification lock.
func WriterNotify(on bool) WriterOption {
	return WriterOption{func(c *row.Config) error {
		c.Notify = on
		return nil
	}}
}
