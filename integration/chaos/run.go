package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net/url"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferrymq/ferry/ferrytest"
	"github.com/ferrymq/ferry/idempotency/pgstore"
	"github.com/ferrymq/ferry/outbox/pgoutbox"
	ferrysqs "github.com/ferrymq/ferry/sqs"
)

// sqsVisibility is the visibility timeout of the run's SQS queue: the
// slow consumer's handler outlasts it, so the loop must extend it.
const sqsVisibility = 2 // seconds

// run breaks each broker of cfg in turn and prints its table to out.
func run(ctx context.Context, cfg config, out io.Writer) ([]*result, error) {
	var results []*result
	for _, kind := range cfg.Brokers {
		r, err := runBroker(ctx, cfg, kind, out)
		if err != nil {
			return results, fmt.Errorf("%s: %w", kind, err)
		}
		r.print(out)
		results = append(results, r)
	}
	if len(results) > 1 {
		fmt.Fprintln(out)
		for _, r := range results {
			fmt.Fprintf(out, "%-9s %s in %s\n", r.Kind, r.verdictWord(), r.Elapsed.Round(time.Second))
		}
	}
	return results, nil
}

// event is a fault on the schedule.
type event struct {
	at     time.Duration
	what   string // kill, outage, restart
	target string // the process to kill
	down   time.Duration
}

// schedule draws the run's faults from the seed: kills with exponential
// gaps over the order service's time (the first one takes the slow
// consumer mid-handler), the outage at 40% of it, and the broker restarts
// spread over it.
func schedule(cfg config, kind string) []event {
	r := mrand.New(mrand.NewPCG(cfg.Seed, uint64(len(kind))*7919))
	var evs []event
	targets := []string{"billing-0", "billing-1", "billing-2", "relay-0", "relay-1"}
	if cfg.KillEvery > 0 {
		t := time.Duration(0)
		first := true
		for {
			t += time.Duration(r.ExpFloat64() * float64(cfg.KillEvery))
			if t >= cfg.Duration {
				break
			}
			tgt := targets[r.IntN(len(targets))]
			if first {
				// The slow consumer, once orders flow: it is mid-handler.
				tgt, first = slowConsumer, false
				t = max(t, cfg.Duration*3/10)
			}
			down := 200*time.Millisecond + time.Duration(r.Float64()*float64(2*time.Second))
			evs = append(evs, event{at: t, what: "kill", target: tgt, down: down})
		}
	}
	if cfg.Outage > 0 {
		evs = append(evs, event{at: cfg.Duration * 6 / 10, what: "outage", down: cfg.Outage})
	}
	// The restarts keep clear of the outage at 60%: the first at 10% of the
	// time (a broker takes 10-20s to come back), the last at 85%.
	for i := range cfg.BrokerRestarts {
		at := cfg.Duration * 10 / 100
		if cfg.BrokerRestarts > 1 {
			at += cfg.Duration * 75 / 100 * time.Duration(i) / time.Duration(cfg.BrokerRestarts-1)
		}
		evs = append(evs, event{at: at, what: "restart"})
	}
	slices.SortFunc(evs, func(a, b event) int { return int(a.at - b.at) })
	return evs
}

func newRunID() string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// withSearchPath returns the PostgreSQL URL with schema as the search path.
func withSearchPath(raw, schema string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return "", err
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	return u.String(), nil
}

const schemaSQL = `
CREATE TABLE orders (
    seq          integer PRIMARY KEY,
    id           text    NOT NULL,
    amount_cents bigint  NOT NULL,
    poison       boolean NOT NULL,
    dup_written  boolean NOT NULL DEFAULT false
);
CREATE TABLE payments ( -- no unique constraint: a double effect is two rows
    id           bigserial,
    order_id     text    NOT NULL,
    event_id     text    NOT NULL,
    amount_cents bigint  NOT NULL,
    consumer     text    NOT NULL,
    attempt      integer NOT NULL,
    paid_at      timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE published ( -- each event a relay's Publish reported taken
    event_id text NOT NULL,
    relay    text NOT NULL,
    at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE deliveries ( -- each delivery that reached a billing handler stack
    event_id text    NOT NULL,
    consumer text    NOT NULL,
    attempt  integer NOT NULL,
    at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE chaos_stats (
    proc        text    NOT NULL,
    incarnation integer NOT NULL,
    name        text    NOT NULL,
    value       bigint  NOT NULL,
    PRIMARY KEY (proc, incarnation, name)
);`

