package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency/pgstore"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
	"github.com/ferrymq/ferry/outbox"
	"github.com/ferrymq/ferry/outbox/pgoutbox"
)

// The environment a child process reads: its role and the run's settings
// (a JSON childConfig).
const (
	envRole   = "FERRY_CHAOS_ROLE"
	envConfig = "FERRY_CHAOS_CONFIG"
)

// Roles of the child processes.
const (
	roleOrders  = "orders"
	roleRelay   = "relay"
	roleBilling = "billing"
)

// Planted faults: a run with one of them must fail.
const (
	faultNone     = ""
	faultNoIdem   = "no-idempotency" // billing pays without the inbox
	faultAckFirst = "ack-first"      // billing consumers ack before the handler runs
)

// childConfig is what a child process is told.
type childConfig struct {
	Name        string // the process's name: orders, relay-0, billing-2
	Incarnation int    // how many times it was started before
	Kind        string // kafka, sqs, rabbitmq
	BrokerURL   string
	PostgresURL string // with the run's schema as search_path
	Source      string // the queue or topic consumers read
	Destination string // where events go (the Source, on every broker)
	DLQ         string // the dead-letter destination
	Group       string // the billing consumers' name (Kafka group)
	RunDir      string // holds the outage flag file

	Orders    int     // orders to commit (order service)
	Rate      float64 // orders per second (order service)
	Poison    float64 // fraction of poison orders
	DupRate   float64 // fraction of good orders whose event is written twice
	Seed      uint64
	Batch     int           // orders per transaction
	Slow      time.Duration // the slow consumer's handler time
	SlowEvery int           // the slow consumer is slow on one order in SlowEvery
	Fault     string
	Capacity  int // billing concurrency

	KafkaSession time.Duration // the billing group's session timeout; 0: the default
}

// outageFile is the flag whose presence makes the payments API fail.
func outageFile(runDir string) string { return runDir + "/payments-down" }

// order is the event's body.
type order struct {
	ID     string `json:"id"`
	Amount int64  `json:"amount_cents"`
	Poison bool   `json:"poison,omitempty"`
}

// runChild runs the role named in the environment; it returns the exit
// code.
func runChild(role string) int {
	var cfg childConfig
	if err := json.Unmarshal([]byte(os.Getenv(envConfig)), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, "chaos child: bad config:", err)
		return 2
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})).With("proc", cfg.Name)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	var err error
	switch role {
	case roleOrders:
		err = runOrders(ctx, cfg, log)
	case roleRelay:
		err = runRelay(ctx, cfg, log)
	case roleBilling:
		err = runBilling(ctx, cfg, log)
	default:
		err = fmt.Errorf("unknown role %q", role)
	}
	if err != nil && ctx.Err() == nil {
		log.Error("child failed", "err", err)
		return 1
	}
	return 0
}

func openPool(ctx context.Context, url, app string, conns int32) (*pgxpool.Pool, error) {
	pc, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	pc.ConnConfig.RuntimeParams["application_name"] = app
	pc.MaxConns = conns
	return pgxpool.NewWithConfig(ctx, pc)
}

// statsWriter flushes a process's counters to the stats table every half
// second (and at exit): a SIGKILL costs at most the last half second.
type statsWriter struct {
	pool *pgxpool.Pool
	cfg  childConfig
	mu   sync.Mutex
	vals map[string]func() int64
}

func (s *statsWriter) add(name string, f func() int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.vals[name] = f
}

func (s *statsWriter) flush(ctx context.Context) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b := &pgx.Batch{}
	for name, f := range s.vals {
		b.Queue(`INSERT INTO chaos_stats (proc, incarnation, name, value) VALUES ($1, $2, $3, $4)
			ON CONFLICT (proc, incarnation, name) DO UPDATE SET value = EXCLUDED.value`,
			s.cfg.Name, s.cfg.Incarnation, name, f())
	}
	_ = s.pool.SendBatch(ctx, b).Close()
}

func (s *statsWriter) run(ctx context.Context) {
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			fctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			s.flush(fctx)
			cancel()
			return
		case <-t.C:
			s.flush(ctx)
		}
	}
}

