package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/ferrymq/ferry/internal/msgmetrics"
	"github.com/ferrymq/ferry/internal/ratelog"
)

// Headers that DeadLetter adds to a dead-lettered message. The body, the key
// and the message's own headers travel unchanged beside them (a header of the
// same name from an earlier dead-lettering is overwritten).
const (
	// HeaderDLQSource is the topic or queue the message came from.
	HeaderDLQSource = "ferry-dlq-source"
	// HeaderDLQMessageID is the broker's id of the original message.
	HeaderDLQMessageID = "ferry-dlq-message-id"
	// HeaderDLQKey is the original message's key (absent when empty).
	HeaderDLQKey = "ferry-dlq-key"
	// HeaderDLQLane is the original lane: the Kafka partition or the SQS FIFO
	// message group (absent where the broker has none).
	HeaderDLQLane = "ferry-dlq-lane"
	// HeaderDLQOffset is the original offset in its lane, in decimal (absent
	// where the broker has none).
	HeaderDLQOffset = "ferry-dlq-offset"
	// HeaderDLQAttempts is how many times the handler ran (Message.Attempt
	// at the last failure), in decimal. It is exact unless
	// HeaderDLQUnseenDeliveries is present.
	HeaderDLQAttempts = "ferry-dlq-attempts"
	// HeaderDLQDeliveries is how many times the broker delivered the message
	// (Message.Deliveries at the last failure), in decimal. It can exceed the
	// runs (a delivery held by an open breaker, or handed back unstarted when
	// a consumer stopped) or fall short of them (Retry's runs within one
	// delivery; Kafka, which counts no deliveries).
	HeaderDLQDeliveries = "ferry-dlq-deliveries"
	// HeaderDLQUnseenDeliveries is how many earlier deliveries nobody
	// recorded the runs of (another process had them and crashed, or the
	// broker carries no count), each counted as one run in
	// HeaderDLQAttempts, in decimal; absent when every run was counted.
	HeaderDLQUnseenDeliveries = "ferry-dlq-unseen-deliveries"
	// HeaderDLQReason is why the message was dead-lettered: "permanent" or
	// "max-attempts".
	HeaderDLQReason = "ferry-dlq-reason"
	// HeaderDLQError is the text of the last error, cut to 2 KiB.
	HeaderDLQError = "ferry-dlq-error"
	// HeaderDLQErrorKind classifies the last error: "permanent", "panic",
	// "timeout" or "error".
	HeaderDLQErrorKind = "ferry-dlq-error-kind"
	// HeaderDLQErrorType is the Go type of the innermost error in the last
	// error's chain, such as "*json.SyntaxError" or "*consumer.PanicError".
	HeaderDLQErrorType = "ferry-dlq-error-type"
	// HeaderDLQFirstFailure is the time of the first failure, RFC 3339 with
	// nanoseconds, UTC. It is exact where the runs were counted (see
	// Message.Attempt). Where an earlier delivery went unseen it is the time
	// the broker took the message (Message.PublishedAt, which no failure can
	// precede), or, where the broker does not say, the first failure known.
	HeaderDLQFirstFailure = "ferry-dlq-first-failure"
	// HeaderDLQLastFailure is the time of the last failure, RFC 3339 with
	// nanoseconds, UTC.
	HeaderDLQLastFailure = "ferry-dlq-last-failure"
	// HeaderDLQPublishedAt is when the broker took the original message,
	// where it says so, RFC 3339 with nanoseconds, UTC.
	HeaderDLQPublishedAt = "ferry-dlq-published-at"
	// HeaderDLQConsumer is the name of the consumer that gave up.
	HeaderDLQConsumer = "ferry-dlq-consumer"
	// HeaderDLQHost is the host name of the process that gave up.
	HeaderDLQHost = "ferry-dlq-host"
)

// Values of HeaderDLQReason.
const (
	DLQReasonPermanent   = "permanent"
	DLQReasonMaxAttempts = "max-attempts"
)

const maxErrorHeader = 2 << 10

