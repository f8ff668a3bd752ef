package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"go.opentelemetry.io/otel/metric"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/outbox/internal/row"
)

// ErrRelayRunning is returned by [Relay.Run] when the Relay is already
// running.
var ErrRelayRunning = errors.New("outbox: relay is already running")

// Option configures a Relay. An option given a bad value makes [NewRelay]
// fail with a *consumer.ConfigError naming the field; a nil Option changes
// nothing.
type Option func(*relayConfig) error

type relayConfig struct {
	name           string
	batch          int
	poll           time.Duration
	ttl            time.Duration
	backoffMin     time.Duration
	backoffMax     time.Duration
	publishTimeout time.Duration
	listen         bool
	logger         *slog.Logger
	meterProvider  metric.MeterProvider
}

// WithName names the relay in the lanes table, in logs and in metrics. Names
// must differ between relays of one outbox; a name is text (UTF-8 without
// NUL) of at most 200 bytes. Default the host name, the process id and a
// random suffix.
func WithName(name string) Option {
	return func(c *relayConfig) error {
		switch {
		case name == "":
			return consumer.ConfigErrorf("Name", "must not be empty")
		case len(name) > 200:
			return consumer.ConfigErrorf("Name", "is %d bytes long, more than 200", len(name))
		case !utf8.ValidString(name) || strings.IndexByte(name, 0) >= 0:
			return consumer.ConfigErrorf("Name", "%q is not text: invalid UTF-8 or NUL", name)
		}
		c.name = name
		return nil
	}
}

// WithBatchSize sets how many events the relay reads at once and hands to
// one Publish call (per destination). Default 100.
func WithBatchSize(n int) Option {
	return func(c *relayConfig) error {
		if n <= 0 {
			return consumer.ConfigErrorf("BatchSize", "must be > 0, got %d", n)
		}
		c.batch = n
		return nil
	}
}

// WithPollInterval sets how long an idle relay waits before it looks for
// events again without being woken. Default 1s.
func WithPollInterval(d time.Duration) Option {
	return func(c *relayConfig) error {
		if d <= 0 {
			return consumer.ConfigErrorf("PollInterval", "must be > 0, got %s", d)
		}
		c.poll = d
		return nil
	}
}

// WithLeaseTTL sets how long a relay's hold on its lanes lasts without being
// renewed; the relay renews every third of it, and before a publish when
// less than the publish timeout is left. A relay that dies loses its lanes
// to the others after at most this long plus one renewal period. It must be
// at least 100ms, and at least five fourths of the publish timeout when
// [WithPublishTimeout] sets one. Default 5s.
func WithLeaseTTL(d time.Duration) Option {
	return func(c *relayConfig) error {
		if d < 100*time.Millisecond {
			return consumer.ConfigErrorf("LeaseTTL", "must be >= 100ms, got %s", d)
		}
		c.ttl = d
		return nil
	}
}

// WithBackoff sets the delay after a failed publish or database call: min
// doubled per consecutive failure up to max, each delay drawn at random from
// its upper half (so never below half of it: no busy loop). Default 100ms up
// to 10s.
func WithBackoff(min, max time.Duration) Option {
	return func(c *relayConfig) error {
		if min <= 0 {
			return consumer.ConfigErrorf("Backoff", "min must be > 0, got %s", min)
		}
		if max < min {
			return consumer.ConfigErrorf("Backoff", "max %s is below min %s", max, min)
		}
		c.backoffMin, c.backoffMax = min, max
		return nil
	}
}

// WithPublishTimeout sets how long one Publish call may take: its context
// ends that long after the call. The relay holds its lanes' lease for at
// least that long, with a tenth of the TTL to spare, by renewing the lease
// before a call when less is left, so d must be at most four fifths of the
// lease TTL (see [WithLeaseTTL]); NewRelay fails with a *consumer.ConfigError
// otherwise. Only a renewal slow enough to eat into that spare time makes a
// call shorter. A call that times out is retried with backoff, and what it
// published may be published again. Default half the lease TTL (2.5s with
// the default TTL).
func WithPublishTimeout(d time.Duration) Option {
	return func(c *relayConfig) error {
		if d <= 0 {
			return consumer.ConfigErrorf("PublishTimeout", "must be > 0, got %s", d)
		}
		c.publishTimeout = d
		return nil
	}
}

