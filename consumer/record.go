package consumer

import (
	"context"
	"time"
)

// record is what the layers of one delivery share about its runs:
// DeadLetter writes its MaxAttempts, so that Retry stops there; Retry and
// the loop note when runs failed. The delivery loop gives every delivery one
// in its handler's context, so it reaches every layer whatever order they
// were composed in and costs no allocation; outside a loop the first layer
// that needs one adds it.
type record struct {
	maxAttempts int // DeadLetter's MaxAttempts; 0 without DeadLetter
	// deadLettered is set once DeadLetter has published the message: its nil
	// means "settled", and an outer Timeout must not turn it into a failure.
	deadLettered bool
	first, last  time.Time
	// inPlace is set by the loop when it holds the message in place after a
	// failure (a broker that cannot redeliver, such as a Kafka partition):
	// its lane waits for it, and its next runs are made by the loop.
	inPlace bool
	// failMark is what a Breaker noted when a run of the message failed
	// through it: the breaker, and its count of successes then.
	failMark breakerMark
	// runStart is when the latest run under a Timeout began (monoNow), as
	// the Timeout read it for its deadline; Retry above it takes its
	// MaxElapsed from there instead of reading the clock again.
	runStart time.Duration
}

// breakerMark is a Breaker and its count of successful calls at a moment.
type breakerMark struct {
	b         *Breaker
	successes int64
}

type recordKey struct{}

// recordCtx carries a record outside a Loop; one allocation gives both the
// context and the record.
type recordCtx struct {
	context.Context
	rec record
}

func (c *recordCtx) Value(key any) any {
	if _, ok := key.(recordKey); ok {
		return &c.rec
	}
	return c.Context.Value(key)
}

// withRecord returns the delivery's record, adding one to ctx when there is
// none yet.
func withRecord(ctx context.Context) (context.Context, *record) {
	if rec, ok := ctx.Value(recordKey{}).(*record); ok {
		return ctx, rec
	}
	c := &recordCtx{Context: ctx}
	return c, &c.rec
}

// spent reports whether a DeadLetter's MaxAttempts is reached by the
// current run.
func (r *record) spent(m *Message) bool {
	return r.maxAttempts > 0 && m.Attempt >= r.maxAttempts
}

// failed notes a failed run at now.
func (r *record) failed(now time.Time) {
	if r.first.IsZero() {
		r.first = now
	}
	r.last = now
}
