package idempotency

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/ratelog"
)

// Defaults of the middleware's options.
const (
	// DefaultLease is how long a claim holds a key while its handler runs.
	DefaultLease = 5 * time.Minute
	// DefaultRetention is how long a completed key is kept: longer than the
	// 14 days SQS can keep a message.
	DefaultRetention = 15 * 24 * time.Hour
	// DefaultInProgressDelay is how long a duplicate of a key in progress
	// elsewhere waits before it is delivered again.
	DefaultInProgressDelay = 2 * time.Second
)

// settleTimeout bounds Complete and Release, which run even when the
// handler's context has ended (a shutdown must not leave claims behind).
// The memory store, which never blocks, is called without it; the other
// stores wait on the network, and their clients wait on the context's Done,
// so a lazy deadline (as consumer.Timeout's) would arm its timer all the
// same: context.WithTimeout costs them nothing they would notice. A
// variable for the tests.
var settleTimeout = 10 * time.Second

// KeyFunc derives the idempotency key of a message. Returning "" (or an
// error) makes the message a permanent failure: it cannot be deduplicated.
type KeyFunc func(m *consumer.Message) (string, error)

// KeyFromHeader returns a KeyFunc that takes the key from the header named
// name.
func KeyFromHeader(name string) KeyFunc {
	return func(m *consumer.Message) (string, error) { return m.Header(name), nil }
}

// KeyFromMessageID is a KeyFunc that takes the broker's message id.
func KeyFromMessageID(m *consumer.Message) (string, error) { return m.ID, nil }

// DefaultKey is the KeyFunc the middleware uses unless WithKey says
// otherwise: the EventIDHeader, or the broker's message id when the header is
// absent.
func DefaultKey(m *consumer.Message) (string, error) {
	if k := m.Header(EventIDHeader); k != "" {
		return k, nil
	}
	return m.ID, nil
}

// Option configures New. An invalid value makes New fail with a
// *consumer.ConfigError naming the field.
type Option func(*config) error

type config struct {
	key        KeyFunc
	lease      time.Duration
	retention  time.Duration
	inProgress time.Duration
	logger     *slog.Logger
}

// WithKey sets how the key is derived from a message. Default DefaultKey
// (the EventIDHeader, else the broker's message id).
func WithKey(f KeyFunc) Option {
	return func(c *config) error {
		if f == nil {
			return consumer.ConfigErrorf("Key", "must not be nil")
		}
		c.key = f
		return nil
	}
}

// WithLease sets how long a claim holds its key while the handler runs. It
// must be longer than the handler can take: a handler that outlives its lease
// may run a second time elsewhere. Default DefaultLease (5 minutes).
func WithLease(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return consumer.ConfigErrorf("Lease", "must be > 0, got %s", d)
		}
		c.lease = d
		return nil
	}
}

// WithRetention sets how long a completed key is kept. It must outlive the
// longest time the broker can redeliver a message; see the package
// documentation. Default DefaultRetention (15 days).
func WithRetention(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return consumer.ConfigErrorf("Retention", "must be > 0, got %s", d)
		}
		c.retention = d
		return nil
	}
}

// WithInProgressDelay sets how long a duplicate of a key in progress
// elsewhere is deferred before it runs again; less when the holder's lease
// ends sooner. It must be > 0. Default DefaultInProgressDelay (2s).
func WithInProgressDelay(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return consumer.ConfigErrorf("InProgressDelay", "must be > 0, got %s", d)
		}
		c.inProgress = d
		return nil
	}
}

// WithLogger sets where the middleware logs what an operator must know:
// store calls that failed (Warn) and claims lost to an expired lease (Warn),
// a few lines a minute of each kind with the count of those left out.
// Default the logger of the consumer.Loop running the handler
// (consumer.Logger), or slog.Default() outside one.
func WithLogger(l *slog.Logger) Option {
	return func(c *config) error {
		if l == nil {
			return consumer.ConfigErrorf("Logger", "must not be nil")
		}
		c.logger = l
		return nil
	}
}

// Dedup is the idempotency middleware over a [Store], for one namespace.
// Build one with [New]; its [Dedup.Wrap] method is a consumer.Middleware:
//
//	dedup, err := idempotency.New(store, "billing")
//	...
//	h := consumer.Chain(handler, stack.Wrap, dedup.Wrap)
//
// A Dedup counts what it did ([Dedup.Duplicates], [Dedup.Deferred],
// [Dedup.ClaimsLost] and the others) and reports the counts as metrics
// through [Dedup.RegisterMetrics]. It is safe for concurrent use, and one
// Dedup may wrap any number of handlers; they share its counts.
type Dedup struct {
	store  Store
	mem    *memTable // store's table of the namespace, when store is a *MemoryStore
	prefix string    // namespace + ":"
	cfg    config

	completed   atomic.Int64
	duplicates  atomic.Int64
	deferred    atomic.Int64
	claimsLost  atomic.Int64
	released    atomic.Int64
	storeErrors atomic.Int64
	noKey       atomic.Int64

	logs       *ratelog.Limiter
	registered atomic.Bool // RegisterMetrics was called
}