// WithListen chooses whether the relay waits for commit notifications when
// its Store offers them (PostgreSQL LISTEN/NOTIFY, the SQLite in-process
// wake). Default true; without it the relay polls only.
func WithListen(on bool) Option {
	return func(c *relayConfig) error {
		c.listen = on
		return nil
	}
}

// WithLogger sets where the relay logs. Default slog.Default().
func WithLogger(l *slog.Logger) Option {
	return func(c *relayConfig) error {
		if l == nil {
			return consumer.ConfigErrorf("Logger", "must not be nil")
		}
		c.logger = l
		return nil
	}
}

// RelayStats is a snapshot of a Relay's counters.
type RelayStats struct {
	Published       int64 // events published and deleted
	PublishCalls    int64 // calls to Publisher.Publish
	PublishFailures int64 // Publish calls that failed (in part or in whole)
	Failed          int64 // events moved to the failed-events table
	StoreErrors     int64 // failed database calls
	Lanes           int   // lanes held now
}

// Relay publishes committed outbox events through a [consumer.Publisher] and
// deletes them once the publisher confirmed. See the package documentation
// for the guarantees. Build one with [NewRelay] and run it with [Relay.Run].
type Relay struct {
	store Store
	pub   consumer.Publisher
	cfg   relayConfig

	running atomic.Bool

	published, calls, pubFailures, failed, storeErrs atomic.Int64
	lanes                                            atomic.Int64

	// crashAfterPublish, set by tests, runs after a publish was confirmed
	// and before the delete; when it returns true the relay stops right
	// there, as if its process had died.
	crashAfterPublish func() bool
}

// NewRelay returns a relay that reads events from store and publishes them
// through pub. It fails with a *consumer.ConfigError naming the field when
// store or pub is nil or an option is invalid.
func NewRelay(store Store, pub consumer.Publisher, opts ...Option) (*Relay, error) {
	if store == nil {
		return nil, consumer.ConfigErrorf("Store", "must not be nil")
	}
	if pub == nil {
		return nil, consumer.ConfigErrorf("Publisher", "must not be nil")
	}
	host, _ := os.Hostname()
	c := relayConfig{
		name:       host + "-" + strconv.Itoa(os.Getpid()) + "-" + row.NewID()[:8],
		batch:      100,
		poll:       time.Second,
		ttl:        5 * time.Second,
		backoffMin: 100 * time.Millisecond,
		backoffMax: 10 * time.Second,
		listen:     true,
	}
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o(&c); err != nil {
			return nil, err
		}
	}
	if c.publishTimeout == 0 {
		c.publishTimeout = c.ttl / 2
	}
	if limit := c.ttl * 4 / 5; c.publishTimeout > limit {
		return nil, consumer.ConfigErrorf("PublishTimeout", "%s does not fit in the lease TTL %s: must be at most %s (four fifths of it); raise WithLeaseTTL or lower WithPublishTimeout",
			c.publishTimeout, c.ttl, limit)
	}
	if c.logger == nil {
		c.logger = slog.Default()
	}
	c.logger = c.logger.With("relay", c.name)
	return &Relay{store: store, pub: pub, cfg: c}, nil
}

// Name returns the relay's name, as it appears in the lanes table.
func (r *Relay) Name() string { return r.cfg.name }

// Stats returns the relay's counters.
func (r *Relay) Stats() RelayStats {
	return RelayStats{
		Published:       r.published.Load(),
		PublishCalls:    r.calls.Load(),
		PublishFailures: r.pubFailures.Load(),
		Failed:          r.failed.Load(),
		StoreErrors:     r.storeErrs.Load(),
		Lanes:           int(r.lanes.Load()),
	}
}

