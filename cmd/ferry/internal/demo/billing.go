package demo

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/idempotency"
)

// billingNamespace names the billing service for idempotency: both of its
// instances share it, so an event is paid once by the service, whichever
// instance gets it.
const billingNamespace = "billing"

// inboxTable is the transactional inbox's own keys table: the middleware's
// keys live in sqlitestore.DefaultTable, and the two must not share one.
const inboxTable = "billing_inbox"

// billing is the billing service: the handler both of its consumers run,
// and what it counts.
type billing struct {
	dbs   *databases
	db    *sql.DB
	api   *payments
	stack *consumer.Stack
	store idempotency.Store  // nil without idempotency
	dedup *idempotency.Dedup // nil without idempotency

	handler consumer.Handler
	inboxH  consumer.Handler // nil without idempotency

	paid          atomic.Int64 // payment rows written
	inboxSkipped  atomic.Int64 // duplicates the inbox suppressed
	retries       atomic.Int64 // handler runs after the first for the same event
	mu            sync.Mutex
	runs          map[string]int      // handler runs per event id
	deliveredTo   map[string][]string // message id -> consumers it was delivered to, after the kill
	watchingKills bool
}

func newBilling(ctx context.Context, dbs *databases, c Config, pub consumer.Publisher, dlq string, api *payments, log *slog.Logger) (*billing, error) {
	db, store, err := dbs.billing(ctx, !c.DisableIdempotency)
	if err != nil {
		return nil, err
	}
	b := &billing{dbs: dbs, db: db, store: store, api: api, runs: make(map[string]int), deliveredTo: make(map[string][]string)}
	if err := b.setUp(ctx, c, pub, dlq, log); err != nil {
		_ = b.close()
		return nil, err
	}
	return b, nil
}

func (b *billing) setUp(ctx context.Context, c Config, pub consumer.Publisher, dlq string, log *slog.Logger) error {
	if _, err := b.db.ExecContext(ctx, b.dbs.paymentsSchema()); err != nil {
		return fmt.Errorf("demo: billing: create payments: %w", err)
	}
	timeout := c.handlerTimeout()
	stack, err := consumer.Standard(pub, dlq,
		consumer.StandardRetry(
			consumer.RetryAttempts(3),
			consumer.RetryInitial(100*time.Millisecond),
			consumer.RetryMaxInterval(time.Second),
			consumer.RetryRedeliveryMax(3*time.Second)),
		consumer.StandardBreaker(
			consumer.BreakerName("payments-api"),
			consumer.BreakerFailures(5),
			consumer.BreakerOpenFor(c.openFor()),
			consumer.BreakerCounts(countsAgainstAPI)),
		// DeadLetter's default budget (10 handler runs) outlives the failing
		// runs of an outage before the breaker opens, and a delivery lost
		// with a killed consumer costs one run, not a Retry budget.
		consumer.StandardDeadLetter(consumer.DeadLetterLogger(log)),
		consumer.StandardTimeout(timeout))
	if err != nil {
		return err
	}
	b.stack = stack

	pay := consumer.JSON(b.pay)
	mws := []consumer.Middleware{b.recordDelivery, stack.Wrap}
	if c.DisableIdempotency {
		b.handler = consumer.Chain(pay, mws...)
		return nil
	}
	if b.inboxH, err = b.dbs.inbox(b.db, b.inboxTx); err != nil {
		return err
	}
	// A duplicate that finds its key in progress is deferred: the consumer
	// keeps it and tries again after this delay, spending no attempt.
	b.dedup, err = idempotency.New(b.store, billingNamespace,
		idempotency.WithLease(max(30*time.Second, 4*timeout)),
		idempotency.WithInProgressDelay(timeout*3/5),
		idempotency.WithLogger(log))
	if err != nil {
		return err
	}
	b.handler = consumer.Chain(pay, append(mws, b.dedup.Wrap)...)
	return nil
}