// warn logs a line of kind, rate-limited, through the configured logger or
// the Loop's.
func (d *Dedup) warn(ctx context.Context, kind, msg string, args ...any) {
	ok, left := d.logs.Allow(kind)
	if !ok {
		return
	}
	log := d.cfg.logger
	if log == nil {
		log = consumer.Logger(ctx)
	}
	log.WarnContext(ctx, msg, append(args, "unlogged", left)...)
}

// New returns the idempotency middleware over store. namespace is the
// consumer's name: it prefixes every key, so that two consumers of one event
// each handle it once. It must not be empty and must not contain ':'. An
// invalid argument or option makes New fail with a *consumer.ConfigError
// naming the field.
//
// See the package documentation for what happens to each delivery.
func New(store Store, namespace string, opts ...Option) (*Dedup, error) {
	if store == nil {
		return nil, consumer.ConfigErrorf("Store", "must not be nil")
	}
	if namespace == "" {
		return nil, consumer.ConfigErrorf("Namespace", "must not be empty")
	}
	if strings.Contains(namespace, ":") {
		return nil, consumer.ConfigErrorf("Namespace", "must not contain ':', got %q", namespace)
	}
	c := config{
		key:        DefaultKey,
		lease:      DefaultLease,
		retention:  DefaultRetention,
		inProgress: DefaultInProgressDelay,
	}
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o(&c); err != nil {
			return nil, err
		}
	}
	d := &Dedup{store: store, prefix: namespace + ":", cfg: c, logs: ratelog.New(5, time.Minute)}
	if ms, ok := store.(*MemoryStore); ok {
		d.mem = ms.table(namespace)
	}
	return d, nil
}

// Key returns the namespaced key under which the middleware built by New with
// this namespace records a message whose KeyFunc returned key.
func Key(namespace, key string) string { return namespace + ":" + key }

// Wrap returns next guarded by the middleware: d.Wrap is a
// consumer.Middleware. The Handler it returns has a method
// Unwrap() consumer.Handler that returns next, so that the delivery loop can
// see through it (to the circuit breakers of a chain, for one).
func (d *Dedup) Wrap(next consumer.Handler) consumer.Handler {
	return &handler{d: d, next: next}
}

// Completed returns how many handler runs succeeded and had their key
// recorded as done: the effects that happened, once each.
func (d *Dedup) Completed() int64 { return d.completed.Load() }

// Duplicates returns how many deliveries were acknowledged without running
// the handler, because their key was already done.
func (d *Dedup) Duplicates() int64 { return d.duplicates.Load() }

// Deferred returns how many deliveries were deferred (consumer.Defer)
// because another worker held their key: duplicates that arrived while the
// first copy was still running, or whose holder died and whose claim had not
// yet expired.
func (d *Dedup) Deferred() int64 { return d.deferred.Load() }

// ClaimsLost returns how many handler runs finished after their claim was
// lost: the lease ended before the handler did, and the key was claimed
// again (or expired) meanwhile, so the effect may have happened twice. It
// should stay 0; when it grows, raise the lease (WithLease).
func (d *Dedup) ClaimsLost() int64 { return d.claimsLost.Load() }

// Released returns how many claims were released because the handler
// failed (an error or a panic), so that the redelivery runs it again.
func (d *Dedup) Released() int64 { return d.released.Load() }

// StoreErrors returns how many calls to the store (claim, complete or
// release) failed. A failed claim or completion leaves the message to be
// delivered again (or, when the store refused the data for good, to the
// dead-letter destination); a failed release leaves the key claimed until
// its lease ends.
func (d *Dedup) StoreErrors() int64 { return d.storeErrors.Load() }

// NoKey returns how many messages had no key (ErrNoKey) and failed as
// permanent errors without running the handler.
func (d *Dedup) NoKey() int64 { return d.noKey.Load() }

// handler is what Wrap returns.
type handler struct {
	d    *Dedup
	next consumer.Handler
}

// Unwrap returns the handler the middleware wraps.
func (h *handler) Unwrap() consumer.Handler { return h.next }