// Backlog reports how many events wait (up to [BacklogCountLimit]), how old
// the oldest is, and how many sit in the failed-events table, through the
// relay's Store. It may be called at any time, running or not.
func (r *Relay) Backlog(ctx context.Context) (Backlog, error) { return r.store.Backlog(ctx) }

type backoff struct {
	min, max time.Duration
	n        int
}

func (b *backoff) next() time.Duration {
	d := b.min << min(b.n, 30)
	if d > b.max || d <= 0 {
		d = b.max
	}
	b.n++
	half := d / 2
	return half + rand.N(d-half+1)
}

func (b *backoff) reset() { b.n = 0 }

var errCrashed = errors.New("outbox: relay stopped by crash hook")

// Run publishes events until ctx ends, then gives back its lanes and
// returns nil. Database and publisher failures are logged, counted and
// retried with backoff; Run does not return because of them.
func (r *Relay) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return ErrRelayRunning
	}
	defer r.running.Store(false)

	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() {
		cancel()
		wg.Wait()
	}()

	if reg, err := r.registerMetrics(); err != nil {
		r.cfg.logger.Warn("outbox: metrics not registered", "err", err)
	} else {
		defer reg.Unregister()
	}

	waker := row.NewWaker()
	if l, ok := r.store.(Listener); ok && r.cfg.listen {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.listen(ctx, l, waker.Wake)
		}()
	}

	err := r.loop(ctx, waker.C)
	r.lanes.Store(0)
	if errors.Is(err, errCrashed) {
		return nil // a simulated crash gives nothing back
	}
	rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer rcancel()
	if err := r.store.Release(rctx, r.cfg.name); err != nil {
		r.cfg.logger.Warn("outbox: releasing lanes failed; they expire by themselves", "err", err)
	}
	return nil
}

func (r *Relay) listen(ctx context.Context, l Listener, wake func()) {
	bo := backoff{min: r.cfg.backoffMin, max: r.cfg.backoffMax}
	for {
		start := time.Now()
		err := l.Listen(ctx, wake)
		if ctx.Err() != nil {
			return
		}
		if time.Since(start) > r.cfg.backoffMax {
			bo.reset()
		}
		r.cfg.logger.Warn("outbox: listening for commits failed; polling meanwhile", "err", err)
		if !row.Sleep(ctx, bo.next()) {
			return
		}
	}
}

