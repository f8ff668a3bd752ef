package demo

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
)

// shortConfig is a whole run in a few seconds: 60 orders over about five
// seconds, and up to 30s to drain on a busy machine.
func shortConfig(out *bytes.Buffer) Config {
	c := DefaultConfig()
	c.Orders = 60
	c.Steady, c.Slow, c.Failing, c.Protected = time.Second, 1500*time.Millisecond, 700*time.Millisecond, time.Second
	c.Recovered = 30 * time.Second
	c.SlowLatency = time.Second
	c.StatusInterval = 250 * time.Millisecond
	c.Out = out
	return c
}

func runDemo(t *testing.T, c Config) Verdict {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	v, err := Run(ctx, c)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	return v
}

// The end-to-end run: every invariant holds, and the counts add up to what
// the seed planned.
func TestRunHoldsEveryInvariant(t *testing.T) {
	var out bytes.Buffer
	c := shortConfig(&out)
	v := runDemo(t, c)
	t.Logf("output:\n%s", out.String())

	if !v.OK() {
		t.Fatalf("verdict broken: %v", v.Broken())
	}
	if got := len(v.Checks); got != 4 {
		t.Errorf("%d checks, want 4", got)
	}
	const poison = 4
	wantDups := int64(c.Orders / 20)
	if v.Orders != c.Orders || v.Poison != poison || v.Good != c.Orders-poison {
		t.Errorf("orders %d (good %d, poison %d), want %d (%d, %d)", v.Orders, v.Good, v.Poison, c.Orders, c.Orders-poison, poison)
	}
	if v.Published != int64(c.Orders) {
		t.Errorf("relay published %d events, want %d", v.Published, c.Orders)
	}
	if v.Paid != int64(v.Good) {
		t.Errorf("%d payments, want one per good order: %d", v.Paid, v.Good)
	}
	if v.DuplicatesPublished != wantDups {
		t.Errorf("%d duplicates published, want %d", v.DuplicatesPublished, wantDups)
	}
	// Every duplicate copy is suppressed; a message whose ack was lost with
	// the killed consumer may add one more.
	if v.DuplicatesSuppressed < wantDups {
		t.Errorf("%d duplicates suppressed, want at least the %d published", v.DuplicatesSuppressed, wantDups)
	}
	if v.DeadLettered < poison {
		t.Errorf("%d dead-lettered, want at least the %d poison", v.DeadLettered, poison)
	}
	if v.BreakerOpened < 1 || v.Held < 1 {
		t.Errorf("breaker opened %d times, held %d runs: the outage was not held", v.BreakerOpened, v.Held)
	}
	if v.OutageCalls < 1 {
		t.Errorf("no call reached the payments API during the outage: the breaker never tried it")
	}
	if v.Killed != Victim {
		t.Errorf("killed %q, want %q", v.Killed, Victim)
	}
	if v.KilledOrder == "" {
		t.Errorf("the victim was not killed mid-handler")
	}
	if v.TakenOver != v.Orphaned || v.Orphaned < 1 {
		t.Errorf("%s took over %d of the %d messages %s held", Survivor, v.TakenOver, v.Orphaned, Victim)
	}

	s := out.String()
	for _, want := range []string{
		"-- phase steady", "-- phase slow", "-- phase failing", "-- phase protected", "-- phase recovered",
		"kill: billing-2 killed while charging", "takeover: billing-1 has taken over",
		"breaker open", "verdict: all invariants hold",
	} {
		if !strings.Contains(s, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	if strings.Contains(s, "\r") {
		t.Errorf("plain output (not a terminal) contains a carriage return")
	}
}

// Without idempotency the duplicates are paid twice: the verdict names
// "exactly once" and holds the rest. Quiet prints the verdict only.
func TestRunWithoutIdempotencyBreaksExactlyOnce(t *testing.T) {
	var out bytes.Buffer
	c := shortConfig(&out)
	c.DisableIdempotency = true
	c.Quiet = true
	v := runDemo(t, c)
	t.Logf("output:\n%s", out.String())

	if v.OK() {
		t.Fatal("verdict holds without idempotency; want exactly once broken")
	}
	if broken := v.Broken(); !slices.Contains(broken, CheckExactlyOnce) {
		t.Errorf("broken %v, want it to name %q", broken, CheckExactlyOnce)
	}
	ch, _ := v.Check(CheckExactlyOnce)
	if !strings.Contains(ch.Detail, "paid more than once") {
		t.Errorf("exactly-once detail %q does not say what was paid twice", ch.Detail)
	}
	if v.Paid <= int64(v.Good) {
		t.Errorf("%d payments for %d good orders: the duplicates were not paid twice", v.Paid, v.Good)
	}
	if v.DuplicatesSuppressed != 0 {
		t.Errorf("%d duplicates suppressed without idempotency", v.DuplicatesSuppressed)
	}
	s := out.String()
	if !strings.HasPrefix(s, "verdict: BROKEN: exactly once") {
		t.Errorf("quiet output does not begin with the broken verdict:\n%s", s)
	}
	if strings.Contains(s, "-- phase") || strings.Contains(s, "published ") && strings.Contains(s, "lag ") {
		t.Errorf("quiet output has status or phase lines:\n%s", s)
	}
}

// One seed, one set of orders; another seed, another.
func TestPlanIsReproducibleFromTheSeed(t *testing.T) {
	a, b, other := newPlan(300, 42), newPlan(300, 42), newPlan(300, 43)
	if !slices.Equal(a.orders, b.orders) {
		t.Fatal("two plans from seed 42 differ")
	}
	if slices.Equal(a.orders, other.orders) {
		t.Fatal("plans from seeds 42 and 43 are the same")
	}
	kinds := map[int]int{}
	dups := 0
	for _, o := range a.orders {
		kinds[o.poison]++
		if o.duplicate {
			dups++
			if o.poison != poisonNone {
				t.Errorf("poison order %s is also duplicated", o.id)
			}
		}
	}
	if kinds[poisonBadType] != 1 || kinds[poisonTruncated] != 1 || kinds[poisonGarbage] != 1 || kinds[poisonTransient] != 1 {
		t.Errorf("poison kinds %v, want one of each", kinds)
	}
	if dups != 15 {
		t.Errorf("%d duplicated orders of 300, want 15", dups)
	}
}

// The poison bodies do not decode, and the good ones do, through the same
// JSON handler the billing consumers use.
func TestPoisonBodiesAreDecodeErrors(t *testing.T) {
	h := consumer.JSON(func(context.Context, OrderPlaced, *consumer.Message) error { return nil })
	for _, o := range newPlan(MinOrders, 7).orders {
		err := h.Handle(context.Background(), &consumer.Message{Body: o.body()})
		permanent := o.poison != poisonNone && o.poison != poisonTransient
		if consumer.IsPermanent(err) != permanent {
			t.Errorf("order %s (poison kind %d): Handle = %v, want permanent %v", o.id, o.poison, err, permanent)
		}
	}
}

// Each invariant fails on its own fault, and names it.
func TestJudgeNamesEachBrokenInvariant(t *testing.T) {
	p := newPlan(MinOrders, 3)
	var committed []string
	good := ""
	for _, o := range p.orders {
		committed = append(committed, o.id)
		if o.poison == poisonNone && good == "" {
			good = o.id
		}
	}
	healthy := func() facts {
		f := facts{plan: p, committed: committed, paid: map[string]int{}}
		for _, o := range p.orders {
			if o.poison == poisonNone {
				f.paid[o.id] = 1
				continue
			}
			f.dlq = append(f.dlq, consumer.Message{Key: o.id, Headers: map[string]string{
				consumer.HeaderDLQReason: o.wantReason(), consumer.HeaderDLQError: "boom"}})
		}
		return f
	}
	for _, tc := range []struct {
		name  string
		fault func(*facts)
		want  string
	}{
		{"healthy", func(*facts) {}, ""},
		{"paid twice", func(f *facts) { f.paid[good] = 2 }, CheckExactlyOnce},
		{"poison paid", func(f *facts) { f.paid[p.poison()[0].id] = 1 }, CheckExactlyOnce},
		{"poison missing", func(f *facts) { f.dlq = f.dlq[1:] }, CheckPoisonDeadLettered},
		{"poison without reason", func(f *facts) { delete(f.dlq[0].Headers, consumer.HeaderDLQReason) }, CheckPoisonDeadLettered},
		{"poison with the wrong reason", func(f *facts) {
			for i := range f.dlq {
				f.dlq[i].Headers[consumer.HeaderDLQReason] = "max-attempts"
			}
		}, CheckPoisonDeadLettered},
		{"good dead-lettered", func(f *facts) {
			f.dlq = append(f.dlq, consumer.Message{Key: good, Headers: map[string]string{}})
		}, CheckNoGoodDeadLettered},
		{"unpaid", func(f *facts) { delete(f.paid, good) }, CheckNothingLost},
		{"outbox not empty", func(f *facts) { f.backlog.Events = 1 }, CheckNothingLost},
		{"failed event", func(f *facts) { f.backlog.Failed = 1 }, CheckNothingLost},
		{"queue not empty", func(f *facts) { f.queueLeft = 2 }, CheckNothingLost},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := healthy()
			tc.fault(&f)
			v := Verdict{Checks: judge(f)}
			var want []string
			if tc.want != "" {
				want = []string{tc.want}
			}
			if got := v.Broken(); !slices.Equal(got, want) {
				t.Errorf("broken %v, want %v", got, want)
			}
			if v.OK() != (tc.want == "") {
				t.Errorf("OK() = %v", v.OK())
			}
			var b bytes.Buffer
			v.Report(&b)
			if tc.want != "" && !strings.HasPrefix(b.String(), "verdict: BROKEN: "+tc.want) {
				t.Errorf("report does not name %q:\n%s", tc.want, b.String())
			}
		})
	}
}

