package idempotency

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/ferrymq/ferry/consumer"
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
const settleTimeout = 10 * time.Second

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

// Option configures the middleware. An invalid value makes New fail with a
// *consumer.ConfigError naming the field.
type Option func(*config) error

type config struct {
	key        KeyFunc
	lease      time.Duration
	retention  time.Duration
	inProgress time.Duration
	logger     *slog.Logger
}

func configErr(field, format string, args ...any) error {
	return &consumer.ConfigError{Field: field, Reason: fmt.Sprintf(format, args...)}
}

// WithKey sets how the key is derived from a message. Default DefaultKey
// (the EventIDHeader, else the broker's message id).
func WithKey(f KeyFunc) Option {
	return func(c *config) error {
		if f == nil {
			return configErr("Key", "must not be nil")
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
			return configErr("Lease", "must be > 0, got %s", d)
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
			return configErr("Retention", "must be > 0, got %s", d)
		}
		c.retention = d
		return nil
	}
}

// WithInProgressDelay sets how long a duplicate of a key in progress
// elsewhere waits before it is delivered again; it waits less when the
// holder's lease ends sooner. Default DefaultInProgressDelay (2s).
func WithInProgressDelay(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return configErr("InProgressDelay", "must be > 0, got %s", d)
		}
		c.inProgress = d
		return nil
	}
}

// WithLogger sets where the middleware logs failures to release or complete
// a claim. Default slog.Default().
func WithLogger(l *slog.Logger) Option {
	return func(c *config) error {
		if l == nil {
			return configErr("Logger", "must not be nil")
		}
		c.logger = l
		return nil
	}
}

// New returns the idempotency middleware over store. namespace is the
// consumer's name: it prefixes every key, so that two consumers of one event
// each handle it once. It must not be empty and must not contain ':'.
//
// See the package documentation for what happens to each delivery.
func New(store Store, namespace string, opts ...Option) (consumer.Middleware, error) {
	if store == nil {
		return nil, configErr("Store", "must not be nil")
	}
	if namespace == "" {
		return nil, configErr("Namespace", "must not be empty")
	}
	if strings.Contains(namespace, ":") {
		return nil, configErr("Namespace", "must not contain ':', got %q", namespace)
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
	if c.logger == nil {
		c.logger = slog.Default()
	}
	prefix := namespace + ":"
	return func(next consumer.Handler) consumer.Handler {
		return &handler{next: next, store: store, prefix: prefix, cfg: c}
	}, nil
}

// Key returns the namespaced key under which the middleware built by New with
// this namespace records a message whose KeyFunc returned key.
func Key(namespace, key string) string { return namespace + ":" + key }

type handler struct {
	next   consumer.Handler
	store  Store
	prefix string
	cfg    config
}

func (h *handler) Handle(ctx context.Context, m *consumer.Message) (err error) {
	k, err := h.cfg.key(m)
	if err != nil {
		return consumer.Permanent(fmt.Errorf("%w: %w", ErrNoKey, err))
	}
	if k == "" {
		return consumer.Permanent(fmt.Errorf("%w (message %q from %q)", ErrNoKey, m.ID, m.Source))
	}
	key := h.prefix + k

	cl, err := h.store.Claim(ctx, key, h.cfg.lease)
	if err != nil {
		return storeErr("claim", key, err)
	}
	switch cl.Status {
	case Done:
		return nil
	case InProgress:
		d := h.cfg.inProgress
		if cl.LeaseLeft > 0 && cl.LeaseLeft < d {
			d = cl.LeaseLeft
		}
		return consumer.Defer(fmt.Errorf("%w: %s", ErrInProgress, quote(key)), d)
	case Claimed:
	default:
		return fmt.Errorf("idempotency: claim %s: store answered unknown status %v", quote(key), cl.Status)
	}

	// From here on the claim must be completed or released, whatever the
	// handler does, panics included.
	settled := false
	defer func() {
		if !settled {
			h.release(ctx, key, cl.Token)
		}
	}()
	if herr := h.next.Handle(ctx, m); herr != nil {
		settled = true
		h.release(ctx, key, cl.Token)
		return herr
	}
	settled = true
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
	defer cancel()
	if cerr := h.store.Complete(sctx, key, cl.Token, h.cfg.retention); cerr != nil {
		if errors.Is(cerr, ErrNotOwner) {
			h.cfg.logger.WarnContext(ctx, "idempotency: lease expired before the handler finished; the effect may have happened twice, raise the lease",
				"key", key, "lease", h.cfg.lease)
		}
		return storeErr("complete", key, cerr)
	}
	return nil
}

func (h *handler) release(ctx context.Context, key, token string) {
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
	defer cancel()
	if err := h.store.Release(sctx, key, token); err != nil {
		// The claim stays until its lease ends; the redelivery waits for it.
		h.cfg.logger.WarnContext(ctx, "idempotency: release failed; the key stays claimed until its lease ends",
			"key", key, "error", err)
	}
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