// DeadLetter moves a message that cannot be handled to a dead-letter
// destination, and only then acknowledges it.
//
// A message is dead-lettered when its handler failed with a permanent error
// (at once, after one attempt), or when it failed and its attempts are spent.
// It is published through any Publisher to the destination with its body and
// key unchanged and headers that tell what happened (HeaderDLQSource and the
// other HeaderDLQ constants). Only when the publish succeeded does DeadLetter
// return nil, so that the delivery loop acknowledges the original. When the
// publish fails, DeadLetter returns a *DeadLetterError: nothing is
// acknowledged and the message comes back later, to be dead-lettered then.
//
// A message is never dead-lettered when it was held (Hold, from a circuit
// breaker: it was not attempted) or deferred (Defer), nor when the
// delivery's context was cancelled (shutdown, a revoked lane): those go back
// to the broker.
//
// # Counting attempts
//
// Attempts are handler runs: Message.Attempt, which the delivery loop and
// Retry keep (see Message.Attempt for where the count is exact). A message
// is dead-lettered on the failed run whose Attempt reaches MaxAttempts. With
// Retry's 3 runs per delivery and the default MaxAttempts of 10, a message
// gets three deliveries of three runs and a fourth delivery's first run
// before it is given up, so a restart, a crash or an outage in between
// does not spend what it has left.
//
// DeadLetter and Retry find each other through the delivery's context, so
// the rule holds whichever of them is outside: outside Retry, DeadLetter
// tells Retry to stop at MaxAttempts and judges Retry's final error; inside
// Retry, it dead-letters on the run that reaches MaxAttempts (and lets
// earlier failures through for Retry to retry).
//
// Build one with NewDeadLetter; its Wrap method is a Middleware.
type DeadLetter struct {
	deadLetterConfig
	pub  Publisher
	dest string
	host string
	logs *ratelog.Limiter

	registered atomic.Bool // its metrics were registered by hand (Stack.RegisterMetrics)
	count      atomic.Int64
	failures   atomic.Int64
}

// DeadLetterOption configures NewDeadLetter.
type DeadLetterOption func(*deadLetterConfig) error

// deadLetterConfig is what the DeadLetterOptions set.
type deadLetterConfig struct {
	maxAttempts int
	name        string
	logger      *slog.Logger // nil: the Loop's (Logger)
}

// DeadLetterMaxAttempts sets after how many failed runs a message is
// dead-lettered. Default 10: with Retry's default of 3 runs per delivery,
// three deliveries and the first run of a fourth. Allow a few deliveries'
// worth, so that a message redelivered after a crash or an outage still
// has runs left.
func DeadLetterMaxAttempts(n int) DeadLetterOption {
	return func(c *deadLetterConfig) error {
		if n < 1 {
			return ConfigErrorf("DeadLetter.MaxAttempts", "must be >= 1, got %d", n)
		}
		c.maxAttempts = n
		return nil
	}
}

// DeadLetterConsumerName sets the consumer name written in
// HeaderDLQConsumer. Default the name of the Loop running the handler
// (WithName, read through Name), or "ferry" outside a Loop.
func DeadLetterConsumerName(name string) DeadLetterOption {
	return func(c *deadLetterConfig) error {
		if name == "" {
			return ConfigErrorf("DeadLetter.ConsumerName", "must not be empty")
		}
		c.name = name
		return nil
	}
}

// DeadLetterLogger sets where DeadLetter logs each dead-lettering (Warn) and
// each failed dead-letter publish (Error), a few lines a minute of each
// kind, with the count of those left out. Default the logger of the Loop
// running the handler (Logger), or slog.Default() outside one.
func DeadLetterLogger(l *slog.Logger) DeadLetterOption {
	return func(c *deadLetterConfig) error {
		if l == nil {
			return ConfigErrorf("DeadLetter.Logger", "must not be nil")
		}
		c.logger = l
		return nil
	}
}

// NewDeadLetter returns a DeadLetter that publishes through pub to
// destination. It fails with a *ConfigError naming the field when pub is
// nil, destination is empty or an option is invalid.
func NewDeadLetter(pub Publisher, destination string, opts ...DeadLetterOption) (*DeadLetter, error) {
	if pub == nil {
		return nil, ConfigErrorf("DeadLetter.Publisher", "must not be nil")
	}
	if destination == "" {
		return nil, ConfigErrorf("DeadLetter.Destination", "must not be empty")
	}
	host, _ := os.Hostname()
	c := deadLetterConfig{maxAttempts: 10}
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o(&c); err != nil {
			return nil, err
		}
	}
	return &DeadLetter{deadLetterConfig: c, pub: pub, dest: destination, host: host, logs: ratelog.New(5, time.Minute)}, nil
}

// Count returns how many messages this DeadLetter has dead-lettered (each
// publish that succeeded). A count that grows is worth an alert.
func (d *DeadLetter) Count() int64 { return d.count.Load() }

// PublishFailures returns how many dead-letter publishes failed (each left
// its message unacknowledged, to come back later).
func (d *DeadLetter) PublishFailures() int64 { return d.failures.Load() }

