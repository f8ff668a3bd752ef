package idempotency

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/ferrymq/ferry/consumer"
)

// EventIDHeader is the message header that carries an event's id. Ferry's
// outbox sets it on every event it publishes, and the middleware takes its key
// from it by default.
const EventIDHeader = consumer.EventIDHeader

var (
	// ErrInProgress says another worker holds the claim on the key right now.
	// The middleware returns it wrapped in consumer.Defer.
	ErrInProgress = errors.New("idempotency: key in progress elsewhere")

	// ErrNotOwner says the caller no longer holds the claim it tries to
	// complete or release: its lease expired and the key was claimed again,
	// removed, or completed by someone else.
	ErrNotOwner = errors.New("idempotency: claim not held by this owner")

	// ErrNoKey says no idempotency key could be derived from a message. The
	// middleware returns it wrapped in consumer.Permanent.
	ErrNoKey = errors.New("idempotency: message has no key")
)

// Status is the answer to a claim.
type Status uint8

const (
	// Claimed: the caller now holds the key until its lease ends, and must
	// Complete or Release it.
	Claimed Status = iota + 1
	// InProgress: another owner holds a live claim on the key.
	InProgress
	// Done: the key was completed and is within its retention.
	Done
)

// String returns the status's name: "claimed", "in-progress" or "done".
func (s Status) String() string {
	switch s {
	case Claimed:
		return "claimed"
	case InProgress:
		return "in-progress"
	case Done:
		return "done"
	}
	return fmt.Sprintf("Status(%d)", uint8(s))
}

// Claim is what a Store answers to a claim.
type Claim struct {
	// Status says whether the key was claimed, is held elsewhere, or is done.
	Status Status
	// Token is the owner token of a new claim (Status Claimed), to pass to
	// Complete or Release. It is empty otherwise.
	Token string
	// LeaseLeft is, for Status InProgress, how long the other holder's lease
	// still runs, as far as the store can tell; 0 when it cannot.
	LeaseLeft time.Duration
}

// Store records idempotency keys. A Store is safe for concurrent use by many
// goroutines and, for the shared stores, by many processes.
//
// A key moves through claim, then complete or release:
//
//   - Claim takes the key for lease, unless a live claim or a completion
//     exists. An expired claim (its holder died) is taken over; so is a
//     completion whose retention ended.
//   - Complete records that the holder's handler succeeded; the key stays done
//     for retention.
//   - Release removes the holder's claim after its handler failed, so that the
//     next delivery claims the key again.
//
// Complete and Release succeed only for the holder of the claim, named by the
// token Claim returned; anyone else gets ErrNotOwner. A holder whose lease
// expired but whose key nobody has claimed since still holds it in the
// memory, PostgreSQL and SQLite stores; in Redis the claim ends with its
// lease (the key expires), so such a holder gets ErrNotOwner and its message
// runs again: give claims a lease longer than the handler runs. Errors of
// the store itself (unreachable, timed out) are returned wrapped, and are
// never ErrNotOwner.
//
// A key is any string of bytes: NUL, invalid UTF-8 and any length included
// (Kafka keys, and event ids taken from them, are arbitrary bytes), and two
// keys that differ in any byte are two keys. A store whose backend cannot
// keep such bytes as they are keeps a hash of them (the SQL stores keep the
// SHA-256). An error that no retry can fix (the backend refuses the data) is
// returned marked with consumer.Permanent; the middleware passes it on as
// permanent, so the message goes to the dead-letter destination and a
// circuit breaker does not count it. Any other error is retryable.
type Store interface {
	Claim(ctx context.Context, key string, lease time.Duration) (Claim, error)
	Complete(ctx context.Context, key, token string, retention time.Duration) error
	Release(ctx context.Context, key, token string) error
}

// Cleaner is implemented by stores that remove expired keys on request
// rather than by themselves (the memory, PostgreSQL and SQLite stores; Redis
// expires keys on its own).
type Cleaner interface {
	// Cleanup removes completed keys whose retention ended and claims whose
	// lease ended, and nothing else. It returns how many it removed.
	Cleanup(ctx context.Context) (removed int64, err error)
}

// NewToken returns a fresh random owner token. Stores use it to name a
// claim's holder.
func NewToken() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		// crypto/rand does not fail on supported platforms.
		panic("idempotency: crypto/rand: " + err.Error())
	}
	return hex.EncodeToString(b[:])
}
