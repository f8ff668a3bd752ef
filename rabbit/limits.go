package rabbit

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/utf8cut"
)

// This file is what Publish checks before it sends a message: what AMQP or
// the broker would refuse by closing the channel or the whole connection,
// failing with it every message in flight of every other call.

// DefaultMaxMessageSize is the largest body Publish sends unless
// [WithMaxMessageSize] says otherwise: RabbitMQ's default max_message_size,
// 128 MiB.
const DefaultMaxMessageSize = 128 << 20

// MaxShortString is how many bytes an AMQP short string holds: the
// exchange, the routing key, the message id, header names and the other
// string properties of a message. A longer one cannot be encoded (amqp091
// then closes the connection).
const MaxShortString = 255

// largestMaxMessageSize is the largest max_message_size RabbitMQ accepts.
const largestMaxMessageSize = 512 << 20

// contentHeaderFixed is what a content header frame's payload holds besides
// the properties (class, weight, body size, property flags), and
// frameOverhead what a frame holds besides its payload: RabbitMQ refuses a
// frame over frame_max by closing the connection.
const (
	contentHeaderFixed = 2 + 2 + 8 + 2
	frameOverhead      = 7 + 1
)

var (
	// ErrTooLong is matched by the error (a *LimitError) of a message that
	// Publish did not send because a value of it is longer than an AMQP
	// short string holds (MaxShortString bytes): the exchange, the routing
	// key (the queue's name, or the Key with ToExchange), the message id, a
	// header name.
	ErrTooLong = errors.New("rabbit: value too long for an AMQP short string")

	// ErrTooLarge is matched by the error (a *LimitError) of a message that
	// Publish did not send because its body is over the maximum message
	// size (WithMaxMessageSize), or its headers and properties over what a
	// frame holds (the connection's frame_max, 128 KiB by default).
	ErrTooLarge = errors.New("rabbit: message too large")

	// ErrRefused is the reason for a message the broker refused by closing
	// its destination's publishing channel: 404 NOT_FOUND (no such
	// exchange), 403 ACCESS_REFUSED, 406 PRECONDITION_FAILED (a body over
	// the broker's max_message_size). The broker's *amqp091.Error, with its
	// code and text, is reached with errors.As. Every message to that
	// destination that was waiting for its confirm fails with it: the
	// broker discards what follows the refused message on the channel (and
	// for a missing or forbidden exchange all of them are refused). Only
	// where the exchange was deleted while messages to it were in flight
	// may one sent before the deletion have been taken.
	ErrRefused = errors.New("rabbit: publish refused by the broker")
)

// Fields a *LimitError names.
const (
	fieldBody       = "body"
	fieldProperties = "properties"
	fieldHeaderName = "header name"
)

// LimitError says why Publish did not send a message: a value of it is over
// a limit of AMQP or of the broker, which would have closed the channel or
// the connection, failing the other messages in flight with it. Only that
// message fails (and, as for any failure, the later messages of its Key in
// the same call, with [ErrEarlierFailed]). It matches [ErrTooLong] (a short
// string) or [ErrTooLarge] (the body, or the properties).
type LimitError struct {
	// Field is what is over its limit: "exchange", "routing key",
	// "message id", "header name", "type", "content type", "content
	// encoding", "correlation id", "reply to", "expiration", "user id",
	// "app id", "body" or "properties" (the headers and properties
	// together, against a frame).
	Field string
	// Name is the header's name, cut to 40 bytes, when Field is "header
	// name".
	Name string
	// Size is the value's size in bytes, and Limit the most it may be.
	Size, Limit int
}

func (e *LimitError) Error() string {
	switch e.Field {
	case fieldBody:
		return fmt.Sprintf("rabbit: body of %d bytes is over the maximum message size of %d bytes (WithMaxMessageSize, which must not exceed the broker's max_message_size)", e.Size, e.Limit)
	case fieldProperties:
		return fmt.Sprintf("rabbit: headers and properties of %d bytes are over the %d bytes a content header frame holds (the connection's frame_max less %d)", e.Size, e.Limit, contentHeaderFixed+frameOverhead)
	case fieldHeaderName:
		return fmt.Sprintf("rabbit: header name %q… of %d bytes is over the %d bytes an AMQP short string holds", e.Name, e.Size, e.Limit)
	}
	return fmt.Sprintf("rabbit: %s of %d bytes is over the %d bytes an AMQP short string holds", e.Field, e.Size, e.Limit)
}

// Is reports whether target is [ErrTooLarge] (the body or the properties) or
// [ErrTooLong] (anything else).
func (e *LimitError) Is(target error) bool {
	large := e.Field == fieldBody || e.Field == fieldProperties
	return (target == ErrTooLarge && large) || (target == ErrTooLong && !large)
}

// WithMaxMessageSize sets the largest body Publish sends, in bytes: a
// message with a larger one fails alone with a *LimitError matching
// [ErrTooLarge], and is never sent. Default [DefaultMaxMessageSize] (128 MiB,
// RabbitMQ's default max_message_size); at most 512 MiB, the broker's own
// ceiling. Set it to the broker's max_message_size when that is lower: a
// larger body that this lets through makes the broker close the
// destination's publishing channel (406 PRECONDITION_FAILED), and every
// message to that destination waiting for its confirm then fails with
// ErrRefused.
func WithMaxMessageSize(n int) Option {
	return func(c *config) error {
		if n < 1 || n > largestMaxMessageSize {
			return consumer.ConfigErrorf("MaxMessageSize", "must be in [1, %d] (512 MiB), got %d", largestMaxMessageSize, n)
		}
		c.maxMessage = n
		return nil
	}
}