// runBroker runs the whole story on one broker.
func runBroker(ctx context.Context, cfg config, kind string, out io.Writer) (*result, error) {
	start := time.Now()
	runID := newRunID()
	schema := "chaos_" + runID
	progress := func(format string, args ...any) {
		if !cfg.Quiet {
			fmt.Fprintf(out, "[%s %6.1fs] %s\n", kind, time.Since(start).Seconds(), fmt.Sprintf(format, args...))
		}
	}
	runDir, err := os.MkdirTemp("", "ferry-chaos-"+kind+"-")
	if err != nil {
		return nil, err
	}

	// PostgreSQL: a schema of the run's own.
	admin, err := pgxpool.New(ctx, cfg.PostgresURL)
	if err != nil {
		return nil, err
	}
	defer admin.Close()
	if _, err := admin.Exec(ctx, `CREATE SCHEMA `+schema); err != nil {
		return nil, fmt.Errorf("postgres: %w", err)
	}
	pgURL, err := withSearchPath(cfg.PostgresURL, schema)
	if err != nil {
		return nil, err
	}
	pool, err := openPool(ctx, pgURL, "chaos", 4)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, schemaSQL); err != nil {
		return nil, fmt.Errorf("postgres: %w", err)
	}
	if err := pgoutbox.Migrate(ctx, pool); err != nil {
		return nil, err
	}
	if err := pgstore.Migrate(ctx, pool); err != nil {
		return nil, err
	}

	// The broker: the topic or queue, and the dead-letter queue.
	tb, err := ferrytest.Connect(ctx, ferrytest.Kind(kind))
	if err != nil {
		return nil, err
	}
	q, err := tb.NewQueue(ctx, "chaos-"+runID, ferrytest.Partitions(cfg.Partitions))
	if err != nil {
		tb.Close()
		return nil, err
	}
	dlq, err := tb.NewQueue(ctx, "chaos-dlq-"+runID)
	if err != nil {
		tb.Close()
		return nil, err
	}
	if kind == "sqs" {
		if err := setVisibility(ctx, tb, q.Name, sqsVisibility); err != nil {
			tb.Close()
			return nil, err
		}
	}
	cleanup := func(ok bool) {
		if cfg.Keep || !ok && cfg.KeepFailed {
			fmt.Fprintf(out, "[%s] kept: schema %s, queue %s, dead letters %s, logs %s\n", kind, schema, q.Name, dlq.Name, runDir)
			return
		}
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		_ = tb.Close()
		_, _ = admin.Exec(cctx, `DROP SCHEMA `+schema+` CASCADE`)
		_ = os.RemoveAll(runDir)
	}

	base := childConfig{
		Kind: kind, BrokerURL: ferrytest.URL(ferrytest.Kind(kind)), PostgresURL: pgURL,
		Source: q.Name, Destination: q.Destination, DLQ: dlq.Destination, Group: "billing-" + runID,
		RunDir: runDir, Orders: cfg.Orders, Rate: float64(cfg.Orders) / cfg.Duration.Seconds(),
		Poison: cfg.Poison, DupRate: cfg.DupRate, Seed: cfg.Seed, Batch: 10, Slow: cfg.Slow, SlowEvery: cfg.SlowEvery,
		Fault: cfg.Fault, Capacity: cfg.Capacity, KafkaSession: cfg.KafkaSession,
	}
	procs := map[string]*proc{}
	var order []string
	add := func(role, name string) error {
		p, err := newProc(role, name, base, runDir)
		if err != nil {
			return err
		}
		procs[name] = p
		order = append(order, name)
		return p.start()
	}
	for _, n := range []string{"billing-0", "billing-1", "billing-2"} {
		if err := add(roleBilling, n); err != nil {
			return nil, err
		}
	}
	for _, n := range []string{"relay-0", "relay-1"} {
		if err := add(roleRelay, n); err != nil {
			return nil, err
		}
	}
	if err := add(roleOrders, "orders"); err != nil {
		return nil, err
	}
	stopAll := func() {
		var wg sync.WaitGroup
		for _, p := range procs {
			wg.Go(func() { p.stop(cfg.Slow + 10*time.Second) })
		}
		wg.Wait()
	}
	progress("run %s: %d orders over %s; queue %s; logs in %s", runID, cfg.Orders, cfg.Duration, q.Name, runDir)

	res := &result{Kind: kind, Seed: cfg.Seed, Fault: cfg.Fault, Orders: cfg.Orders}
	if cfg.Cluster {
		res.Notes = append(res.Notes, "a three-node cluster: each broker restart is a SIGKILL of a random node, started again 5s later")
	}
	var mu sync.Mutex // guards res's schedule fields below
	var outageEnd time.Time
	var outageSeq int64 // orders committed when the outage ended

	// The schedule.
	evs := schedule(cfg, kind)
	schedDone := make(chan struct{})
	schedCtx, stopSched := context.WithCancel(ctx)
	defer stopSched()
	var restarting sync.WaitGroup
	var events sync.WaitGroup // each fault runs on its own: a broker restart does not delay the kills
	go func() {
		defer close(schedDone)
		defer events.Wait()
		for _, ev := range evs {
			select {
			case <-schedCtx.Done():
				return
			case <-time.After(time.Until(start.Add(ev.at))):
			}
			events.Go(func() {
				switch ev.what {
				case "kill":
					p := procs[ev.target]
					if !p.running() {
						return
					}
					p.kill()
					progress("SIGKILL %s; back in %s", ev.target, ev.down.Round(time.Millisecond))
					restarting.Go(func() {
						time.Sleep(ev.down)
						if err := p.start(); err != nil {
							progress("restart %s: %v", p.name, err)
						}
					})
				case "outage":
					if err := os.WriteFile(outageFile(runDir), nil, 0o644); err != nil {
						progress("outage: %v", err)
						return
					}
					progress("payments API down for %s", ev.down)
					select {
					case <-schedCtx.Done():
					case <-time.After(ev.down):
					}
					_ = os.Remove(outageFile(runDir))
					var n int64
					_ = pool.QueryRow(schedCtx, `SELECT count(*) FROM orders`).Scan(&n)
					mu.Lock()
					outageEnd, outageSeq = time.Now(), n
					mu.Unlock()
					progress("payments API back")
				case "restart":
					svc := strings.TrimSuffix(kind, "-share") // Kafka's share groups restart Kafka
					t0 := time.Now()
					cmd := exec.CommandContext(schedCtx, cfg.BrokersSh, "restart", svc)
					if cfg.RestartCmd != "" {
						cmd = exec.CommandContext(schedCtx, "sh", "-c", cfg.RestartCmd)
						cmd.Env = append(os.Environ(), "FERRY_CHAOS_SERVICE="+svc, "FERRY_CHAOS_BROKERS_SH="+cfg.BrokersSh)
					}
					progress("restarting the broker: %s", strings.Join(cmd.Args, " "))
					outp, err := cmd.CombinedOutput()
					mu.Lock()
					res.BrokerRestarts++
					res.BrokerStops = append(res.BrokerStops, window{From: t0, To: time.Now()})
					mu.Unlock()
					if err != nil {
						progress("broker restart failed: %v: %s", err, strings.TrimSpace(string(outp)))
						mu.Lock()
						res.Notes = append(res.Notes, fmt.Sprintf("broker restart failed: %v", err))
						mu.Unlock()
					} else {
						progress("broker back after %s", time.Since(t0).Round(100*time.Millisecond))
					}
				}
			})
		}
	}()

	// Watch: sample the backlog every second; restart what died by itself.
	var committed, good, unpaid int64
	sample := func() error {
		sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		return pool.QueryRow(sctx, `SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM orders WHERE NOT poison),
			(SELECT count(*) FROM orders o WHERE NOT poison AND NOT EXISTS (SELECT 1 FROM payments p WHERE p.order_id = o.id))`).
			Scan(&committed, &good, &unpaid)
	}
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	ordersDone := false
	var drainStart time.Time
	lastProgress := time.Now()
	for {
		select {
		case <-ctx.Done():
			stopSched()
			stopAll()
			cleanup(false)
			return nil, ctx.Err()
		case <-tick.C:
		}
		if err := sample(); err != nil {
			progress("sample: %v", err)
			continue
		}
		mu.Lock()
		res.PeakLag = max(res.PeakLag, unpaid)
		end, seq := outageEnd, outageSeq
		mu.Unlock()
		// The outage's backlog is drained once every good order committed
		// before it ended is paid.
		if !end.IsZero() && res.DrainAfterOutage == 0 {
			var left int64
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM orders o WHERE seq < $1 AND NOT poison
				AND NOT EXISTS (SELECT 1 FROM payments p WHERE p.order_id = o.id)`, seq).Scan(&left); err == nil && left == 0 {
				res.DrainAfterOutage = time.Since(end)
			}
		}
		for _, name := range order {
			p := procs[name]
			if name == "orders" {
				continue
			}
			if p.exitedByItself() {
				progress("%s exited by itself (code %d: %s); restarting it", name, p.wait(), lastError(runDir+"/"+name+".log"))
				_ = p.start()
			}
		}
		if !ordersDone && !procs["orders"].running() {
			if code := procs["orders"].wait(); procs["orders"].exitedByItself() && code != 0 {
				progress("order service exited with %d; restarting it", code)
				_ = procs["orders"].start()
			} else {
				ordersDone = true
				progress("order service done: %d orders committed", committed)
			}
		}
		select {
		case <-schedDone:
		default:
			if time.Since(lastProgress) >= 5*time.Second {
				progress("committed %d, unpaid good orders %d", committed, unpaid)
				lastProgress = time.Now()
			}
			continue
		}
		if !ordersDone {
			continue
		}
		if drainStart.IsZero() {
			drainStart = time.Now()
			restarting.Wait()
			progress("schedule done; draining %d unpaid good orders", unpaid)
		}
		if time.Since(lastProgress) >= 5*time.Second {
			progress("draining: unpaid good orders %d", unpaid)
			lastProgress = time.Now()
		}
		bl, err := pgoutboxBacklog(ctx, pool)
		if unpaid == 0 && err == nil && bl == 0 {
			break
		}
		if time.Since(drainStart) > cfg.DrainTimeout {
			progress("drain timed out with %d good orders unpaid", unpaid)
			res.Notes = append(res.Notes, fmt.Sprintf("drain timed out after %s", cfg.DrainTimeout))
			break
		}
	}
	res.Drain = time.Since(drainStart)

	// Poison: wait for each to reach the dead-letter queue, then a moment
	// more for late duplicates.
	var poisonCount int64
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM orders WHERE poison`).Scan(&poisonCount)
	var dls []ferrytest.DeadLetter
	deadline := time.Now().Add(max(30*time.Second, cfg.DrainTimeout/3))
	for {
		pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		dls, err = dlq.DeadLetters(pctx)
		cancel()
		if err == nil && int64(len(dls)) >= poisonCount || time.Now().After(deadline) || ctx.Err() != nil {
			break
		}
		time.Sleep(2 * time.Second)
	}
	if err != nil {
		res.Notes = append(res.Notes, fmt.Sprintf("reading the dead-letter queue: %v", err))
	}
	time.Sleep(3 * time.Second)
	stopAll()
	res.Elapsed = time.Since(start)

	if err := gather(ctx, pool, res, dls, procs); err != nil {
		cleanup(false)
		return nil, err
	}
	res.judge()
	cleanup(res.OK())
	return res, nil
}