// A verdict without checks is not a pass.
func TestEmptyVerdictIsNotOK(t *testing.T) {
	if (Verdict{}).OK() {
		t.Fatal("a verdict with no checks is OK")
	}
}

func TestValidateNamesTheField(t *testing.T) {
	for _, tc := range []struct {
		field string
		set   func(*Config)
	}{
		{"Orders", func(c *Config) { c.Orders = MinOrders - 1 }},
		{"Steady", func(c *Config) { c.Steady = 0 }},
		{"Slow", func(c *Config) { c.Slow = -time.Second }},
		{"Failing", func(c *Config) { c.Failing = 0 }},
		{"Protected", func(c *Config) { c.Protected = 0 }},
		{"Recovered", func(c *Config) { c.Recovered = 0 }},
		{"StatusInterval", func(c *Config) { c.StatusInterval = 0 }},
		{"SlowLatency", func(c *Config) { c.SlowLatency = c.BaseLatency / 2 }},
		{"VisibilityTimeout", func(c *Config) { c.VisibilityTimeout = 10 * time.Millisecond }},
	} {
		c := DefaultConfig()
		tc.set(&c)
		err := c.Validate()
		var ce *consumer.ConfigError
		if !errors.As(err, &ce) || ce.Field != tc.field {
			t.Errorf("%s: Validate = %v, want a ConfigError naming %s", tc.field, err, tc.field)
		}
		if _, err := Run(context.Background(), c); !errors.Is(err, consumer.ErrInvalidConfig) {
			t.Errorf("%s: Run = %v, want ErrInvalidConfig", tc.field, err)
		}
	}
	if err := DefaultConfig().Validate(); err != nil {
		t.Errorf("DefaultConfig().Validate() = %v", err)
	}
}

