package outbox

import (
	"context"
	"time"
)

// Record is one committed, unpublished event as a Store reads it.
type Record struct {
	Event
	// Seq is the event's position in the outbox table: within a lane, the
	// relay publishes records in ascending Seq.
	Seq int64
	// Lane is the event's lane, in [0, Lanes).
	Lane int
	// CreatedAt is when the event was written.
	CreatedAt time.Time
}

// BacklogCountLimit is where a Store stops counting events for Backlog:
// Events and Failed are exact up to it, and a value of BacklogCountLimit
// means that many or more. Counting further would cost a scan of the whole
// table at every metrics collection, just when the backlog is long.
const BacklogCountLimit = 10_000

// Backlog describes the events not yet published.
type Backlog struct {
	// Events is how many events wait to be published, up to
	// BacklogCountLimit, those held until their NotBefore included.
	Events int64
	// OldestAge is how long the longest-waiting of them has been due: the
	// age of the first written, or the time since its NotBefore for an
	// event that was held (an event still held is not due, and does not
	// count); zero when there are none. It is exact however long the
	// backlog: alert on it.
	OldestAge time.Duration
	// Scheduled is how many of Events are held until a NotBefore still
	// ahead, up to BacklogCountLimit.
	Scheduled int64
	// Failed is how many events sit in the failed-events table, up to
	// BacklogCountLimit.
	Failed int64
}

// Store is the relay's access to an outbox's tables. The pgoutbox and
// sqliteoutbox packages implement it; a Relay calls it from one goroutine at a time,
// except Listen, which runs in a goroutine of its own, and Backlog, which
// metrics and callers of Relay.Backlog may call at any time: an
// implementation must be safe for concurrent use.
type Store interface {
	// Lease records owner as a live relay until ttl from now, renews the
	// lanes owner holds, gives back those above its fair share (Lanes divided
	// by the number of live relays, rounded up), claims free or expired lanes
	// up to that share, and returns the lanes owner holds now, sorted.
	Lease(ctx context.Context, owner string, ttl time.Duration) ([]int, error)

	// Release gives back every lane owner holds and forgets owner, so that
	// other relays take its lanes at once.
	Release(ctx context.Context, owner string) error

	// Fetch returns up to max committed events of lanes that are due (no
	// NotBefore, or one past), in ascending Seq.
	Fetch(ctx context.Context, lanes []int, max int) ([]Record, error)

	// Delete removes published events by Seq.
	Delete(ctx context.Context, seqs []int64) error

	// Fail moves the event seq to the failed-events table with reason, which
	// the relay makes text (valid UTF-8 without NUL) first.
	Fail(ctx context.Context, seq int64, reason string) error

	// Backlog reports the events not yet published. It must cost the same
	// however long the backlog: count at most BacklogCountLimit rows of a
	// table, and find the oldest event through an index.
	Backlog(ctx context.Context) (Backlog, error)
}

// Listener is implemented by stores that can tell a relay when events were
// committed (PostgreSQL LISTEN/NOTIFY).
type Listener interface {
	// Listen calls wake whenever events may have been committed, until ctx
	// ends or the connection fails. It calls wake once as soon as it listens,
	// so that events committed while it was not listening are not left to
	// the poll.
	Listen(ctx context.Context, wake func()) error
}