// MaxAttempts returns the number of attempts after which a message is
// dead-lettered.
func (d *DeadLetter) MaxAttempts() int { return d.maxAttempts }

// Wrap returns next wrapped in the dead-letter behaviour. d.Wrap is a
// Middleware.
func (d *DeadLetter) Wrap(next Handler) Handler {
	return &deadLetterHandler{d: d, next: next}
}

type deadLetterHandler struct {
	d    *DeadLetter
	next Handler
}

func (h *deadLetterHandler) Handle(ctx context.Context, m *Message) error {
	return h.d.handle(ctx, m, h.next)
}

// Unwrap returns the handler whose failures DeadLetter judges.
func (h *deadLetterHandler) Unwrap() Handler { return h.next }

func (h *deadLetterHandler) deadLetterer() *DeadLetter { return h.d }

// DeadLetterError says a message should have been dead-lettered but the
// publish to the dead-letter destination failed; the message was not
// acknowledged and comes back later. It unwraps to the publish error only:
// the handler's error (Cause) may be permanent, but this failure is not.
type DeadLetterError struct {
	Destination string
	Err         error // the publish error
	Cause       error // the handler's error that made the message dead
}

func (e *DeadLetterError) Error() string {
	return fmt.Sprintf("ferry: dead-letter publish to %q failed: %v (handler error: %v)", e.Destination, e.Err, e.Cause)
}

// Unwrap returns the publish error.
func (e *DeadLetterError) Unwrap() error { return e.Err }

func (d *DeadLetter) handle(ctx context.Context, m *Message, next Handler) error {
	ctx, rec := withRecord(ctx)
	rec.maxAttempts = d.maxAttempts
	err := next.Handle(ctx, m)
	if err == nil || IsHeld(err) || IsDeferred(err) {
		return err // held or deferred: the handler did not run, no attempt spent
	}
	var dle *DeadLetterError
	if errors.As(err, &dle) {
		return err // a DeadLetter inside already tried and failed
	}
	if errors.Is(ctx.Err(), context.Canceled) {
		return err // shutdown or a revoked lane: back to the broker
	}
	reason := DLQReasonMaxAttempts
	if IsPermanent(err) {
		reason = DLQReasonPermanent
	} else if m.Attempt < d.maxAttempts {
		if rec.first.IsZero() {
			rec.failed(time.Now()) // without Retry nobody else notes it
		}
		return err
	}
	return d.deadLetter(ctx, m, rec, reason, err)
}

// Send dead-letters m now, with its story, as if its last run had failed
// with cause: reason "permanent" when cause is permanent (IsPermanent),
// "max-attempts" otherwise. firstFailure, when not zero, is when the
// message first failed, where its runs began before the ones this process
// saw (HeaderDLQFirstFailure); zero takes it from the runs seen. It is for
// middleware that decides a message's runs are over by a rule of its own,
// such as the Kafka adapter's retry topics on their last tier. It returns
// nil once the message is published, and a *DeadLetterError when the
// publish failed (the message should then stay unacknowledged).
func (d *DeadLetter) Send(ctx context.Context, m *Message, cause error, firstFailure time.Time) error {
	if cause == nil {
		return ConfigErrorf("DeadLetter.Send", "needs the error that ended the message's runs")
	}
	ctx, rec := withRecord(ctx)
	if !firstFailure.IsZero() && (rec.first.IsZero() || firstFailure.Before(rec.first)) {
		rec.first = firstFailure
	}
	reason := DLQReasonMaxAttempts
	if IsPermanent(cause) {
		reason = DLQReasonPermanent
	}
	return d.deadLetter(ctx, m, rec, reason, cause)
}