func newStats(pool *pgxpool.Pool, cfg childConfig) *statsWriter {
	return &statsWriter{pool: pool, cfg: cfg, vals: make(map[string]func() int64)}
}

// plan is the seeded fate of order i: poison, and whether its event is
// written twice.
func plan(seed uint64, i int, poison, dup float64) (isPoison, isDup bool) {
	r := rand.New(rand.NewPCG(seed, uint64(i)))
	p := r.Float64()
	isPoison = p < poison
	isDup = !isPoison && (r.Float64() < dup || i == 3) // at least one, so a run without idempotency always shows it
	return
}

func orderID(i int) string { return fmt.Sprintf("order-%07d", i) }

// runOrders is the order service: it commits each order and its event in
// one transaction, some events a second time in a later one (what a relay
// that died between publish and delete does).
func runOrders(ctx context.Context, cfg childConfig, log *slog.Logger) error {
	pool, err := openPool(ctx, cfg.PostgresURL, cfg.Name, 4)
	if err != nil {
		return err
	}
	defer pool.Close()
	w, err := pgoutbox.NewWriter()
	if err != nil {
		return err
	}
	// Resume after the last committed order: the service may be restarted.
	var next int
	if err := pool.QueryRow(ctx, `SELECT coalesce(max(seq) + 1, 0) FROM orders`).Scan(&next); err != nil {
		return err
	}
	start := time.Now()
	batch := max(cfg.Batch, 1)
	for next < cfg.Orders {
		if cfg.Rate > 0 {
			due := start.Add(time.Duration(float64(next) / cfg.Rate * float64(time.Second)))
			if d := time.Until(due); d > 0 {
				select {
				case <-ctx.Done():
					return ctx.Err()
				case <-time.After(d):
				}
			}
		}
		n := min(batch, cfg.Orders-next)
		var dups []outbox.Event
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			for i := next; i < next+n; i++ {
				poison, dup := plan(cfg.Seed, i, cfg.Poison, cfg.DupRate)
				o := order{ID: orderID(i), Amount: int64(100 + i%9900), Poison: poison}
				body, _ := json.Marshal(o)
				if _, err := tx.Exec(ctx, `INSERT INTO orders (seq, id, amount_cents, poison) VALUES ($1, $2, $3, $4)`,
					i, o.ID, o.Amount, poison); err != nil {
					return err
				}
				ev := outbox.Event{ID: "ev-" + o.ID, Destination: cfg.Destination, Key: o.ID, Body: body,
					Headers: map[string]string{"chaos-order": o.ID}}
				if err := w.Add(ctx, tx, ev); err != nil {
					return err
				}
				if dup {
					dups = append(dups, ev)
				}
			}
			return nil
		})
		if err != nil {
			log.Warn("order transaction failed; retrying", "err", err)
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(200 * time.Millisecond):
			}
			continue
		}
		next += n
		if len(dups) > 0 {
			if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				for _, ev := range dups {
					if err := w.Add(ctx, tx, ev); err != nil {
						return err
					}
				}
				_, err := tx.Exec(ctx, `UPDATE orders SET dup_written = true WHERE id = ANY($1)`, eventOrders(dups))
				return err
			}); err != nil {
				log.Warn("duplicate event transaction failed", "err", err)
			}
		}
	}
	return nil
}

func eventOrders(evs []outbox.Event) []string {
	ids := make([]string, len(evs))
	for i, e := range evs {
		ids[i] = e.Key
	}
	return ids
}

// runRelay is one relay process: it publishes the outbox to the broker.
func runRelay(ctx context.Context, cfg childConfig, log *slog.Logger) error {
	pool, err := openPool(ctx, cfg.PostgresURL, cfg.Name, 4)
	if err != nil {
		return err
	}
	defer pool.Close()
	b, err := ferry.Open(ctx, cfg.BrokerURL)
	if err != nil {
		return err
	}
	defer b.Close()
	st, err := pgoutbox.NewStore(pool)
	if err != nil {
		return err
	}
	r, err := outbox.NewRelay(st, recordingPublisher{Broker: b, pool: pool, name: cfg.Name}, outbox.WithName(cfg.Name), outbox.WithLogger(log),
		outbox.WithLeaseTTL(3*time.Second), outbox.WithBatchSize(200))
	if err != nil {
		return err
	}
	stats := newStats(pool, cfg)
	stats.add("published", func() int64 { return r.Stats().Published })
	stats.add("publish_failures", func() int64 { return r.Stats().PublishFailures })
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	wg.Go(func() { stats.run(sctx) })
	err = r.Run(ctx)
	cancel()
	wg.Wait()
	return err
}