// The default run fits in a minute: the phases, plus the longest drain.
func TestDefaultRunFitsInAMinute(t *testing.T) {
	c := DefaultConfig()
	if total := c.production() + c.Recovered; total > time.Minute {
		t.Errorf("default phases add up to %s, over a minute", total)
	}
}

// On a terminal the status is rewritten in place and events go above it;
// elsewhere each is a line.
func TestPrinterRewritesTheStatusLineOnATerminal(t *testing.T) {
	s := snapshot{elapsed: 1500 * time.Millisecond, phase: PhaseSlow, published: 12, paid: 10, lag: 2,
		oldest: 1200 * time.Millisecond, breaker: "closed"}

	for _, tc := range []struct {
		width int
		line  string
	}{
		{0, s.String()},        // width unknown: the full line
		{200, s.String()},      // wide: the full line
		{100, s.compact()},     // too narrow for it: the compact line
		{40, s.compact()[:39]}, // too narrow for both: cut
	} {
		var term bytes.Buffer
		p := &printer{out: &term, term: true, width: tc.width}
		p.status(s)
		p.event("kill")
		p.done()
		want := "\r\x1b[K" + tc.line + "\r\x1b[Kkill\n" + tc.line + "\n"
		if got := term.String(); got != want {
			t.Errorf("width %d: terminal output\n%q\nwant\n%q", tc.width, got, want)
		}
	}
	if len(s.String()) < 100 || len(s.compact()) >= 80 {
		t.Errorf("status lines of %d and %d columns: the test above needs a full line wider than 100, a compact one narrower than 80",
			len(s.String()), len(s.compact()))
	}

	var plain bytes.Buffer
	p := &printer{out: &plain}
	p.status(s)
	p.event("kill")
	p.done()
	if want := s.String() + "\nkill\n"; plain.String() != want {
		t.Errorf("plain output\n%q\nwant\n%q", plain.String(), want)
	}

	var quiet bytes.Buffer
	p = &printer{out: &quiet, quiet: true, term: true}
	p.status(s)
	p.event("kill")
	p.done()
	if quiet.Len() != 0 {
		t.Errorf("quiet printer wrote %q", quiet.String())
	}
}

func TestPhasesFollowTheClock(t *testing.T) {
	c := DefaultConfig()
	k := newClock(time.Now(), c)
	for _, tc := range []struct {
		at   time.Duration
		want Phase
	}{
		{0, PhaseSteady}, {c.Steady - 1, PhaseSteady}, {c.Steady, PhaseSlow},
		{c.Steady + c.Slow, PhaseFailing}, {c.Steady + c.Slow + c.Failing, PhaseProtected},
		{c.production(), PhaseRecovered}, {time.Hour, PhaseRecovered},
	} {
		if got := k.at(tc.at); got != tc.want {
			t.Errorf("phase at %s = %s, want %s", tc.at, got, tc.want)
		}
	}
}

// The run a newcomer gets from `ferry demo`, at its full default length:
// the short run above misses what only a long outage after the consumer kill
// shows (a breaker rule once let a good order burn its attempts and be
// dead-lettered here, and only the default run caught it).
func TestDefaultRunHoldsEveryInvariant(t *testing.T) {
	if testing.Short() {
		t.Skip("the default demo takes about 40 s")
	}
	var out bytes.Buffer
	c := DefaultConfig()
	c.Out = &out
	c.Quiet = true
	v := runDemo(t, c)
	if !v.OK() {
		t.Fatalf("verdict broken: %v\n%s", v.Broken(), out.String())
	}
}