func (b *Broker) maxMessageSize() int {
	if b.cfg.maxMessage > 0 {
		return b.cfg.maxMessage
	}
	return DefaultMaxMessageSize
}

// checkLimits returns a *LimitError for the first limit the message breaks
// that does not depend on the connection, and otherwise the size its
// properties take in a content header frame.
func checkLimits(exchange string, it *pubItem, maxBody int) (int, error) {
	p := &it.pub
	short := [...]struct{ field, v string }{
		{"exchange", exchange}, {"routing key", it.rk}, {"message id", p.MessageId},
		{"type", p.Type}, {"content type", p.ContentType}, {"content encoding", p.ContentEncoding},
		{"correlation id", p.CorrelationId}, {"reply to", p.ReplyTo}, {"expiration", p.Expiration},
		{"user id", p.UserId}, {"app id", p.AppId},
	}
	size := 0
	for _, s := range short {
		if len(s.v) > MaxShortString {
			return 0, &LimitError{Field: s.field, Size: len(s.v), Limit: MaxShortString}
		}
		if s.v != "" && s.field != "exchange" && s.field != "routing key" {
			size += 1 + len(s.v)
		}
	}
	if len(p.Body) > maxBody {
		return 0, &LimitError{Field: fieldBody, Size: len(p.Body), Limit: maxBody}
	}
	if p.DeliveryMode > 0 {
		size++
	}
	if p.Priority > 0 {
		size++
	}
	if !p.Timestamp.IsZero() {
		size += 8
	}
	if len(p.Headers) > 0 {
		n, err := tableSize(p.Headers)
		if err != nil {
			return 0, err
		}
		size += n
	}
	return size, nil
}

// checkFrame returns a *LimitError when properties of props bytes do not
// fit a content header frame of a connection with frameMax (0: no limit).
func checkFrame(props, frameMax int) error {
	if frameMax <= 0 {
		return nil
	}
	if room := frameMax - frameOverhead - contentHeaderFixed; props > room {
		return &LimitError{Field: fieldProperties, Size: props, Limit: room}
	}
	return nil
}

// tableSize is the size of t encoded as amqp091 encodes a field table, or a
// *LimitError for a name too long.
func tableSize(t amqp.Table) (int, error) {
	n := 4
	for k, v := range t {
		if len(k) > MaxShortString {
			return 0, &LimitError{Field: fieldHeaderName, Name: utf8cut.Cut(k, 40), Size: len(k), Limit: MaxShortString}
		}
		f, err := fieldSize(v)
		if err != nil {
			return 0, err
		}
		n += 1 + len(k) + f
	}
	return n, nil
}

// fieldSize is the size of a table's value, its type octet included, as
// amqp091's writeField encodes it. A type it does not know counts nothing:
// amqp091 refuses it before sending (Table.Validate).
func fieldSize(v any) (int, error) {
	switch x := v.(type) {
	case bool, byte, int8:
		return 2, nil
	case int16, uint16:
		return 3, nil
	case int, int32, uint32, float32:
		return 5, nil
	case int64, float64, time.Time:
		return 9, nil
	case amqp.Decimal:
		return 6, nil
	case string:
		return 5 + len(x), nil
	case []byte:
		return 5 + len(x), nil
	case nil:
		return 1, nil
	case []any:
		n := 5
		for _, e := range x {
			f, err := fieldSize(e)
			if err != nil {
				return 0, err
			}
			n += f
		}
		return n, nil
	case amqp.Table:
		n, err := tableSize(x)
		return 1 + n, err
	}
	return 0, nil
}

// fitDeadLetter makes a dead letter (a message [consumer.DeadLetter]
// publishes) fit AMQP's short strings where the original's key, id or
// header names, which another broker or a queue's [HeaderKey] let be longer,
// do not: such a message could never be dead-lettered, and would come back
// to fail again for ever. Its whole key and id are in its headers already
// ([consumer.HeaderDLQKey], [consumer.HeaderDLQMessageID]).
//
//   - A key over [MaxShortString] bytes that would be the routing key is cut
//     to fit (at a rune), and travels whole in [HeaderKey], from which
//     consumers read it.
//   - A message id over [MaxShortString] bytes becomes "sha256:" and the
//     first 32 hex digits of its SHA-256.
//   - A header name over [MaxShortString] bytes is cut to 238 bytes (at a
//     rune) and followed by "~" and 16 hex digits of its SHA-256, so that
//     two such names stay apart.
func fitDeadLetter(it *pubItem, toQueue bool) {
	h := it.pub.Headers
	if h[consumer.HeaderDLQReason] == nil {
		return
	}
	var long []string
	for k := range h {
		if len(k) > MaxShortString {
			long = append(long, k)
		}
	}
	for _, k := range long {
		h[utf8cut.Cut(k, MaxShortString-17)+"~"+hashHex(k, 16)] = h[k]
		delete(h, k)
	}
	if len(it.pub.MessageId) > MaxShortString {
		it.pub.MessageId = "sha256:" + hashHex(it.pub.MessageId, 32)
	}
	if !toQueue && len(it.rk) > MaxShortString {
		it.rk = utf8cut.Cut(it.key, MaxShortString)
		h[HeaderKey] = it.key
	}
}

func hashHex(s string, digits int) string {
	h := sha256.Sum256([]byte(s))
	return hex.EncodeToString(h[:])[:digits]
}