func (r *Relay) loop(ctx context.Context, wake <-chan struct{}) error {
	var (
		lanes      []int
		leaseUntil time.Time
		nextLease  time.Time
		retryAt    time.Time
		leaseBo    = backoff{min: r.cfg.backoffMin, max: r.cfg.backoffMax}
		workBo     = backoff{min: r.cfg.backoffMin, max: r.cfg.backoffMax}
		margin     = r.cfg.ttl / 10
		log        = r.cfg.logger
	)
	// wait blocks until until, a wake (when woken is true), or ctx's end.
	wait := func(until time.Time, woken bool) {
		d := time.Until(until)
		if d <= 0 {
			return
		}
		t := time.NewTimer(d)
		defer t.Stop()
		var w <-chan struct{}
		if woken {
			w = wake
		}
		select {
		case <-ctx.Done():
		case <-t.C:
		case <-w:
		}
	}
	for ctx.Err() == nil {
		now := time.Now()
		renewed := false
		if !now.Before(nextLease) {
			renewed = true
			held, err := r.store.Lease(ctx, r.cfg.name, r.cfg.ttl)
			if err != nil {
				if ctx.Err() != nil {
					break
				}
				r.storeErrs.Add(1)
				log.Warn("outbox: renewing lane leases failed; letting go of every lane until a renewal succeeds", "err", err)
				// The renewal may have committed all the same, handing some
				// lanes to another relay: publishing from the old list could
				// put two relays on one lane.
				lanes = nil
				nextLease = time.Now().Add(min(leaseBo.next(), r.cfg.ttl/3))
			} else {
				leaseBo.reset()
				if len(held) != len(lanes) {
					log.Debug("outbox: lanes held", "lanes", len(held))
				}
				lanes, leaseUntil, nextLease = held, now.Add(r.cfg.ttl), now.Add(r.cfg.ttl/3)
			}
		}
		if time.Now().After(leaseUntil.Add(-margin)) {
			lanes = nil // our hold may have passed to another relay
		}
		r.lanes.Store(int64(len(lanes)))
		if len(lanes) == 0 {
			wait(nextLease, false)
			continue
		}
		if time.Now().Before(retryAt) {
			wait(minTime(retryAt, nextLease), false)
			continue
		}
		recs, err := r.store.Fetch(ctx, lanes, r.cfg.batch)
		if err != nil {
			if ctx.Err() != nil {
				break
			}
			r.storeErrs.Add(1)
			log.Warn("outbox: reading events failed", "err", err)
			retryAt = time.Now().Add(workBo.next())
			continue
		}
		if len(recs) == 0 {
			workBo.reset()
			wait(minTime(time.Now().Add(r.cfg.poll), nextLease), true)
			continue
		}
		if time.Until(leaseUntil.Add(-margin)) < r.cfg.publishTimeout && !renewed {
			// Too little of the lease is left for a whole publish: renew
			// it first, and read again (the lanes may change).
			nextLease = time.Now()
			continue
		}
		err = r.ship(ctx, recs, leaseUntil.Add(-margin))
		switch {
		case errors.Is(err, errCrashed):
			return err
		case err != nil:
			if ctx.Err() != nil {
				break
			}
			log.Warn("outbox: publishing failed; will retry", "err", err)
			retryAt = time.Now().Add(workBo.next())
		default:
			workBo.reset()
		}
	}
	return nil
}

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

// cut returns the longest prefix of recs in which no key goes to two
// destinations, so that publishing it destination by destination keeps every
// key's order.
func cut(recs []Record) []Record {
	dest := make(map[string]string)
	for i, rec := range recs {
		if rec.Key == "" {
			continue
		}
		if d, ok := dest[rec.Key]; ok && d != rec.Destination {
			return recs[:i]
		}
		dest[rec.Key] = rec.Destination
	}
	return recs
}

func toMessage(rec *Record) consumer.Message {
	h := make(map[string]string, len(rec.Headers)+1)
	for k, v := range rec.Headers {
		h[k] = v
	}
	h[EventIDHeader] = rec.ID
	return consumer.Message{
		ID:          rec.ID,
		Key:         rec.Key,
		Body:        rec.Body,
		Headers:     h,
		Source:      rec.Destination,
		Offset:      -1,
		PublishedAt: rec.CreatedAt,
	}
}

type failure struct {
	seq    int64
	reason string
}

// asText makes a publisher's reason storable as text: the error may quote
// the event's bytes, and a database's text column takes neither NUL nor
// invalid UTF-8.
func asText(reason string) string {
	return strings.ReplaceAll(strings.ToValidUTF8(reason, "\uFFFD"), "\x00", `\x00`)
}

