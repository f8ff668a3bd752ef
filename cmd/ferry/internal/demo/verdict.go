package demo

import (
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/outbox"
)

// The names of the invariants a Verdict checks.
const (
	// CheckExactlyOnce: no order was paid twice, and no poison order was
	// paid.
	CheckExactlyOnce = "exactly once"
	// CheckPoisonDeadLettered: every poison order is in the dead-letter
	// queue with its reason and its error.
	CheckPoisonDeadLettered = "poison dead-lettered"
	// CheckNoGoodDeadLettered: no good order is in the dead-letter queue.
	CheckNoGoodDeadLettered = "no good message dead-lettered"
	// CheckNothingLost: every good order was paid, and the outbox and the
	// queue are empty.
	CheckNothingLost = "nothing lost"
)

// Check is the result of one invariant.
type Check struct {
	Name   string
	OK     bool
	Detail string // what was found, in a sentence
}

// Verdict is what a run found: its invariants and its counts.
type Verdict struct {
	// Checks holds the four invariants, in the order of the Check* names.
	Checks []Check

	Seed    uint64
	Elapsed time.Duration
	Broker  string // the kind of broker the run was on: "the memory broker", "Kafka", "SQS", "RabbitMQ"

	Orders int // orders committed
	Good   int // committed orders that are not poison
	Poison int // poison orders committed

	Published            int64 // events the relay published
	DuplicatesPublished  int64 // extra copies published on purpose
	DuplicatesSuppressed int64 // deliveries idempotency acknowledged without paying
	Paid                 int64 // payment rows written
	Retries              int64 // handler runs after an event's first
	DeadLettered         int64 // messages the DeadLetter middleware published
	BreakerOpened        int64 // times the breaker opened
	Held                 int64 // handler runs the breaker held
	APICalls             int64 // calls to the payments API
	OutageCalls          int64 // of them, made while it was down

	// Killed is the consumer killed mid-handler ("" if the kill never
	// happened), KilledOrder the order its caught handler was charging ("" if
	// none was caught), Orphaned how many messages it held, and TakenOver
	// how many of them the surviving consumer received afterwards, and
	// TakenOverHow when ("after the visibility timeout", "after the
	// rebalance", ...).
	Killed, KilledOrder, TakenOverHow string
	Orphaned, TakenOver               int
}

// OK reports whether every invariant holds.
func (v Verdict) OK() bool {
	for _, c := range v.Checks {
		if !c.OK {
			return false
		}
	}
	return len(v.Checks) > 0
}

// Broken returns the names of the invariants that do not hold.
func (v Verdict) Broken() []string {
	var out []string
	for _, c := range v.Checks {
		if !c.OK {
			out = append(out, c.Name)
		}
	}
	return out
}

// Check returns the check named name, and whether there is one.
func (v Verdict) Check(name string) (Check, bool) {
	for _, c := range v.Checks {
		if c.Name == name {
			return c, true
		}
	}
	return Check{}, false
}

// facts is what the verdict is judged on, read after the run.
type facts struct {
	plan      *plan
	committed []string
	paid      map[string]int
	dlq       []consumer.Message
	backlog   outbox.Backlog
	queueLeft int64 // visible, delayed or in flight
}