// countsAgainstAPI is the breaker's rule: only the payments API's own
// failures say it is down. The frozen customer's transient error is the
// customer's problem, not the API's.
func countsAgainstAPI(err error) bool {
	return consumer.DefaultBreakerCounts(err) &&
		(errors.Is(err, errUnavailable) || errors.Is(err, context.DeadlineExceeded))
}

type paymentKey struct{}

// payment is what pay hands to the inbox's transaction, and learns back.
type payment struct {
	ev       OrderPlaced
	consumer string
	written  bool
}

// pay handles one OrderPlaced event: charge through the payments API, then
// record the payment.
func (b *billing) pay(ctx context.Context, ev OrderPlaced, m *consumer.Message) error {
	eventID := m.Header(idempotency.EventIDHeader)
	b.mu.Lock()
	b.runs[eventID]++
	again := b.runs[eventID] > 1
	b.mu.Unlock()
	if again {
		b.retries.Add(1)
	}
	if ev.OrderID == "" {
		return consumer.Permanent(errors.New("order_id is empty"))
	}
	if ev.Customer == frozenCustomer {
		return fmt.Errorf("order %s: %w", ev.OrderID, errUnderReview)
	}
	name := consumer.Name(ctx)
	if err := b.api.Charge(ctx, name, ev.OrderID); err != nil {
		return err
	}
	p := &payment{ev: ev, consumer: name}
	var err error
	if b.store == nil {
		err = b.writePlain(ctx, m, p)
	} else {
		err = b.inbox(ctx, m, p)
	}
	if err != nil {
		return err
	}
	if p.written {
		b.paid.Add(1)
	} else {
		b.inboxSkipped.Add(1)
	}
	return nil
}

// inbox writes the payment through the transactional inbox: the event's
// id and the row commit together.
func (b *billing) inbox(ctx context.Context, m *consumer.Message, p *payment) error {
	return b.inboxH.Handle(context.WithValue(ctx, paymentKey{}, p), m)
}

var errNoPayment = errors.New("demo: inbox handler called without a payment")

// inboxTx is the inbox's transaction: the payment row, beside the key the
// inbox already inserted.
func (b *billing) inboxTx(ctx context.Context, tx *sql.Tx, m *consumer.Message) error {
	p, ok := ctx.Value(paymentKey{}).(*payment)
	if !ok {
		return errNoPayment
	}
	if err := b.insertPayment(ctx, tx, m, p); err != nil {
		return err
	}
	p.written = true
	return nil
}

// writePlain writes the payment with no idempotency at all.
func (b *billing) writePlain(ctx context.Context, m *consumer.Message, p *payment) error {
	tx, err := b.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("demo: pay %s: %w", p.ev.OrderID, err)
	}
	defer func() { _ = tx.Rollback() }()
	if err := b.insertPayment(ctx, tx, m, p); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("demo: pay %s: commit: %w", p.ev.OrderID, err)
	}
	p.written = true
	return nil
}

func (b *billing) insertPayment(ctx context.Context, tx *sql.Tx, m *consumer.Message, p *payment) error {
	_, err := tx.ExecContext(ctx, b.dbs.q(`INSERT INTO payments (order_id, event_id, amount_cents, consumer, paid_at) VALUES (?, ?, ?, ?, ?)`),
		p.ev.OrderID, m.Header(idempotency.EventIDHeader), p.ev.AmountCents, p.consumer, time.Now().UnixMilli())
	if err != nil {
		return fmt.Errorf("demo: pay %s: %w", p.ev.OrderID, err)
	}
	return nil
}

// recordDelivery notes, once a consumer was killed, which consumer each
// message is delivered to, to show the survivor taking over.
func (b *billing) recordDelivery(next consumer.Handler) consumer.Handler {
	return consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		b.mu.Lock()
		if b.watchingKills {
			b.deliveredTo[m.ID] = append(b.deliveredTo[m.ID], consumer.Name(ctx))
		}
		b.mu.Unlock()
		return next.Handle(ctx, m)
	})
}