// Handle runs next once per key: see the package documentation.
func (h *handler) Handle(ctx context.Context, m *consumer.Message) (err error) {
	d := h.d
	k, err := d.cfg.key(m)
	if err != nil {
		d.noKey.Add(1)
		return consumer.Permanent(fmt.Errorf("%w: %w", ErrNoKey, err))
	}
	if k == "" {
		d.noKey.Add(1)
		return consumer.Permanent(fmt.Errorf("%w (message %q from %q)", ErrNoKey, m.ID, m.Source))
	}
	cl, ref, err := d.claim(ctx, k)
	if err != nil {
		d.storeErrors.Add(1)
		if ctx.Err() == nil {
			d.warn(ctx, "claim", "idempotency: claiming the key failed; the message goes back to the broker",
				"key", quote(d.prefix+k), "id", m.ID, "source", m.Source, "error", err)
		}
		return storeErr("claim", d.prefix+k, err)
	}
	switch cl.Status {
	case Done:
		d.duplicates.Add(1)
		return nil
	case InProgress:
		d.deferred.Add(1)
		delay := d.cfg.inProgress
		if cl.LeaseLeft > 0 && cl.LeaseLeft < delay {
			delay = cl.LeaseLeft
		}
		return consumer.Defer(fmt.Errorf("%w: %s", ErrInProgress, quote(d.prefix+k)), delay)
	case Claimed:
	default:
		return fmt.Errorf("idempotency: claim %s: store answered unknown status %v", quote(d.prefix+k), cl.Status)
	}

	// From here on the claim must be completed or released, whatever the
	// handler does, panics included.
	settled := false
	defer func() {
		if !settled {
			d.release(ctx, k, cl.Token, ref)
		}
	}()
	if herr := h.next.Handle(ctx, m); herr != nil {
		settled = true
		d.release(ctx, k, cl.Token, ref)
		return herr
	}
	settled = true
	if cerr := d.complete(ctx, k, cl.Token, ref); cerr != nil {
		if errors.Is(cerr, ErrNotOwner) {
			d.claimsLost.Add(1)
			d.warn(ctx, "lost", "idempotency: lease expired before the handler finished; the effect may have happened twice, raise the lease",
				"key", quote(d.prefix+k), "id", m.ID, "lease", d.cfg.lease)
		} else {
			d.storeErrors.Add(1)
			d.warn(ctx, "complete", "idempotency: recording the key done failed; the message goes back to the broker and its redelivery runs the handler again",
				"key", quote(d.prefix+k), "id", m.ID, "source", m.Source, "error", cerr)
		}
		return storeErr("complete", d.prefix+k, cerr)
	}
	d.completed.Add(1)
	return nil
}

// claim claims the namespaced key of k. The memory store is called
// directly: it takes the namespace and k apart, so the key is never built,
// and the reference it returns spares complete and release hashing k again
// and parsing the token, which it therefore does not make (cl.Token is
// empty).
func (d *Dedup) claim(ctx context.Context, k string) (Claim, memRef, error) {
	if d.mem != nil {
		if err := ctx.Err(); err != nil {
			return Claim{}, memRef{}, err
		}
		cl, ref := d.mem.claimID(k, d.cfg.lease, false)
		return cl, ref, nil
	}
	cl, err := d.store.Claim(ctx, d.prefix+k, d.cfg.lease)
	return cl, memRef{}, err
}

// complete records k done. It runs even when the handler's context has
// ended (a shutdown must not leave claims behind), bounded by settleTimeout;
// the memory store answers without blocking and needs neither.
func (d *Dedup) complete(ctx context.Context, k, token string, ref memRef) error {
	if d.mem != nil {
		return d.mem.complete(ref, d.cfg.retention)
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
	defer cancel()
	return d.store.Complete(sctx, d.prefix+k, token, d.cfg.retention)
}

// release releases the claim on k after the handler failed, as complete
// runs, and logs a failure: the claim then stays until its lease ends.
func (d *Dedup) release(ctx context.Context, k, token string, ref memRef) {
	var err error
	if d.mem != nil {
		err = d.mem.release(ref)
	} else {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
		err = d.store.Release(sctx, d.prefix+k, token)
		cancel()
	}
	if err == nil {
		d.released.Add(1)
		return
	}
	if errors.Is(err, ErrNotOwner) {
		d.claimsLost.Add(1)
	} else {
		d.storeErrors.Add(1)
	}
	d.warn(ctx, "release", "idempotency: release failed; the key stays claimed until its lease ends",
		"key", quote(d.prefix+k), "error", err)
}

// storeErr wraps an error of the store. It wraps with %w, so an error the
// store marked consumer.Permanent (one no retry can fix, such as a data
// exception of its database) stays permanent (consumer.IsPermanent): the
// message goes to the dead-letter destination and a circuit breaker does not
// count it. Any other error stays a plain error, and the message is
// delivered again.
func storeErr(op, key string, err error) error {
	return fmt.Errorf("idempotency: %s %s: %w", op, quote(key), err)
}

// quoteMax bounds how much of a key an error message quotes.
const quoteMax = 64

// quote returns key quoted for an error message, cut after quoteMax bytes:
// keys may be long, and a dead-letter header carries the error.
func quote(key string) string {
	if len(key) <= quoteMax {
		return strconv.Quote(key)
	}
	return strconv.Quote(key[:quoteMax]) + "... (" + strconv.Itoa(len(key)) + " bytes)"
}
