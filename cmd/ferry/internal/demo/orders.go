package demo

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/outbox"
)

// OrderPlaced is the event the order service publishes for each order.
type OrderPlaced struct {
	OrderID     string `json:"order_id"`
	Customer    string `json:"customer"`
	AmountCents int64  `json:"amount_cents"`
}

// Poison kinds: how an order is meant to fail.
const (
	poisonNone = iota
	poisonBadType
	poisonTruncated
	poisonGarbage
	poisonTransient
)

// frozenCustomer is the customer whose account stays under review for the
// whole run: its order fails transiently for ever.
const frozenCustomer = "c-frozen"

// order is one order of the plan.
type order struct {
	id        string
	eventID   string
	customer  string
	amount    int64
	poison    int
	duplicate bool // its event is published twice
}

// body is the event's payload: valid JSON for a good order, something that
// does not decode for the permanent poison kinds.
func (o order) body() []byte {
	switch o.poison {
	case poisonBadType: // a producer that sends the amount as a string
		return fmt.Appendf(nil, `{"order_id":%q,"customer":%q,"amount_cents":"%d.%02d"}`, o.id, o.customer, o.amount/100, o.amount%100)
	case poisonTruncated: // a body cut short
		return fmt.Appendf(nil, `{"order_id":%q,"customer":%q,"amount_c`, o.id, o.customer)
	case poisonGarbage: // not JSON at all
		return fmt.Appendf(nil, "ORDER %s FOR %s", o.id, o.customer)
	}
	b, _ := json.Marshal(OrderPlaced{OrderID: o.id, Customer: o.customer, AmountCents: o.amount})
	return b
}

// wantReason is the dead-letter reason expected for a poison order.
func (o order) wantReason() string {
	if o.poison == poisonTransient {
		return consumer.DLQReasonMaxAttempts
	}
	return consumer.DLQReasonPermanent
}

// plan is every order of a run, drawn from the seed.
type plan struct {
	orders []order
	byID   map[string]*order
}

// newPlan draws n orders from seed: their customers and amounts, three
// orders whose bodies do not decode, one of the frozen customer, and one
// good order in twenty (at least one) whose event is published twice.
func newPlan(n int, seed uint64) *plan {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	p := &plan{orders: make([]order, n), byID: make(map[string]*order, n)}
	for i := range p.orders {
		o := &p.orders[i]
		o.id = fmt.Sprintf("o-%04d", i+1)
		o.eventID = fmt.Sprintf("evt-%04d-placed", i+1)
		o.customer = fmt.Sprintf("c-%02d", rng.IntN(40)+1)
		o.amount = int64(rng.IntN(20000) + 500)
		p.byID[o.id] = o
	}
	perm := rng.Perm(n)
	for k, kind := range []int{poisonBadType, poisonTruncated, poisonGarbage, poisonTransient} {
		o := &p.orders[perm[k]]
		o.poison = kind
		if kind == poisonTransient {
			o.customer = frozenCustomer
		}
	}
	for _, i := range perm[4 : 4+max(n/20, 1)] {
		p.orders[i].duplicate = true
	}
	return p
}

func (p *plan) poison() []*order {
	var out []*order
	for i := range p.orders {
		if p.orders[i].poison != poisonNone {
			out = append(out, &p.orders[i])
		}
	}
	return out
}

func (p *plan) duplicates() map[string]bool {
	out := make(map[string]bool)
	for _, o := range p.orders {
		if o.duplicate {
			out[o.eventID] = true
		}
	}
	return out
}

// orderService commits orders and their events in one transaction each.
type orderService struct {
	dbs       *databases
	db        *sql.DB
	add       addFunc      // adds events in the order's transaction
	store     outbox.Store // the relay's
	queue     string
	committed atomic.Int64
}

const ordersSchema = `CREATE TABLE IF NOT EXISTS orders (
    id           TEXT   NOT NULL PRIMARY KEY,
    customer     TEXT   NOT NULL,
    amount_cents BIGINT NOT NULL,
    created_at   BIGINT NOT NULL
)`