// watchTakeovers starts recording deliveries.
func (b *billing) watchTakeovers() {
	b.mu.Lock()
	b.watchingKills = true
	b.mu.Unlock()
}

// takenOver counts the messages of ids that were delivered to survivor.
func (b *billing) takenOver(ids []string, survivor string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := 0
	for _, id := range ids {
		for _, c := range b.deliveredTo[id] {
			if c == survivor {
				n++
				break
			}
		}
	}
	return n
}

// suppressed is how many duplicates idempotency kept from paying twice.
func (b *billing) suppressed() int64 {
	n := b.inboxSkipped.Load()
	if b.dedup != nil {
		n += b.dedup.Duplicates()
	}
	return n
}

// paymentsPerOrder counts the payment rows of each order.
func (b *billing) paymentsPerOrder(ctx context.Context) (map[string]int, error) {
	rows, err := b.db.QueryContext(ctx, `SELECT order_id, count(*) FROM payments GROUP BY order_id`)
	if err != nil {
		return nil, fmt.Errorf("demo: read payments: %w", err)
	}
	defer rows.Close()
	out := make(map[string]int)
	for rows.Next() {
		var (
			id string
			n  int
		)
		if err := rows.Scan(&id, &n); err != nil {
			return nil, fmt.Errorf("demo: read payments: %w", err)
		}
		out[id] = n
	}
	return out, rows.Err()
}

func (b *billing) close() error {
	if b.store != nil {
		closeStore(b.store)
	}
	return b.dbs.closeDB(b.db)
}

// killable wraps a consumer's driver so that the consumer can be killed:
// from the kill on, nothing it says reaches the broker (no ack, no return,
// no lease extension), as when its process dies. What then becomes of the
// messages it held is the broker's doing: on the memory broker and SQS they
// come back when their visibility timeout ends; on RabbitMQ when the dead
// consumer's channel and connection close; on Kafka when the group gives
// its partitions to the other member, from the last committed offset.
//
// The wrapper offers the loop exactly the optional interfaces of the
// driver it wraps (a lease to extend, revocations, a drain), since the loop
// behaves differently with each: newKillable picks the right one.
type killable struct {
	driver.Driver
	lag driver.LagReporter

	mu       sync.Mutex
	dead     bool
	held     map[any]heldMsg // fetched and not settled (nor revoked)
	orphaned []string        // message ids held at the kill, or fetched after it
	// revokedBefore mirrors the loop: per lane, generations below it were
	// revoked, and the loop drops their messages unsettled.
	revokedBefore map[string]uint64
}

// heldMsg is what the killable notes of a message the loop holds.
type heldMsg struct{ id, lane string }

// newKillable wraps d, and returns the wrapper both as itself and as the
// driver to give the loop.
func newKillable(d driver.Driver) (*killable, driver.Driver) {
	k := &killable{Driver: d, held: make(map[any]heldMsg), revokedBefore: make(map[string]uint64)}
	k.lag, _ = d.(driver.LagReporter)
	if ext, ok := d.(driver.Extender); ok {
		return k, &leasedKillable{killable: k, ext: ext}
	}
	if rev, ok := d.(driver.Revoker); ok {
		rk := &revokingKillable{killable: k, rev: rev, out: make(chan driver.Revocation), stop: make(chan struct{})}
		if dr, ok := d.(driver.Drainer); ok {
			return k, &drainingKillable{revokingKillable: rk, dr: dr}
		}
		return k, rk
	}
	return k, k
}

// leasedKillable is a killable over a driver with leases (memory, SQS).
type leasedKillable struct {
	*killable
	ext driver.Extender
}

func (k *leasedKillable) Lease() time.Duration { return k.ext.Lease() }

func (k *leasedKillable) Extend(ctx context.Context, handles []any, d time.Duration) error {
	if k.isDead() {
		return nil
	}
	return k.ext.Extend(ctx, handles, d)
}

