package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/ferrytest"
)

// The invariants a run checks, by name.
const (
	CheckExactlyOnce        = "every good order paid exactly once"
	CheckPoisonDeadLettered = "every poison order in the DLQ with its story"
	CheckNoGoodDeadLettered = "no good order in the DLQ"
	CheckNothingLost        = "nothing lost"
)

// check is one invariant's outcome.
type check struct {
	Name   string
	OK     bool
	Detail string
}

// result is what one broker's run found.
type result struct {
	Kind    string
	Seed    uint64
	Fault   string
	Orders  int // asked for
	Elapsed time.Duration
	Drain   time.Duration // from the last fault and order to an empty backlog

	Committed, Good, PoisonCommitted int
	DupWritten                       int // orders whose event was written twice
	Published                        int64
	Payments                         int64
	MaxPerOrder                      int
	Paid                             int // good orders paid at least once
	PaidTwice                        []string
	PaidPoison                       []string
	Unpaid                           []string
	LostTrails                       []string // where each lost order's trail ends
	BrokerStops                      []window // each broker restart, from its start until the broker was back
	LostByBroker                     []string // orders the broker took and lost in a restart (SQS: ElasticMQ), with their trails
	PoisonInDLQ                      int
	PoisonStoryless                  []string
	PoisonMissing                    []string
	Reasons                          map[string]int
	GoodInDLQ                        []string
	OutboxLeft                       int64
	Suppressed                       int64
	DeadLettered                     int64 // the middleware's count (flushed stats)
	Held                             int64
	OutageCalls                      int64
	Kills                            map[string]int // per role
	Crashes                          map[string]int // per process: exits nobody asked for
	BrokerRestarts                   int
	DrainAfterOutage                 time.Duration
	PeakLag                          int64
	Notes                            []string
	Checks                           []check
}

// OK reports whether every invariant held.
func (r *result) OK() bool {
	if len(r.Checks) == 0 {
		return false
	}
	for _, c := range r.Checks {
		if !c.OK {
			return false
		}
	}
	return true
}

func (r *result) verdictWord() string {
	if r.OK() {
		return "PASS"
	}
	var broken []string
	for _, c := range r.Checks {
		if !c.OK {
			broken = append(broken, c.Name)
		}
	}
	return "FAIL (" + strings.Join(broken, "; ") + ")"
}