// lastError returns the last error a child logged, or its last line.
func lastError(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	for i := len(lines) - 1; i >= 0 && i >= len(lines)-20; i-- {
		if strings.Contains(lines[i], "level=ERROR") {
			return lines[i]
		}
	}
	return lines[len(lines)-1]
}

func pgoutboxBacklog(ctx context.Context, pool *pgxpool.Pool) (int64, error) {
	st, err := pgoutbox.NewStore(pool)
	if err != nil {
		return 0, err
	}
	b, err := st.Backlog(ctx)
	return b.Events + b.Failed, err
}

// setVisibility sets the visibility timeout of an SQS queue.
func setVisibility(ctx context.Context, tb *ferrytest.Broker, queue string, seconds int) error {
	sb, ok := tb.Broker.(*ferrysqs.Broker)
	if !ok {
		return fmt.Errorf("sqs: the broker is a %T, not an *sqs.Broker", tb.Broker)
	}
	u, err := sb.Client().GetQueueUrl(ctx, &awssqs.GetQueueUrlInput{QueueName: aws.String(queue)})
	if err != nil {
		return err
	}
	_, err = sb.Client().SetQueueAttributes(ctx, &awssqs.SetQueueAttributesInput{QueueUrl: u.QueueUrl,
		Attributes: map[string]string{"VisibilityTimeout": itoa(seconds)}})
	return err
}