func newOrderService(ctx context.Context, dbs *databases, queue string) (*orderService, error) {
	db, add, store, err := dbs.orders(ctx)
	if err != nil {
		return nil, err
	}
	if _, err := db.ExecContext(ctx, ordersSchema); err != nil {
		_ = dbs.closeDB(db)
		return nil, fmt.Errorf("demo: order service: create orders: %w", err)
	}
	return &orderService{dbs: dbs, db: db, add: add, store: store, queue: queue}, nil
}

func (s *orderService) close() error { return s.dbs.closeDB(s.db) }

// place commits the order row and its event together.
func (s *orderService) place(ctx context.Context, o *order) error {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("demo: place %s: %w", o.id, err)
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(ctx, s.dbs.q(`INSERT INTO orders (id, customer, amount_cents, created_at) VALUES (?, ?, ?, ?)`),
		o.id, o.customer, o.amount, time.Now().UnixMilli()); err != nil {
		return fmt.Errorf("demo: place %s: %w", o.id, err)
	}
	if err := s.add(ctx, tx, outbox.Event{
		ID:          o.eventID,
		Destination: s.queue,
		Key:         o.id,
		Body:        o.body(),
		Headers:     map[string]string{"content-type": "application/json", "event-type": "OrderPlaced"},
	}); err != nil {
		return fmt.Errorf("demo: place %s: %w", o.id, err)
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("demo: place %s: commit: %w", o.id, err)
	}
	s.committed.Add(1)
	return nil
}

// produce commits the orders of p evenly over d from start, and returns
// when all are committed or ctx ends.
func (s *orderService) produce(ctx context.Context, p *plan, start time.Time, d time.Duration) error {
	n := len(p.orders)
	t := time.NewTimer(0)
	defer t.Stop()
	for i := range p.orders {
		at := start.Add(d * time.Duration(i) / time.Duration(n))
		t.Reset(time.Until(at))
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
		if err := s.place(ctx, &p.orders[i]); err != nil {
			return err
		}
	}
	return nil
}

// committedOrders reads the ids of the committed orders.
func (s *orderService) committedOrders(ctx context.Context) ([]string, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT id FROM orders ORDER BY id`)
	if err != nil {
		return nil, fmt.Errorf("demo: read orders: %w", err)
	}
	defer rows.Close()
	var ids []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return nil, fmt.Errorf("demo: read orders: %w", err)
		}
		ids = append(ids, id)
	}
	return ids, rows.Err()
}

// duplicatingPublisher publishes some events twice, as a relay that died
// between its publish and its delete would: the second copy is the same
// message (same id, same ferry-event-id header), published with the relay's
// next batch (or by flush), a little after the first.
type duplicatingPublisher struct {
	pub    consumer.Publisher
	events map[string]bool // event ids to publish twice; read only
	copies atomic.Int64

	mu      sync.Mutex
	done    map[string]bool // event ids whose copy is pending or published
	pending map[string][]consumer.Message
}

func newDuplicatingPublisher(pub consumer.Publisher, events map[string]bool) *duplicatingPublisher {
	return &duplicatingPublisher{pub: pub, events: events, done: make(map[string]bool), pending: make(map[string][]consumer.Message)}
}

// Publish publishes msgs, then the copies held back from earlier calls, and
// holds back a copy of each of msgs to duplicate.
func (p *duplicatingPublisher) Publish(ctx context.Context, dest string, msgs ...consumer.Message) error {
	if err := p.pub.Publish(ctx, dest, msgs...); err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.publishPending(ctx)
	for _, m := range msgs {
		if p.events[m.ID] && !p.done[m.ID] {
			p.done[m.ID] = true
			p.pending[dest] = append(p.pending[dest], m)
		}
	}
	return nil
}

// flush publishes the copies held back.
func (p *duplicatingPublisher) flush(ctx context.Context) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.publishPending(ctx)
}

func (p *duplicatingPublisher) publishPending(ctx context.Context) {
	for dest, copies := range p.pending {
		// The originals are published; a copy that fails to publish is
		// tried again with the next call.
		if err := p.pub.Publish(ctx, dest, copies...); err != nil {
			continue
		}
		p.copies.Add(int64(len(copies)))
		delete(p.pending, dest)
	}
}