// gather reads what the run left: the orders, the payments, the dead
// letters and the processes' counters.
func gather(ctx context.Context, pool *pgxpool.Pool, r *result, dls []ferrytest.DeadLetter, procs map[string]*proc) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer cancel()
	poison := map[string]bool{}
	rows, err := pool.Query(ctx, `SELECT id, poison, dup_written FROM orders`)
	if err != nil {
		return err
	}
	for rows.Next() {
		var id string
		var p, d bool
		if err := rows.Scan(&id, &p, &d); err != nil {
			return err
		}
		poison[id] = p
		r.Committed++
		if p {
			r.PoisonCommitted++
		} else {
			r.Good++
		}
		if d {
			r.DupWritten++
		}
	}
	if err := rows.Err(); err != nil {
		return err
	}
	paid := map[string]int{}
	rows, err = pool.Query(ctx, `SELECT order_id, count(*) FROM payments GROUP BY order_id`)
	if err != nil {
		return err
	}
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			return err
		}
		paid[id] = n
		r.Payments += int64(n)
		r.MaxPerOrder = max(r.MaxPerOrder, n)
	}
	if err := rows.Err(); err != nil {
		return err
	}
	for id, p := range poison {
		n := paid[id]
		switch {
		case p && n > 0:
			r.PaidPoison = append(r.PaidPoison, id)
		case !p && n == 0:
			r.Unpaid = append(r.Unpaid, id)
		case !p && n > 1:
			r.PaidTwice = append(r.PaidTwice, fmt.Sprintf("%s×%d", id, n))
		}
		if !p && n > 0 {
			r.Paid++
		}
	}

	r.Reasons = map[string]int{}
	inDLQ := map[string]bool{}
	for _, dl := range dls {
		id := dl.Key
		p, known := poison[id]
		switch {
		case !known || !p:
			r.GoodInDLQ = append(r.GoodInDLQ, fmt.Sprintf("%s (%s: %s)", id, dl.Reason, dl.Error))
			continue
		case inDLQ[id]:
			continue // a duplicate of a dead letter: the story is told once enough
		}
		inDLQ[id] = true
		r.PoisonInDLQ++
		r.Reasons[dl.Reason+": "+genericError(dl.Error, id)]++
		if dl.Reason != consumer.DLQReasonPermanent || !strings.Contains(dl.Error, "poison") ||
			dl.Attempts < 1 || dl.FirstFailure.IsZero() || dl.Source == "" {
			r.PoisonStoryless = append(r.PoisonStoryless, fmt.Sprintf("%s (reason %q, error %q, attempts %d, source %q)", id, dl.Reason, dl.Error, dl.Attempts, dl.Source))
		}
	}
	for id, p := range poison {
		if p && !inDLQ[id] {
			r.PoisonMissing = append(r.PoisonMissing, id)
		}
	}

	if err := r.attributeBrokerLoss(ctx, pool); err != nil {
		return err
	}
	if len(r.Unpaid) > 0 {
		// Where each lost order's trail ends.
		rows, err := pool.Query(ctx, `SELECT o.id,
				(SELECT count(*) FROM published p WHERE p.event_id = 'ev-' || o.id),
				(SELECT count(*) FROM deliveries d WHERE d.event_id = 'ev-' || o.id),
				(SELECT min(p.at) FROM published p WHERE p.event_id = 'ev-' || o.id)
			FROM orders o WHERE o.id = ANY($1) ORDER BY o.seq`, r.Unpaid)
		if err != nil {
			return err
		}
		for rows.Next() {
			var id string
			var pub, del int
			var at *time.Time
			if err := rows.Scan(&id, &pub, &del, &at); err != nil {
				return err
			}
			trail := fmt.Sprintf("%s: published %d×, delivered %d×", id, pub, del)
			if at != nil {
				trail += " (first published " + at.UTC().Format("15:04:05.000") + ")"
			}
			r.LostTrails = append(r.LostTrails, trail)
		}
		if err := rows.Err(); err != nil {
			return err
		}
	}
	if r.OutboxLeft, err = pgoutboxBacklog(ctx, pool); err != nil {
		return err
	}
	stats := map[string]int64{}
	rows, err = pool.Query(ctx, `SELECT name, sum(value) FROM chaos_stats WHERE value >= 0 GROUP BY name`)
	if err != nil {
		return err
	}
	for rows.Next() {
		var n string
		var v int64
		if err := rows.Scan(&n, &v); err != nil {
			return err
		}
		stats[n] = v
	}
	if err := rows.Err(); err != nil {
		return err
	}
	r.Suppressed, r.DeadLettered = stats["suppressed"], stats["dead_lettered"]
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM published`).Scan(&r.Published); err != nil {
		return err
	}
	r.Held, r.OutageCalls = stats["held"], stats["outage_calls"]

	r.Kills, r.Crashes = map[string]int{}, map[string]int{}
	for name, p := range procs {
		k, c, _ := p.counts()
		r.Kills[p.role] += k
		if c > 0 && name != "orders" {
			r.Crashes[name] = c
		}
	}
	for _, l := range [][]string{r.PaidTwice, r.PaidPoison, r.Unpaid, r.PoisonMissing, r.PoisonStoryless, r.GoodInDLQ, r.LostByBroker} {
		slices.Sort(l)
	}
	return nil
}

// window is a span of wall-clock time.
type window struct{ From, To time.Time }

// holdsLoss reports whether the broker may have acknowledged at an event
// that the restart w lost: from brokerLossLead before w began until it
// ended.
func (w window) holdsLoss(at time.Time) bool {
	return !at.Before(w.From.Add(-brokerLossLead)) && !at.After(w.To)
}

// brokerLossLead is how long before a restart began the broker may have
// acknowledged an event that its stop then lost: ElasticMQ answers
// SendMessage before its persistence actor has written the message to H2,
// and at SIGTERM the JVM closes H2 under that actor (its trace file logs
// "Database is already closed" in MessageRepository.add). The lead covers
// the actor's backlog under load.
const brokerLossLead = 5 * time.Second

// brokerLosesAcknowledged names the brokers whose restart can lose what
// they acknowledged: ElasticMQ, the SQS of these runs (Amazon SQS is not
// restarted under its users). Kafka (a SIGTERM flushes the log) and
// RabbitMQ (a quorum queue confirms once the message is on disk) keep it,
// so a loss there is always Ferry's.
var brokerLosesAcknowledged = map[string]bool{"sqs": true}

// attributeBrokerLoss moves out of Unpaid and PoisonMissing the orders the
// broker lost: on a broker that can lose what it acknowledged, an order
// whose event the broker acknowledged only within a restart (from
// brokerLossLead before it began until the broker was back) and that no
// consumer ever received. Everything else missing stays Ferry's loss.
func (r *result) attributeBrokerLoss(ctx context.Context, pool *pgxpool.Pool) error {
	if !brokerLosesAcknowledged[r.Kind] || len(r.BrokerStops) == 0 {
		return nil
	}
	missing := append(slices.Clone(r.Unpaid), r.PoisonMissing...)
	if len(missing) == 0 {
		return nil
	}
	rows, err := pool.Query(ctx, `SELECT o.id,
			(SELECT count(*) FROM deliveries d WHERE d.event_id = 'ev-' || o.id),
			(SELECT array_agg(p.at ORDER BY p.at) FROM published p WHERE p.event_id = 'ev-' || o.id)
		FROM orders o WHERE o.id = ANY($1)`, missing)
	if err != nil {
		return err
	}
	defer rows.Close()
	lost := map[string]string{}
	for rows.Next() {
		var id string
		var del int
		var ats []time.Time
		if err := rows.Scan(&id, &del, &ats); err != nil {
			return err
		}
		if del > 0 || len(ats) == 0 {
			continue
		}
		inRestart := true
		for _, at := range ats {
			inRestart = inRestart && slices.ContainsFunc(r.BrokerStops, func(w window) bool { return w.holdsLoss(at) })
		}
		if inRestart {
			lost[id] = fmt.Sprintf("%s: published %d×, delivered 0× (published %s, restart began %s)", id, len(ats),
				ats[0].UTC().Format("15:04:05.000"), r.stopAround(ats[0]).UTC().Format("15:04:05.000"))
		}
	}
	if err := rows.Err(); err != nil {
		return err
	}
	gone := func(id string) bool { _, ok := lost[id]; return ok }
	r.Unpaid = slices.DeleteFunc(r.Unpaid, gone)
	r.PoisonMissing = slices.DeleteFunc(r.PoisonMissing, gone)
	for _, t := range lost {
		r.LostByBroker = append(r.LostByBroker, t)
	}
	return nil
}

// stopAround returns the start of the restart whose window holds at.
func (r *result) stopAround(at time.Time) time.Time {
	for _, w := range r.BrokerStops {
		if w.holdsLoss(at) {
			return w.From
		}
	}
	return time.Time{}
}

// genericError replaces the order's id in a dead letter's error, so that
// errors of one kind count together.
func genericError(e, id string) string {
	return strings.ReplaceAll(e, id, "<order>")
}

func firstFew(l []string) string {
	if len(l) > 5 {
		return strings.Join(l[:5], ", ") + fmt.Sprintf(", … (%d in all)", len(l))
	}
	return strings.Join(l, ", ")
}

// judge checks the four invariants.
func (r *result) judge() {
	c1 := check{Name: CheckExactlyOnce, OK: len(r.PaidTwice) == 0 && len(r.PaidPoison) == 0}
	switch {
	case len(r.PaidTwice) > 0:
		c1.Detail = fmt.Sprintf("%d good orders paid more than once: %s", len(r.PaidTwice), firstFew(r.PaidTwice))
	case len(r.PaidPoison) > 0:
		c1.Detail = fmt.Sprintf("%d poison orders paid: %s", len(r.PaidPoison), firstFew(r.PaidPoison))
	}
	c2 := check{Name: CheckPoisonDeadLettered, OK: len(r.PoisonMissing) == 0 && len(r.PoisonStoryless) == 0}
	switch {
	case len(r.PoisonMissing) > 0:
		c2.Detail = fmt.Sprintf("%d poison orders not in the DLQ: %s", len(r.PoisonMissing), firstFew(r.PoisonMissing))
	case len(r.PoisonStoryless) > 0:
		c2.Detail = fmt.Sprintf("%d poison dead letters without their story: %s", len(r.PoisonStoryless), firstFew(r.PoisonStoryless))
	}
	c3 := check{Name: CheckNoGoodDeadLettered, OK: len(r.GoodInDLQ) == 0}
	if !c3.OK {
		c3.Detail = fmt.Sprintf("%d good orders dead-lettered: %s", len(r.GoodInDLQ), firstFew(r.GoodInDLQ))
	}
	c4 := check{Name: CheckNothingLost, OK: len(r.Unpaid) == 0 && r.OutboxLeft == 0 && r.Committed == r.Orders}
	switch {
	case len(r.Unpaid) > 0:
		c4.Detail = fmt.Sprintf("%d good orders never paid: %s", len(r.Unpaid), firstFew(r.Unpaid))
	case r.OutboxLeft > 0:
		c4.Detail = fmt.Sprintf("%d events left in the outbox", r.OutboxLeft)
	case r.Committed != r.Orders:
		c4.Detail = fmt.Sprintf("%d orders committed of %d", r.Committed, r.Orders)
	}
	r.Checks = []check{c1, c2, c3, c4}
}

// print writes the run's table.
func (r *result) print(w io.Writer) {
	fault := ""
	if r.Fault != "" {
		fault = "   planted fault: " + r.Fault
	}
	fmt.Fprintf(w, "\n== %s   seed %d%s   %s (drain %s)\n", r.Kind, r.Seed, fault, r.Elapsed.Round(100*time.Millisecond), r.Drain.Round(100*time.Millisecond))
	row := func(k string, format string, args ...any) {
		fmt.Fprintf(w, "  %-34s %s\n", k, fmt.Sprintf(format, args...))
	}
	row("orders committed", "%d (%d good, %d poison)", r.Committed, r.Good, r.PoisonCommitted)
	row("events published", "%d (the broker took them; %d events written twice on purpose)", r.Published, r.DupWritten)
	row("payments", "%d rows, for %d good orders", r.Payments, r.Paid)
	row("payments per order (max)", "%d", r.MaxPerOrder)
	reasons := make([]string, 0, len(r.Reasons))
	for k, n := range r.Reasons {
		reasons = append(reasons, fmt.Sprintf("%d× %s", n, k))
	}
	slices.Sort(reasons)
	row("poison in the DLQ", "%d of %d", r.PoisonInDLQ, r.PoisonCommitted)
	for _, s := range reasons {
		row("", "  %s", s)
	}
	row("good messages in the DLQ", "%d", len(r.GoodInDLQ))
	row("lost", "%d (good orders never paid; %d events left in the outbox)", len(r.Unpaid), r.OutboxLeft)
	if brokerLosesAcknowledged[r.Kind] {
		row("lost by the broker's restarts", "%d (acknowledged by ElasticMQ just before its stop, never persisted, never received)", len(r.LostByBroker))
	}
	row("duplicates suppressed", "%d", r.Suppressed)
	row("held by the breaker (runs)", "%d (%d calls failed while the API was down)", r.Held, r.OutageCalls)
	row("kills (SIGKILL)", "%d billing, %d relay", r.Kills[roleBilling], r.Kills[roleRelay])
	if len(r.Crashes) > 0 {
		row("exits nobody asked for", "%v", r.Crashes)
	}
	row("broker restarts", "%d", r.BrokerRestarts)
	if r.DrainAfterOutage > 0 {
		row("time to drain after the outage", "%s", r.DrainAfterOutage.Round(100*time.Millisecond))
	} else {
		row("time to drain after the outage", "-")
	}
	row("peak lag", "%d good orders committed and not yet paid", r.PeakLag)
	for _, n := range r.Notes {
		row("note", "%s", n)
	}
	for i, t := range r.LostTrails {
		if i == 20 {
			row("", "… (%d lost in all)", len(r.LostTrails))
			break
		}
		row("lost order", "%s", t)
	}
	for i, t := range r.LostByBroker {
		if i == 10 {
			row("", "… (%d lost by the broker in all)", len(r.LostByBroker))
			break
		}
		row("lost by the broker", "%s", t)
	}
	for _, c := range r.Checks {
		mark := "ok  "
		if !c.OK {
			mark = "FAIL"
		}
		line := fmt.Sprintf("  %s %s", mark, c.Name)
		if c.Detail != "" {
			line += ": " + c.Detail
		}
		fmt.Fprintln(w, line)
	}
	fmt.Fprintf(w, "  verdict: %s\n", r.verdictWord())
}