// revokingKillable is a killable over a driver whose broker takes messages
// back (Kafka, RabbitMQ).
type revokingKillable struct {
	*killable
	rev       driver.Revoker
	start     sync.Once
	out       chan driver.Revocation
	stop      chan struct{}
	closeOnce sync.Once
}

// Revoked passes the driver's revocations on, forgetting first what the
// killable held of the revoked lanes: the loop drops those messages
// without settling them, and they are not the consumer's any more.
func (k *revokingKillable) Revoked() <-chan driver.Revocation {
	k.start.Do(func() {
		go func() {
			src := k.rev.Revoked()
			for {
				select {
				case rev := <-src:
					k.forget(rev)
					select {
					case k.out <- rev:
					case <-k.stop:
						return
					}
				case <-k.stop:
					return
				}
			}
		}()
	})
	return k.out
}

// Close stops passing revocations on, then closes the driver.
func (k *revokingKillable) Close() error {
	k.closeOnce.Do(func() { close(k.stop) })
	return k.killable.Close()
}

// forget drops what the killable held of the revoked lanes.
func (k *killable) forget(rev driver.Revocation) {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, lane := range rev.Lanes {
		if rev.Before > k.revokedBefore[lane] {
			k.revokedBefore[lane] = rev.Before
		}
	}
	for h, m := range k.held {
		if slices.Contains(rev.Lanes, m.lane) {
			delete(k.held, h)
		}
	}
}

// drainingKillable is a revokingKillable over a driver that drains what
// its broker pushed ahead (RabbitMQ).
type drainingKillable struct {
	*revokingKillable
	dr driver.Drainer
}

func (k *drainingKillable) Drain(ctx context.Context, dst []driver.Message) ([]driver.Message, error) {
	if k.isDead() {
		return dst, nil // a dead process runs nothing more
	}
	n := len(dst)
	out, err := k.dr.Drain(ctx, dst)
	k.record(out[n:])
	return out, err
}

func (k *killable) isDead() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.dead
}

// record notes messages handed to the loop.
func (k *killable) record(ms []driver.Message) {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, m := range ms {
		k.hold(m)
	}
}

// hold notes m, unless the loop will drop it as fetched under a revoked
// generation of its lane. k.mu is held.
func (k *killable) hold(m driver.Message) {
	if m.Generation != 0 && m.Generation < k.revokedBefore[m.Lane] {
		return
	}
	k.held[m.Handle] = heldMsg{id: m.ID, lane: m.Lane}
}

var errKilled = errors.New("demo: consumer killed")

func (k *killable) Fetch(ctx context.Context, dst []driver.Message, max int) ([]driver.Message, error) {
	n := len(dst)
	out, err := k.Driver.Fetch(ctx, dst, max)
	if len(out) < n {
		return out, err
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, m := range out[n:] {
		if k.dead {
			k.orphaned = append(k.orphaned, m.ID)
		} else {
			k.hold(m)
		}
	}
	if k.dead {
		// A dead process fetches nothing: what it took stays leased.
		return out[:n], errKilled
	}
	return out, err
}

func (k *killable) Settle(ctx context.Context, batch []driver.Settlement) error {
	k.mu.Lock()
	if k.dead {
		k.mu.Unlock()
		return nil
	}
	for _, s := range batch {
		delete(k.held, s.Handle)
	}
	k.mu.Unlock()
	return k.Driver.Settle(ctx, batch)
}

func (k *killable) Lag(ctx context.Context) (driver.Lag, error) {
	if k.lag == nil {
		return driver.Lag{}, consumer.ErrLagUnsupported
	}
	return k.lag.Lag(ctx)
}

// kill cuts the consumer off the broker and returns the ids of the
// messages it held.
func (k *killable) kill() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.dead = true
	for _, m := range k.held {
		k.orphaned = append(k.orphaned, m.id)
	}
	clear(k.held)
	return append([]string(nil), k.orphaned...)
}

// orphans returns the ids of the messages the consumer held when it was
// killed or fetched after.
func (k *killable) orphans() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return append([]string(nil), k.orphaned...)
}