// recordingPublisher notes in the published table each event the broker
// took, by the Publisher's own account: a lost order then tells whether it
// was ever published.
type recordingPublisher struct {
	ferry.Broker
	pool *pgxpool.Pool
	name string
}

func (p recordingPublisher) Publish(ctx context.Context, dest string, msgs ...consumer.Message) error {
	err := p.Broker.Publish(ctx, dest, msgs...)
	failed := map[int]bool{}
	var pe *consumer.PublishError
	switch {
	case err == nil:
	case errors.As(err, &pe):
		for _, f := range pe.Failed {
			failed[f.Index] = true
		}
	default:
		return err
	}
	ids := make([]string, 0, len(msgs))
	for i := range msgs {
		if m := &msgs[i]; !failed[i] {
			ids = append(ids, eventID(m))
		}
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_, _ = p.pool.Exec(rctx, `INSERT INTO published (event_id, relay) SELECT unnest($1::text[]), $2`, ids, p.name)
	return err
}

// eventID is the outbox's id of the event a message carries.
func eventID(m *consumer.Message) string {
	if id, ok := m.Headers[outbox.EventIDHeader]; ok {
		return id
	}
	return m.ID
}

// errUnavailable is the payments API being down: transient, and what the
// breaker counts.
var errUnavailable = errors.New("payments API unavailable")

type ranKey struct{}

// runBilling is one billing consumer process.
func runBilling(ctx context.Context, cfg childConfig, log *slog.Logger) error {
	pool, err := openPool(ctx, cfg.PostgresURL, cfg.Name, int32(cfg.Capacity+4))
	if err != nil {
		return err
	}
	defer pool.Close()
	b, err := openBilling(ctx, cfg, log)
	if err != nil {
		return err
	}
	defer b.Close()

	var paid, suppressed, poison, downCalls atomic.Int64
	timeout := cfg.Slow + 10*time.Second
	stack, err := consumer.Standard(b, cfg.DLQ,
		consumer.StandardRetry(
			consumer.RetryAttempts(3),
			consumer.RetryInitial(50*time.Millisecond),
			consumer.RetryMaxInterval(500*time.Millisecond),
			consumer.RetryRedeliveryMax(2*time.Second)),
		consumer.StandardBreaker(
			consumer.BreakerName("payments"),
			consumer.BreakerFailures(5),
			consumer.BreakerOpenFor(time.Second),
			consumer.BreakerCounts(func(err error) bool {
				return consumer.DefaultBreakerCounts(err) && errors.Is(err, errUnavailable)
			})),
		consumer.StandardDeadLetter(consumer.DeadLetterLogger(log), consumer.DeadLetterConsumerName(cfg.Name)),
		consumer.StandardTimeout(timeout))
	if err != nil {
		return err
	}
	slow := cfg.Slow > 0 && cfg.Name == slowConsumer
	outage := outageFile(cfg.RunDir)
	pay := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if p, ok := ctx.Value(ranKey{}).(*bool); ok {
			*p = true
		}
		var o order
		if err := json.Unmarshal(m.Body, &o); err != nil {
			return consumer.Permanent(fmt.Errorf("undecodable order: %w", err))
		}
		if o.Poison {
			poison.Add(1)
			return consumer.Permanent(fmt.Errorf("order %s: card declined for good (poison order)", o.ID))
		}
		if _, err := os.Stat(outage); err == nil {
			downCalls.Add(1)
			return errUnavailable
		}
		if slow && o.Amount%int64(max(cfg.SlowEvery, 1)) == 0 {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(cfg.Slow):
			}
		}
		if _, err := tx.Exec(ctx, `INSERT INTO payments (order_id, event_id, amount_cents, consumer, attempt) VALUES ($1, $2, $3, $4, $5)`,
			o.ID, eventID(m), o.Amount, cfg.Name, m.Attempt); err != nil {
			return err
		}
		return nil
	}
	var inner consumer.Handler
	if cfg.Fault == faultNoIdem {
		inner = consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return pay(ctx, tx, m) })
		})
	} else {
		if inner, err = pgstore.NewInbox(pool, cfg.Group, pay); err != nil {
			return err
		}
	}
	// count tells a duplicate the inbox suppressed (nil, the handler never
	// ran) and a payment made.
	count := func(next consumer.Handler) consumer.Handler {
		return consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			ran := false
			err := next.Handle(context.WithValue(ctx, ranKey{}, &ran), m)
			if err == nil {
				if ran {
					paid.Add(1)
				} else {
					suppressed.Add(1)
				}
			}
			return err
		})
	}
	// record notes each delivery that reaches the handler stack.
	record := func(next consumer.Handler) consumer.Handler {
		return consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			_, _ = pool.Exec(ctx, `INSERT INTO deliveries (event_id, consumer, attempt) VALUES ($1, $2, $3)`, eventID(m), cfg.Name, m.Attempt)
			return next.Handle(ctx, m)
		})
	}
	h := consumer.Chain(count(inner), stack.Wrap, record)

	// Each order is its own key: per-key order lets a Kafka partition run
	// many orders at once, so the slow consumer does not stall its
	// partitions one record at a time.
	opts := []consumer.Option{consumer.WithName(cfg.Group), consumer.WithConcurrency(cfg.Capacity),
		consumer.WithOrdering(consumer.OrderByKey),
		consumer.WithLogger(log), consumer.WithShutdownGrace(cfg.Slow + 5*time.Second)}
	if cfg.Fault == faultAckFirst {
		opts = append(opts, consumer.WithDeliveryMode(consumer.AtMostOnce))
	}
	c, err := b.NewConsumer(ctx, cfg.Source, opts...)
	if err != nil {
		return err
	}
	stats := newStats(pool, cfg)
	stats.add("paid", paid.Load)
	stats.add("suppressed", suppressed.Load)
	stats.add("poison_runs", poison.Load)
	stats.add("outage_calls", downCalls.Load)
	stats.add("dead_lettered", func() int64 { return stack.DeadLetter.Count() })
	stats.add("held", func() int64 { return c.Stats().Held })
	stats.add("fetched", func() int64 { return c.Stats().Fetched })
	stats.add("lag", func() int64 {
		lctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		l, err := c.Lag(lctx)
		if err != nil {
			return -1
		}
		return l.Messages
	})
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	wg.Go(func() { stats.run(sctx) })
	err = c.Run(ctx, h)
	cancel()
	wg.Wait()
	return err
}