func (d *DeadLetter) deadLetter(ctx context.Context, m *Message, rec *record, reason string, cause error) error {
	if ra, ok := cause.(*RetryAfterError); ok {
		cause = ra.Err // Retry's way of giving the message back, not the story
	}
	now := time.Now()
	first := rec.first
	if first.IsZero() {
		first = now
	}
	if m.unseen > 0 && !m.PublishedAt.IsZero() && m.PublishedAt.Before(first) {
		first = m.PublishedAt
	}
	attempts := max(m.Attempt, 1)

	h := make(map[string]string, len(m.Headers)+16)
	maps.Copy(h, m.Headers)
	h[HeaderDLQSource] = m.Source
	h[HeaderDLQMessageID] = m.ID
	setIf(h, HeaderDLQKey, m.Key)
	setIf(h, HeaderDLQLane, m.Lane)
	if m.Offset >= 0 {
		h[HeaderDLQOffset] = strconv.FormatInt(m.Offset, 10)
	} else {
		delete(h, HeaderDLQOffset)
	}
	h[HeaderDLQAttempts] = strconv.Itoa(attempts)
	h[HeaderDLQDeliveries] = strconv.Itoa(max(m.Deliveries, 1))
	if m.unseen > 0 {
		h[HeaderDLQUnseenDeliveries] = strconv.Itoa(m.unseen)
	} else {
		delete(h, HeaderDLQUnseenDeliveries)
	}
	h[HeaderDLQReason] = reason
	h[HeaderDLQError] = truncateUTF8(cause.Error(), maxErrorHeader)
	h[HeaderDLQErrorKind] = errorKind(cause)
	h[HeaderDLQErrorType] = errorType(cause)
	h[HeaderDLQFirstFailure] = first.UTC().Format(time.RFC3339Nano)
	h[HeaderDLQLastFailure] = now.UTC().Format(time.RFC3339Nano)
	if !m.PublishedAt.IsZero() {
		h[HeaderDLQPublishedAt] = m.PublishedAt.UTC().Format(time.RFC3339Nano)
	} else {
		delete(h, HeaderDLQPublishedAt)
	}
	if d.name != "" {
		h[HeaderDLQConsumer] = d.name
	} else {
		h[HeaderDLQConsumer] = Name(ctx)
	}
	setIf(h, HeaderDLQHost, d.host)

	pubCtx := ctx
	if ctx.Err() != nil {
		// Only a deadline of an outer Timeout gets here; the publish still
		// deserves its own time.
		var cancel context.CancelFunc
		pubCtx, cancel = context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
	}
	if trace.SpanContextFromContext(ctx).IsValid() {
		// The dead letter continues the trace of the run that gave up.
		traceContext.Inject(ctx, propagation.MapCarrier(h))
	}
	msg := Message{ID: m.ID, Key: m.Key, Body: m.Body, Headers: h, Offset: -1}
	if perr := d.pub.Publish(pubCtx, d.dest, msg); perr != nil {
		d.failures.Add(1)
		if ok, left := d.logs.Allow("failed"); ok {
			d.log(ctx).LogAttrs(ctx, slog.LevelError, "ferry: dead-letter publish failed; the message stays unacknowledged",
				slog.String("destination", d.dest), slog.String("source", m.Source), slog.String("id", m.ID),
				slog.Int("attempts", attempts), slog.String("reason", reason), slog.Any("error", perr),
				slog.Int64("unlogged", left))
		}
		return &DeadLetterError{Destination: d.dest, Err: perr, Cause: cause}
	}
	d.count.Add(1)
	rec.deadLettered = true
	addRunEvent(ctx, EventDeadLetter, func() []attribute.KeyValue {
		return deadLetterEventAttrs(destinationName(d.pub, d.dest), reason, attempts, cause)
	})
	if ok, left := d.logs.Allow("lettered:" + reason); ok {
		d.log(ctx).LogAttrs(ctx, slog.LevelWarn, "ferry: message dead-lettered",
			slog.String("destination", d.dest), slog.String("source", m.Source), slog.String("id", m.ID),
			slog.Int("attempts", attempts), slog.String("reason", reason), slog.Any("error", cause),
			slog.Int64("unlogged", left))
	}
	return nil
}

// log is the logger for a line about the run behind ctx.
func (d *DeadLetter) log(ctx context.Context) *slog.Logger {
	if d.logger != nil {
		return d.logger
	}
	return Logger(ctx)
}

func setIf(h map[string]string, k, v string) {
	if v != "" {
		h[k] = v
	} else {
		delete(h, k)
	}
}

// errorKind classifies err for HeaderDLQErrorKind.
func errorKind(err error) string {
	var p *PanicError
	var t *TimeoutError
	switch {
	case IsPermanent(err):
		return "permanent"
	case errors.As(err, &p):
		return "panic"
	case errors.As(err, &t), errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	}
	return "error"
}

// errorType returns the Go type of the innermost error of err's chain,
// following the first branch of a joined error.
func errorType(err error) string { return msgmetrics.InnermostType(err) }

func truncateUTF8(s string, n int) string {
	if len(s) <= n {
		return s
	}
	s = s[:n]
	for i := 0; i < utf8.UTFMax-1 && len(s) > 0; i++ {
		if r, size := utf8.DecodeLastRuneInString(s); r != utf8.RuneError || size != 1 {
			break
		}
		s = s[:len(s)-1] // a rune cut in two
	}
	return strings.ToValidUTF8(s, "")
}
