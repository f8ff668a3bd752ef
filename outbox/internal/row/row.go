// Package row holds what the outbox's database packages share: the writer's
// configuration and the checks and encoding an event gets before it is
// inserted.
package row

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"maps"
	"slices"
	"sort"
	"time"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/ferrymq/ferry/consumer"
)

// Lanes is the number of lanes events are spread over (see outbox.Lanes).
const Lanes = 64

// MaxEventSizeLimit is the largest event size a writer may be configured to
// accept.
const MaxEventSizeLimit = 64 << 20

// Config is the writer configuration set by outbox.WriterOption.
type Config struct {
	MaxEventSize int
	Notify       bool
}

// DefaultConfig returns the defaults documented on the options.
func DefaultConfig() Config { return Config{MaxEventSize: 256 << 10, Notify: true} }

// Event mirrors outbox.Event (kept here to avoid an import cycle).
type Event struct {
	ID          string
	Destination string
	Key         string
	Body        []byte
	Headers     map[string]string
	NotBefore   time.Time
}

// Row is an event ready to insert. Every text of the event is stored as
// bytes (bytea, BLOB), so that it round-trips byte for byte: NUL and invalid
// UTF-8 included.
type Row struct {
	EventID     []byte
	Lane        int
	Destination []byte
	Key         []byte
	Body        []byte
	Headers     []byte // EncodeHeaders, or nil when there are none
	KeyHash     int32  // for per-key write serialisation
	// NotBefore is when the event may be published: the event's own, or
	// the latest of an earlier event of its key in the same call, so that
	// a key's events become due in their order. Zero: at once (the store
	// may raise it to a pending event's of the key, see outbox.Event).
	NotBefore time.Time
}

// NewID returns a random UUID (version 4) string.
func NewID() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic("outbox: crypto/rand: " + err.Error())
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	var s [36]byte
	hex.Encode(s[0:8], b[0:4])
	s[8] = '-'
	hex.Encode(s[9:13], b[4:6])
	s[13] = '-'
	hex.Encode(s[14:18], b[6:8])
	s[18] = '-'
	hex.Encode(s[19:23], b[8:10])
	s[23] = '-'
	hex.Encode(s[24:], b[10:])
	return string(s[:])
}

// Hash32 is FNV-1a over s.
func Hash32(s string) uint32 {
	h := fnv.New32a()
	h.Write([]byte(s))
	return h.Sum32()
}

// LaneOf returns the lane of an event: by key, or by id when the key is empty.
func LaneOf(key, id string) int {
	if key == "" {
		return int(Hash32(id) % Lanes)
	}
	return int(Hash32(key) % Lanes)
}

// Size is what counts against the size limit: the bytes of the id,
// destination, key, body, and header names and values.
func Size(e *Event, id string) int {
	n := len(id) + len(e.Destination) + len(e.Key) + len(e.Body)
	for k, v := range e.Headers {
		n += len(k) + len(v)
	}
	return n
}

// Invalid builds the error Prepare returns for a refused event, so that the
// error type stays outbox's.
type Invalid func(index int, id, field, reason string) error

// EventIDHeader is outbox.EventIDHeader.
const EventIDHeader = consumer.EventIDHeader

// Prepare checks and encodes events. It never changes the caller's events;
// ids are generated for events without one. When ctx carries a span, an
// event without a trace context of its own gets that span's (W3C
// traceparent and tracestate headers), so that the relay's publish continues
// the trace of the transaction that wrote the event.
func Prepare(ctx context.Context, cfg Config, events []Event, invalid Invalid) ([]Row, error) {
	rows := make([]Row, len(events))
	tc := traceHeaders(ctx)
	now := time.Now()
	var latest map[string]time.Time // per key, the latest NotBefore so far; nil while none is set
	for i := range events {
		e := &events[i]
		if tc != nil && e.Headers[traceparent] == "" {
			withTrace := *e
			withTrace.Headers = make(map[string]string, len(e.Headers)+len(tc))
			maps.Copy(withTrace.Headers, e.Headers)
			maps.Copy(withTrace.Headers, tc)
			e = &withTrace
		}
		id := e.ID
		if id == "" {
			id = NewID()
		}
		if e.Destination == "" {
			return nil, invalid(i, id, "Destination", "is empty")
		}
		if n := Size(e, id); n > cfg.MaxEventSize {
			return nil, invalid(i, id, "Size", fmt.Sprintf("%d bytes is over the limit of %d bytes", n, cfg.MaxEventSize))
		}
		if v, ok := e.Headers[EventIDHeader]; ok && v != id {
			return nil, invalid(i, id, "Headers", fmt.Sprintf("%s is %q, not the event's id: the outbox sets it from ID", EventIDHeader, v))
		}
		body := e.Body
		if body == nil {
			body = []byte{}
		}
		rows[i] = Row{
			EventID:     []byte(id),
			Lane:        LaneOf(e.Key, id),
			Destination: []byte(e.Destination),
			Key:         []byte(e.Key),
			Body:        body,
			Headers:     EncodeHeaders(e.Headers),
			KeyHash:     int32(Hash32(e.Key)),
		}
		if e.NotBefore.After(now) {
			rows[i].NotBefore = e.NotBefore
			if latest == nil {
				latest = make(map[string]time.Time)
			}
		}
		if latest != nil && e.Key != "" {
			// A key's events keep their order: one due before an earlier
			// event of its key in this call waits for it.
			if t := latest[e.Key]; t.After(rows[i].NotBefore) {
				rows[i].NotBefore = t
			}
			if !rows[i].NotBefore.IsZero() {
				latest[e.Key] = rows[i].NotBefore
			}
		}
	}
	return rows, nil
}