// openBilling opens the billing consumers' broker. On Kafka it is built
// from package kafka, for a session timeout shorter than franz-go's 45s: a
// SIGKILLed member's partitions wait that long before the group hands them
// to the others.
func openBilling(ctx context.Context, cfg childConfig, log *slog.Logger) (ferry.Broker, error) {
	if cfg.Kind != "kafka" || cfg.KafkaSession <= 0 {
		return ferry.Open(ctx, cfg.BrokerURL)
	}
	kb, err := kafka.New(testenv.KafkaBrokers(), kafka.WithLogger(log),
		kafka.WithSessionTimeout(cfg.KafkaSession),
		kafka.WithClientOpts(kgo.HeartbeatInterval(min(time.Second, cfg.KafkaSession/3))))
	if err != nil {
		return nil, err
	}
	return kafkaBroker{kb}, nil
}

type kafkaBroker struct{ *kafka.Broker }

func (k kafkaBroker) NewConsumer(_ context.Context, topic string, opts ...consumer.Option) (*consumer.Loop, error) {
	return k.Broker.NewConsumer(context.Background(), topic, opts...)
}

// slowConsumer is the billing process whose handler outlasts the lease.
const slowConsumer = "billing-2"

func itoa(i int) string { return strconv.Itoa(i) }