// judge checks the invariants against f.
func judge(f facts) []Check {
	poison := make(map[string]*order)
	for _, o := range f.plan.poison() {
		poison[o.id] = o
	}
	committed := make(map[string]bool, len(f.committed))
	for _, id := range f.committed {
		committed[id] = true
	}

	// Exactly once.
	var twice, paidPoison []string
	for _, id := range f.committed {
		n := f.paid[id]
		switch {
		case poison[id] != nil && n > 0:
			paidPoison = append(paidPoison, id)
		case n > 1:
			twice = append(twice, fmt.Sprintf("%s %d times", id, n))
		}
	}
	once := Check{Name: CheckExactlyOnce, OK: len(twice) == 0 && len(paidPoison) == 0}
	switch {
	case once.OK:
		once.Detail = fmt.Sprintf("%d good orders, each paid once", len(f.committed)-countCommitted(poison, committed))
	default:
		var parts []string
		if len(twice) > 0 {
			parts = append(parts, fmt.Sprintf("%d orders paid more than once (%s)", len(twice), sample(twice)))
		}
		if len(paidPoison) > 0 {
			parts = append(parts, fmt.Sprintf("%d poison orders paid (%s)", len(paidPoison), sample(paidPoison)))
		}
		once.Detail = strings.Join(parts, "; ")
	}

	// Poison dead-lettered, and no good message dead-lettered.
	type dead struct{ reason, err string }
	inDLQ := make(map[string][]dead)
	var good []string
	for _, m := range f.dlq {
		inDLQ[m.Key] = append(inDLQ[m.Key], dead{m.Header(consumer.HeaderDLQReason), m.Header(consumer.HeaderDLQError)})
		if poison[m.Key] == nil && !slices.Contains(good, m.Key) {
			// Say why, from the failure story in its headers.
			good = append(good, fmt.Sprintf("%s: %s after %s attempts in %s deliveries: %s", m.Key,
				m.Header(consumer.HeaderDLQReason), m.Header(consumer.HeaderDLQAttempts),
				m.Header(consumer.HeaderDLQDeliveries), m.Header(consumer.HeaderDLQError)))
		}
	}
	var missing []string
	reasons := map[string]int{}
	for _, o := range f.plan.poison() {
		if !committed[o.id] {
			missing = append(missing, o.id+" (never committed)")
			continue
		}
		ok := false
		for _, d := range inDLQ[o.id] {
			if d.reason == o.wantReason() && d.err != "" {
				ok = true
			}
		}
		if ok {
			reasons[o.wantReason()]++
		} else {
			missing = append(missing, fmt.Sprintf("%s (want reason %s)", o.id, o.wantReason()))
		}
	}
	poisonCheck := Check{Name: CheckPoisonDeadLettered, OK: len(missing) == 0}
	if poisonCheck.OK {
		poisonCheck.Detail = fmt.Sprintf("%d poison orders in the dead-letter queue with their reasons (%d %s, %d %s)",
			len(poison), reasons[consumer.DLQReasonPermanent], consumer.DLQReasonPermanent,
			reasons[consumer.DLQReasonMaxAttempts], consumer.DLQReasonMaxAttempts)
	} else {
		poisonCheck.Detail = fmt.Sprintf("%d poison orders missing from the dead-letter queue or without their reason: %s", len(missing), sample(missing))
	}
	goodCheck := Check{Name: CheckNoGoodDeadLettered, OK: len(good) == 0}
	if goodCheck.OK {
		goodCheck.Detail = "the dead-letter queue holds poison orders only"
	} else {
		goodCheck.Detail = fmt.Sprintf("%d good orders in the dead-letter queue (%s)", len(good), sample(good))
	}

	// Nothing lost.
	var unpaid []string
	for _, id := range f.committed {
		if poison[id] == nil && f.paid[id] == 0 {
			unpaid = append(unpaid, id)
		}
	}
	lost := Check{Name: CheckNothingLost, OK: len(unpaid) == 0 && f.backlog.Events == 0 && f.backlog.Failed == 0 && f.queueLeft == 0}
	if lost.OK {
		lost.Detail = "every good order paid; the outbox and the queue are empty"
	} else {
		var parts []string
		if len(unpaid) > 0 {
			parts = append(parts, fmt.Sprintf("%d good orders never paid (%s)", len(unpaid), sample(unpaid)))
		}
		if f.backlog.Events > 0 || f.backlog.Failed > 0 {
			parts = append(parts, fmt.Sprintf("%d events still in the outbox, %d in its failed table", f.backlog.Events, f.backlog.Failed))
		}
		if f.queueLeft > 0 {
			parts = append(parts, fmt.Sprintf("%d messages still in the queue", f.queueLeft))
		}
		lost.Detail = strings.Join(parts, "; ")
	}
	return []Check{once, poisonCheck, goodCheck, lost}
}

func countCommitted(poison map[string]*order, committed map[string]bool) int {
	n := 0
	for id := range poison {
		if committed[id] {
			n++
		}
	}
	return n
}

// sample lists the first few of xs.
func sample(xs []string) string {
	const show = 5
	if len(xs) <= show {
		return strings.Join(xs, ", ")
	}
	return strings.Join(xs[:show], ", ") + fmt.Sprintf(", and %d more", len(xs)-show)
}

// Report writes the verdict: one line per invariant, then the counts.
func (v Verdict) Report(w io.Writer) {
	var b strings.Builder
	if v.OK() {
		b.WriteString("verdict: all invariants hold\n")
	} else {
		fmt.Fprintf(&b, "verdict: BROKEN: %s\n", strings.Join(v.Broken(), ", "))
	}
	for _, c := range v.Checks {
		mark := "ok  "
		if !c.OK {
			mark = "FAIL"
		}
		fmt.Fprintf(&b, "  %s %-30s %s\n", mark, c.Name, c.Detail)
	}
	fmt.Fprintf(&b, "  orders committed %d (%d good, %d poison); events published %d, plus %d duplicates on purpose\n",
		v.Orders, v.Good, v.Poison, v.Published, v.DuplicatesPublished)
	fmt.Fprintf(&b, "  payments %d; duplicates suppressed %d; retries %d; dead-lettered %d\n",
		v.Paid, v.DuplicatesSuppressed, v.Retries, v.DeadLettered)
	fmt.Fprintf(&b, "  breaker opened %d times and held %d runs; the payments API got %d calls, %d of them during the outage\n",
		v.BreakerOpened, v.Held, v.APICalls, v.OutageCalls)
	switch {
	case v.Killed == "":
	case v.KilledOrder != "":
		fmt.Fprintf(&b, "  %s was killed while charging %s, holding %s; %s took over %d of them %s\n",
			v.Killed, v.KilledOrder, plural(v.Orphaned, "message"), Survivor, v.TakenOver, v.TakenOverHow)
	default:
		fmt.Fprintf(&b, "  %s was killed holding %s; %s took over %d of them %s\n",
			v.Killed, plural(v.Orphaned, "message"), Survivor, v.TakenOver, v.TakenOverHow)
	}
	fmt.Fprintf(&b, "  seed %d, %s, on %s\n", v.Seed, v.Elapsed.Round(100*time.Millisecond), v.Broker)
	_, _ = io.WriteString(w, b.String())
}