// traceparent is the W3C trace context header.
const traceparent = "traceparent"

// traceHeaders returns the trace context headers of ctx's span, or nil when
// ctx carries none.
func traceHeaders(ctx context.Context) map[string]string {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return nil
	}
	h := map[string]string{}
	propagation.TraceContext{}.Inject(ctx, propagation.MapCarrier(h))
	return h
}

// Chunks splits rows into runs of at most maxRows rows and, unless a run
// is a single row, at most maxBytes bytes of data: the statements that
// insert them stay under the database's limits on parameters and on the
// size of one message.
func Chunks(rows []Row, maxRows, maxBytes int) [][]Row {
	var out [][]Row
	for len(rows) > 0 {
		n, size := 0, 0
		for n < len(rows) && n < maxRows {
			r := &rows[n]
			s := len(r.EventID) + len(r.Destination) + len(r.Key) + len(r.Body) + len(r.Headers)
			if n > 0 && size+s > maxBytes {
				break
			}
			size += s
			n++
		}
		out = append(out, rows[:n:n])
		rows = rows[n:]
	}
	return out
}

// KeyHashes returns the distinct key hashes of rows with a key, sorted, so
// that transactions take their per-key locks in one global order.
func KeyHashes(rows []Row) []int32 {
	seen := map[int32]bool{}
	var out []int32
	for _, r := range rows {
		if len(r.Key) == 0 || seen[r.KeyHash] {
			continue
		}
		seen[r.KeyHash] = true
		out = append(out, r.KeyHash)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// headersVersion is the first byte of an encoded header set.
const headersVersion = 1

// EncodeHeaders encodes h for the headers column: a version byte, then per
// header, in name order, the name and the value, each as its length (an
// unsigned varint) and its bytes. Names and values are bytes, kept as they
// are: NUL and invalid UTF-8 included. It returns nil for no headers.
func EncodeHeaders(h map[string]string) []byte {
	if len(h) == 0 {
		return nil
	}
	names := make([]string, 0, len(h))
	n := 1
	for k, v := range h {
		names = append(names, k)
		n += 2*binary.MaxVarintLen64 + len(k) + len(v)
	}
	slices.Sort(names)
	b := make([]byte, 0, n)
	b = append(b, headersVersion)
	for _, k := range names {
		b = binary.AppendUvarint(b, uint64(len(k)))
		b = append(b, k...)
		b = binary.AppendUvarint(b, uint64(len(h[k])))
		b = append(b, h[k]...)
	}
	return b
}

// ErrCorruptHeaders is returned by DecodeHeaders for bytes EncodeHeaders
// did not make.
var ErrCorruptHeaders = errors.New("corrupt headers")

// DecodeHeaders decodes what EncodeHeaders made; nil or empty is no headers.
func DecodeHeaders(b []byte) (map[string]string, error) {
	if len(b) == 0 {
		return nil, nil
	}
	if b[0] != headersVersion {
		return nil, fmt.Errorf("%w: unknown version %d", ErrCorruptHeaders, b[0])
	}
	b = b[1:]
	h := make(map[string]string)
	next := func() (string, error) {
		n, w := binary.Uvarint(b)
		if w <= 0 || n > uint64(len(b)-w) {
			return "", fmt.Errorf("%w: bad length", ErrCorruptHeaders)
		}
		s := string(b[w : w+int(n)])
		b = b[w+int(n):]
		return s, nil
	}
	for len(b) > 0 {
		k, err := next()
		if err != nil {
			return nil, err
		}
		v, err := next()
		if err != nil {
			return nil, err
		}
		h[k] = v
	}
	return h, nil
}

// Waker is a broadcast wake-up: Wake never blocks, and each subscriber's
// channel holds at most one pending wake.
type Waker struct {
	C chan struct{}
}

// NewWaker returns a Waker.
func NewWaker() *Waker { return &Waker{C: make(chan struct{}, 1)} }

// Wake signals without blocking.
func (w *Waker) Wake() {
	select {
	case w.C <- struct{}{}:
	default:
	}
}

// Sleep waits for d or ctx, whichever ends first, and reports whether ctx is
// still live.
func Sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// OptionFunc returns the function inside an outbox.WriterOption; package
// outbox sets it when it is initialised (this package cannot name the type).
var OptionFunc func(opt any) func(*Config) error

// Apply applies writer options (outbox.WriterOption) over the defaults.
func Apply[O any](opts []O) (Config, error) {
	c := DefaultConfig()
	for _, o := range opts {
		f := OptionFunc(o)
		if f == nil {
			continue
		}
		if err := f(&c); err != nil {
			return c, err
		}
	}
	return c, nil
}