// ship publishes recs and deletes what the publisher confirmed. It returns an
// error when some events could not be published for now. The publish gets
// the publish timeout, and never runs past leaseEnd (which the loop keeps
// later than that, but for a slow renewal).
func (r *Relay) ship(ctx context.Context, recs []Record, leaseEnd time.Time) error {
	recs = cut(recs)
	deadline := minTime(leaseEnd, time.Now().Add(r.cfg.publishTimeout))
	pctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()

	// Group by destination, keeping the order inside each group.
	var order []string
	groups := make(map[string][]*Record)
	for i := range recs {
		d := recs[i].Destination
		if _, ok := groups[d]; !ok {
			order = append(order, d)
		}
		groups[d] = append(groups[d], &recs[i])
	}

	var (
		done    []int64
		fails   []failure
		lastErr error
	)
	for _, d := range order {
		d, f, err := r.publish(pctx, d, groups[d])
		done = append(done, d...)
		fails = append(fails, f...)
		if err != nil {
			lastErr = err
		}
	}

	if r.crashAfterPublish != nil && r.crashAfterPublish() {
		return errCrashed
	}

	// The publisher confirmed: record that even if ctx ended meanwhile, so a
	// shutdown does not cause duplicates.
	sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer scancel()
	if len(done) > 0 {
		if err := r.store.Delete(sctx, done); err != nil {
			r.storeErrs.Add(1)
			return fmt.Errorf("outbox: deleting %d published events (they will be published again): %w", len(done), err)
		}
		r.published.Add(int64(len(done)))
	}
	for _, f := range fails {
		if err := r.store.Fail(sctx, f.seq, asText(f.reason)); err != nil {
			r.storeErrs.Add(1)
			return fmt.Errorf("outbox: moving event %d to the failed events: %w", f.seq, err)
		}
		r.failed.Add(1)
		r.cfg.logger.Error("outbox: event refused for good; moved to the failed events", "seq", f.seq, "reason", f.reason)
	}
	return lastErr
}

// publish sends one destination's records and sorts them into confirmed,
// refused for good, and left for a retry. A key with a record left for retry
// keeps its later records too, even if the publisher took them, so that they
// are published again after it.
func (r *Relay) publish(ctx context.Context, dest string, recs []*Record) (done []int64, fails []failure, err error) {
	msgs := make([]consumer.Message, len(recs))
	for i, rec := range recs {
		msgs[i] = toMessage(rec)
	}
	r.calls.Add(1)
	perr := r.pub.Publish(ctx, dest, msgs...)
	if perr == nil {
		for _, rec := range recs {
			done = append(done, rec.Seq)
		}
		return done, nil, nil
	}
	r.pubFailures.Add(1)

	var pe *consumer.PublishError
	if errors.As(perr, &pe) && len(pe.Failed) == 0 {
		// A partial failure that names no message: take it as a failure of
		// the whole call, to be retried, rather than as a success.
		return nil, nil, fmt.Errorf("outbox: publish to %s: %w", dest, perr)
	}
	if pe != nil {
		failed := make(map[int]error, len(pe.Failed))
		for _, f := range pe.Failed {
			failed[f.Index] = f.Err
		}
		blocked := make(map[string]bool)
		for i, rec := range recs {
			ferr, bad := failed[i]
			if bad && ferr == nil {
				ferr = errors.New("the publisher reported a failure without an error")
			}
			switch {
			case bad && consumer.IsPermanent(ferr):
				fails = append(fails, failure{rec.Seq, ferr.Error()})
			case bad:
				err = ferr
				if rec.Key != "" {
					blocked[rec.Key] = true
				}
			case rec.Key != "" && blocked[rec.Key]:
				// published after an earlier event of its key failed: keep
				// it, to publish it again after that one.
			default:
				done = append(done, rec.Seq)
			}
		}
		if err != nil {
			err = fmt.Errorf("outbox: publish to %s: %w", dest, perr)
		}
		return done, fails, err
	}

	if consumer.IsPermanent(perr) {
		if len(recs) == 1 {
			return nil, []failure{{recs[0].Seq, perr.Error()}}, nil
		}
		// The publisher refused the batch without saying which event was
		// at fault: find out one at a time.
		blocked := make(map[string]bool)
		for _, rec := range recs {
			if rec.Key != "" && blocked[rec.Key] {
				continue
			}
			d, f, e := r.publish(ctx, dest, []*Record{rec})
			done = append(done, d...)
			fails = append(fails, f...)
			if e != nil {
				err = e
				if rec.Key != "" {
					blocked[rec.Key] = true
				}
			}
		}
		return done, fails, err
	}
	return nil, nil, fmt.Errorf("outbox: publish %d events to %s: %w", len(recs), dest, perr)
}
