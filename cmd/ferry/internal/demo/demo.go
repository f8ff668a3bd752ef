package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/brokerkind"
	"github.com/ferrymq/ferry/outbox"
)

// Names of the queues on the memory broker (a real broker gets names of
// the run's own), and of the two billing consumers.
const (
	OrdersQueue     = "orders"
	DeadLetterQueue = "orders.dlq"
	Survivor        = "billing-1"
	Victim          = "billing-2"
)

// Run runs the demo (see the package documentation) and returns its
// verdict. It fails with a *consumer.ConfigError when cfg is invalid, with
// ctx's error when ctx ends first, and with an error when the machinery of
// the demo itself fails (a temporary folder, a database, a broker that does
// not answer); a broken invariant is not an error but a Verdict whose OK is
// false. A Config.Broker URL that ferry.Open refuses fails with its
// *ferry.URLError (errors.Is ferry.ErrBadURL).
//
// Everything Run starts has stopped when it returns, its temporary folder
// is removed, and the queues (or topics) it made on a real broker are
// deleted.
func Run(ctx context.Context, cfg Config) (Verdict, error) {
	if err := cfg.Validate(); err != nil {
		return Verdict{}, err
	}
	if cfg.Out == nil {
		cfg.Out = io.Discard
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	dir, err := os.MkdirTemp("", "ferry-demo-")
	if err != nil {
		return Verdict{}, fmt.Errorf("demo: temporary folder: %w", err)
	}
	defer os.RemoveAll(dir)

	d, err := setUp(ctx, cfg, dir)
	if err != nil {
		return Verdict{}, err
	}
	defer d.close()
	return d.run(ctx)
}

// run is one run's parts.
type run struct {
	cfg     Config
	dir     string
	log     *slog.Logger
	out     *printer
	plan    *plan
	site    *site
	dbs     *databases
	orders  *orderService
	relay   *outbox.Relay
	dup     *duplicatingPublisher
	api     *payments
	trap    *trap
	billing *billing
	loop1   *consumer.Loop
	loop2   *consumer.Loop
	victim  *killable
	victimB ferry.Broker // the victim's own connection (the site's broker on memory)
	dlq     *dlqReader   // nil on the memory broker, whose queues can be read in place
	clock   clock

	mu          sync.Mutex
	killedOrder string
	killed      bool
}

func setUp(ctx context.Context, cfg Config, dir string) (_ *run, err error) {
	r := &run{
		cfg: cfg, dir: dir, log: cfg.Logger,
		out:  &printer{out: cfg.Out, term: cfg.IsTerminal, quiet: cfg.Quiet, width: cfg.Width},
		plan: newPlan(cfg.Orders, cfg.Seed),
	}
	defer func() {
		if err != nil {
			r.close()
		}
	}()

	if r.site, err = openSite(ctx, cfg); err != nil {
		return nil, err
	}
	if r.dbs, err = openDatabases(ctx, cfg, dir); err != nil {
		return nil, err
	}
	if r.orders, err = newOrderService(ctx, r.dbs, r.site.orders); err != nil {
		return nil, err
	}
	r.dup = newDuplicatingPublisher(r.site.b, r.plan.duplicates())
	if r.relay, err = outbox.NewRelay(r.orders.store, r.dup,
		outbox.WithName("order-relay"),
		outbox.WithPollInterval(100*time.Millisecond),
		outbox.WithLogger(r.log)); err != nil {
		return nil, err
	}

	// run sets the clock again when the first order can be placed.
	r.clock = newClock(time.Now(), cfg)
	// The victim is killed halfway through the slow phase, when handlers
	// take long enough that it holds several messages.
	r.trap = newTrap(Victim, cfg.Steady+cfg.Slow/2)
	r.api = newPayments(r.clock, cfg, r.trap)
	if r.billing, err = newBilling(ctx, r.dbs, cfg, r.site.b, r.site.dlq, r.api, r.log); err != nil {
		return nil, err
	}

	drv1, err := r.site.driver(ctx, r.site.b, false, maxInFlight)
	if err != nil {
		return nil, fmt.Errorf("demo: %s: %w", Survivor, err)
	}
	if r.loop1, err = consumer.New(drv1, r.loopOptions(Survivor, 5*time.Second)...); err != nil {
		_ = drv1.Close()
		return nil, err
	}
	// The victim has a connection of its own, as another process would:
	// killing it cuts that one only.
	if r.victimB, err = r.site.open(ctx); err != nil {
		return nil, fmt.Errorf("demo: %s: %w", Victim, err)
	}
	drv2, err := r.site.driver(ctx, r.victimB, false, maxInFlight)
	if err != nil {
		return nil, fmt.Errorf("demo: %s: %w", Victim, err)
	}
	r.victim, drv2 = newKillable(drv2)
	// No shutdown grace: when it is killed, its running handlers are
	// cancelled at once.
	if r.loop2, err = consumer.New(drv2, r.loopOptions(Victim, 0)...); err != nil {
		_ = drv2.Close()
		return nil, err
	}
	if r.site.kind != brokerkind.Memory {
		if r.dlq, err = newDLQReader(ctx, r.site, r.log); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// maxInFlight bounds each billing consumer's unacknowledged messages.
const maxInFlight = 12

func (r *run) loopOptions(name string, grace time.Duration) []consumer.Option {
	opts := []consumer.Option{
		consumer.WithName(name),
		consumer.WithConcurrency(6),
		consumer.WithMaxInFlight(maxInFlight),
		consumer.WithShutdownGrace(grace),
		consumer.WithLogger(r.log),
		// A health window of a few seconds, to follow the phases.
		consumer.WithHealthWindow(500*time.Millisecond, 6),
	}
	if r.site.kind == brokerkind.Kafka {
		// Order per order, not per partition: each order's events keep
		// their order while a partition's orders run side by side, and a
		// record retried in place holds back its own key only.
		opts = append(opts, consumer.WithOrdering(consumer.OrderByKey))
	}
	return opts
}

func (r *run) close() {
	if r.billing != nil {
		_ = r.billing.close()
	}
	if r.orders != nil {
		_ = r.orders.close()
	}
	if r.dbs != nil {
		r.dbs.close(context.Background())
	}
	if r.site != nil {
		r.site.close(context.Background())
	}
}

// run runs the demo's goroutines, waits for the backlog to drain and
// judges.
func (r *run) run(ctx context.Context) (Verdict, error) {
	cfg := r.cfg
	// The phases are counted from the first order.
	start := time.Now()
	r.clock = newClock(start, cfg)
	r.api.clock = r.clock
	r.out.event("ferry demo: %d orders, seed %d; the order service writes to an outbox in %s, a relay publishes to %s;", cfg.Orders, cfg.Seed, r.dbs.describe(), r.site.describe())
	r.out.event("two billing consumers (%s, %s) pay each order through the standard middleware and idempotency.", Survivor, Victim)
	r.out.event("%s", legend)
	if r.site.kind == brokerkind.RabbitMQ {
		r.out.event("        (RabbitMQ tells no message's age: the oldest shows as -)")
	}

	var (
		wg      sync.WaitGroup
		errMu   sync.Mutex
		runErrs []error
	)
	fail := func(err error) {
		errMu.Lock()
		runErrs = append(runErrs, err)
		errMu.Unlock()
	}
	goRun := func(f func()) {
		wg.Add(1)
		go func() { defer wg.Done(); f() }()
	}
	bg, stopAll := context.WithCancel(ctx)
	defer func() { stopAll(); wg.Wait() }()

	relayCtx, stopRelay := context.WithCancel(bg)
	defer stopRelay()
	relayDone := make(chan struct{})
	goRun(func() {
		defer close(relayDone)
		if err := r.relay.Run(relayCtx); err != nil {
			fail(fmt.Errorf("demo: relay: %w", err))
		}
	})
	ctx1, stop1 := context.WithCancel(bg)
	defer stop1()
	loop1Done := make(chan struct{})
	goRun(func() {
		defer close(loop1Done)
		if err := r.loop1.Run(ctx1, r.billing.handler); err != nil {
			fail(fmt.Errorf("demo: %s: %w", Survivor, err))
		}
	})
	ctx2, stop2 := context.WithCancel(bg)
	defer stop2()
	loop2Done := make(chan struct{})
	goRun(func() {
		defer close(loop2Done)
		if err := r.loop2.Run(ctx2, r.billing.handler); err != nil && !errors.Is(err, errKilled) && !r.victim.isDead() {
			fail(fmt.Errorf("demo: %s: %w", Victim, err))
		}
	})

	dlqCtx, stopDLQ := context.WithCancel(bg)
	defer stopDLQ()
	dlqDone := make(chan struct{})
	if r.dlq != nil {
		goRun(func() {
			defer close(dlqDone)
			if err := r.dlq.loop.Run(dlqCtx, r.dlq); err != nil {
				fail(fmt.Errorf("demo: dead-letter reader: %w", err))
			}
		})
	} else {
		close(dlqDone)
	}

	produced := make(chan error, 1)
	goRun(func() { produced <- r.orders.produce(bg, r.plan, start, cfg.production()) })
	goRun(func() { r.killer(bg, stop2, loop2Done, produced) })

	statusCtx, stopStatus := context.WithCancel(bg)
	statusDone := make(chan struct{})
	goRun(func() { defer close(statusDone); r.report(statusCtx) })

	// Wait for the orders, then for the backlog to drain.
	var err error
	select {
	case err = <-produced:
		produced <- err // for the killer
	case <-ctx.Done():
		err = ctx.Err()
	}
	if err == nil {
		deadline := time.Now().Add(cfg.Recovered)
		if end := start.Add(cfg.production()); end.After(time.Now()) {
			deadline = end.Add(cfg.Recovered)
		}
		err = r.drain(ctx, deadline)
	}

	stop1()
	<-loop1Done
	stopRelay()
	<-relayDone
	stopDLQ()
	<-dlqDone
	stopStatus()
	<-statusDone
	stopAll()
	wg.Wait()
	r.out.status(r.snapshot(context.Background()))
	r.out.done()

	if err != nil {
		return Verdict{}, err
	}
	errMu.Lock()
	defer errMu.Unlock()
	if len(runErrs) > 0 {
		return Verdict{}, errors.Join(runErrs...)
	}
	v, err := r.judge(context.Background(), time.Since(start))
	if err != nil {
		return Verdict{}, err
	}
	v.Report(r.cfg.Out)
	return v, nil
}

// drain waits until the outbox and the queue are empty and every message
// dead-lettered has been read back, or deadline.
func (r *run) drain(ctx context.Context, deadline time.Time) error {
	every := 50 * time.Millisecond
	if r.site.kind != brokerkind.Memory {
		every = 250 * time.Millisecond // each look asks the broker
	}
	t := time.NewTicker(every)
	defer t.Stop()
	empty := 0 // looks in a row that found the queue empty
	for {
		b, err := r.relay.Backlog(ctx)
		if err == nil && b.Events == 0 {
			// The relay has published the last events: their copies too.
			r.dup.flush(ctx)
			// A broker's counts can lag behind a message on its way
			// (between a delay queue and its source, on RabbitMQ): the
			// queue must look empty twice, and every order must have its
			// outcome.
			if left, err := r.site.left(ctx, r.loop1); err == nil && left == 0 {
				empty++
			} else {
				empty = 0
			}
			if empty >= 2 && r.settled(ctx) {
				return nil
			}
		}
		if time.Now().After(deadline) {
			r.out.event("the recovered phase ran out (%s) before the backlog drained", r.cfg.Recovered)
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// settled reports whether every committed order has its outcome: a good
// order paid, a poison order in the dead-letter queue.
func (r *run) settled(ctx context.Context) bool {
	committed, err := r.orders.committedOrders(ctx)
	if err != nil {
		return false
	}
	paid, err := r.billing.paymentsPerOrder(ctx)
	if err != nil {
		return false
	}
	dead := make(map[string]bool)
	for _, m := range r.deadLetters() {
		dead[m.Key] = true
	}
	for _, id := range committed {
		o := r.plan.byID[id]
		if o == nil || (o.poison == poisonNone && paid[id] == 0) || (o.poison != poisonNone && !dead[id]) {
			return false
		}
	}
	return true
}

// deadLetters returns what is in the dead-letter queue.
func (r *run) deadLetters() []consumer.Message {
	if r.dlq == nil {
		return r.site.mem.Messages(r.site.dlq)
	}
	return r.dlq.messages()
}

// killer kills the victim when the trap catches one of its calls, or, if
// none is caught, once the orders are all committed.
func (r *run) killer(ctx context.Context, stop func(), stopped <-chan struct{}, produced chan error) {
	var order string
	select {
	case order = <-r.trap.sprung:
	case err := <-produced:
		produced <- err
		r.trap.disarm()
		select {
		case order = <-r.trap.sprung: // caught just before it was disarmed
		default:
		}
	case <-ctx.Done():
		return
	}
	r.billing.watchTakeovers()
	held := r.victim.kill()
	stop()
	<-stopped
	// Its loop closed its driver; a process that dies closes its
	// connections too (RabbitMQ requeues what they held at once).
	r.site.closeExtra(r.victimB)
	r.mu.Lock()
	r.killed, r.killedOrder = true, order
	r.mu.Unlock()
	if order != "" {
		r.out.event("kill: %s killed while charging %s, holding %s; %s",
			Victim, order, plural(len(held), "unacknowledged message"), r.site.takeover())
	} else {
		r.out.event("kill: %s killed, holding %s; %s",
			Victim, plural(len(held), "unacknowledged message"), r.site.takeover())
	}
}

// report prints a status line every StatusInterval, an event at each phase
// change and when the survivor has taken over the victim's messages.
func (r *run) report(ctx context.Context) {
	tick := time.NewTicker(r.cfg.StatusInterval)
	defer tick.Stop()
	phase := Phase(-1)
	tookOver := false
	for {
		// Events first, so that a status line never shows a phase before
		// the line that announces it.
		if _, ph := r.clock.now(); ph != phase {
			phase = ph
			r.out.event("-- phase %s: %s", ph, ph.describe(r.cfg))
		}
		r.mu.Lock()
		killed := r.killed
		r.mu.Unlock()
		if killed && !tookOver {
			orphans := r.victim.orphans()
			if n := r.billing.takenOver(orphans, Survivor); n == len(orphans) {
				tookOver = true
				r.out.event("takeover: %s has taken over all %s %s held", Survivor, plural(n, "message"), Victim)
			}
		}
		next := time.Hour
		if phase != PhaseRecovered {
			elapsed, _ := r.clock.now()
			next = r.clock.ends[phase] - elapsed
		}
		phaseTimer := time.NewTimer(max(next, time.Millisecond))
		select {
		case <-ctx.Done():
			phaseTimer.Stop()
			return
		case <-tick.C:
			if _, ph := r.clock.now(); ph != phase {
				phase = ph
				r.out.event("-- phase %s: %s", ph, ph.describe(r.cfg))
			}
			r.out.status(r.snapshot(ctx))
		case <-phaseTimer.C:
		}
		phaseTimer.Stop()
	}
}

// plural writes n and noun, with an s unless n is 1.
func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

func (r *run) snapshot(ctx context.Context) snapshot {
	elapsed, ph := r.clock.now()
	s := snapshot{
		elapsed:    elapsed,
		phase:      ph,
		published:  r.relay.Stats().Published,
		paid:       r.billing.paid.Load(),
		retries:    r.billing.retries.Load(),
		breaker:    r.billing.stack.Breaker.State().String(),
		dead:       r.billing.stack.DeadLetter.Count(),
		suppressed: r.billing.suppressed(),
		health:     string(r.loop1.Health().State),
	}
	if lag, err := r.loop1.Lag(ctx); err == nil {
		s.lag = r.site.lagOf(lag)
		s.oldest = lag.OldestAge
	}
	if r.site.kind == brokerkind.RabbitMQ {
		s.oldest = ageUnknown // AMQP does not tell it
	}
	return s
}

// judge reads what the run left and checks the invariants.
func (r *run) judge(ctx context.Context, elapsed time.Duration) (Verdict, error) {
	committed, err := r.orders.committedOrders(ctx)
	if err != nil {
		return Verdict{}, err
	}
	paid, err := r.billing.paymentsPerOrder(ctx)
	if err != nil {
		return Verdict{}, err
	}
	backlog, err := r.relay.Backlog(ctx)
	if err != nil {
		return Verdict{}, err
	}
	left, err := r.site.left(ctx, nil)
	if err != nil {
		return Verdict{}, err
	}
	f := facts{
		plan:      r.plan,
		committed: committed,
		paid:      paid,
		dlq:       r.deadLetters(),
		backlog:   backlog,
		queueLeft: left,
	}
	poison := 0
	for _, o := range r.plan.poison() {
		for _, id := range committed {
			if id == o.id {
				poison++
			}
		}
	}
	v := Verdict{
		Checks:               judge(f),
		Seed:                 r.cfg.Seed,
		Broker:               brokerName(r.site.kind),
		Elapsed:              elapsed,
		Orders:               len(committed),
		Good:                 len(committed) - poison,
		Poison:               poison,
		Published:            r.relay.Stats().Published,
		DuplicatesPublished:  r.dup.copies.Load(),
		DuplicatesSuppressed: r.billing.suppressed(),
		Paid:                 r.billing.paid.Load(),
		Retries:              r.billing.retries.Load(),
		DeadLettered:         r.billing.stack.DeadLetter.Count(),
		BreakerOpened:        r.billing.stack.Breaker.Opened(),
		Held:                 r.billing.stack.Breaker.Held(),
		APICalls:             r.api.calls.Load(),
		OutageCalls:          r.api.outageCalls.Load(),
	}
	r.mu.Lock()
	if r.killed {
		v.Killed, v.KilledOrder, v.TakenOverHow = Victim, r.killedOrder, r.site.takenOverAfter()
		orphans := r.victim.orphans()
		v.Orphaned, v.TakenOver = len(orphans), r.billing.takenOver(orphans, Survivor)
	}
	r.mu.Unlock()
	return v, nil
}
