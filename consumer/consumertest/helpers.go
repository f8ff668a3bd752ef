package consumertest

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
)

// The suite's clocks. They are generous on purpose: the suite runs against
// remote brokers and on loaded two-core machines, and none of them is a
// claim about speed.
//
// patience is how long the suite waits for something that must happen. It
// is a variable only so that the suite's own tests can shorten it for runs
// that are meant to fail.
var patience = 30 * time.Second

const (
	// quiet is how long the suite watches for something that must not happen.
	quiet = 1500 * time.Millisecond
	// returnMargin is how long Run may take to return after its context
	// ended, on top of its shutdown grace.
	returnMargin = 5 * time.Second
	// grace is the shutdown grace of consumers that do not ask for another.
	grace = 2 * time.Second
	// poll is how often the suite looks at a condition it waits for.
	poll = 5 * time.Millisecond
)

// idHeader carries the suite's own id of each message, so that deliveries
// can be matched with what was published whatever the broker's message id.
// Its name is valid as an SQS message attribute, an AMQP header and a Kafka
// record header.
const idHeader = "ferrytest-id"

// suite is one test's view of the harness.
type suite struct {
	t    *testing.T
	h    Harness
	caps Capabilities

	pub consumer.Publisher // from the harness, on first use

	mu   sync.Mutex
	runs []*run
}

func newSuite(t *testing.T, h Harness, caps Capabilities) *suite {
	return &suite{t: t, h: h, caps: caps}
}

// source creates a fresh source.
func (s *suite) source(cfg SourceConfig) string {
	s.t.Helper()
	name := s.h.NewSource(s.t, cfg)
	if name == "" {
		s.t.Fatal("harness: NewSource returned an empty name")
	}
	return name
}

// leasedSource creates a source with the harness's short lease when it has
// one, so that a message the loop forgot to settle comes back quickly, and
// returns it with the time to watch for such a message.
func (s *suite) leasedSource(ordered bool) (string, time.Duration) {
	s.t.Helper()
	src := s.source(SourceConfig{Ordered: ordered, Lease: s.caps.Lease})
	return src, s.settleWindow()
}

// settleWindow is how long the suite watches for a redelivery that must not
// come: quiet, or the short lease and a second more.
func (s *suite) settleWindow() time.Duration {
	return max(quiet, s.caps.Lease+time.Second)
}

// publish publishes msgs to src and fails the test if it cannot.
func (s *suite) publish(src string, msgs ...consumer.Message) {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if s.pub == nil {
		if s.pub = s.h.Publisher(s.t); s.pub == nil {
			s.t.Fatal("harness: Publisher returned nil")
		}
	}
	if err := s.pub.Publish(ctx, src, msgs...); err != nil {
		s.t.Fatalf("publish %d message(s) to %q: %v", len(msgs), src, err)
	}
}

// messages makes n messages whose suite id and body are prefix-i.
func messages(prefix string, n int) []consumer.Message {
	msgs := make([]consumer.Message, n)
	for i := range msgs {
		msgs[i] = message(prefix + "-" + strconv.Itoa(i))
	}
	return msgs
}

// message makes one message whose suite id and body are id.
func message(id string) consumer.Message {
	return consumer.Message{Body: []byte(id), Headers: map[string]string{idHeader: id}}
}

// run is one Consumer.Run in its own goroutine.
type run struct {
	s      *suite
	name   string
	grace  time.Duration
	cancel context.CancelFunc
	done   chan struct{}
	err    error // set before done closes

	stopping atomic.Bool
	once     sync.Once
}

// start creates a consumer of src with the shutdown grace g and opts, and runs
// h on it until the test stops it or ends.
func (s *suite) start(name, src string, g time.Duration, h consumer.HandlerFunc, opts ...consumer.Option) *run {
	s.t.Helper()
	// The loop logs to the test's output, shown when it fails or with -v;
	// the harness may still choose another logger in its NewConsumer.
	logger := slog.New(slog.NewTextHandler(s.t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
	opts = append([]consumer.Option{
		consumer.WithName(name),
		consumer.WithLogger(logger),
		consumer.WithShutdownGrace(g),
	}, opts...)
	c := s.h.NewConsumer(s.t, src, opts...)
	if c == nil {
		s.t.Fatal("harness: NewConsumer returned nil")
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &run{s: s, name: name, grace: g, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(r.done)
		r.err = c.Run(ctx, h)
	}()
	s.mu.Lock()
	s.runs = append(s.runs, r)
	s.mu.Unlock()
	s.t.Cleanup(r.stop)
	return r
}

// stop cancels the run and waits for Run to return nil within its grace and
// returnMargin. It reports, once, a run that returned an error or did not
// return.
func (r *run) stop() {
	r.s.t.Helper()
	r.once.Do(func() {
		r.stopping.Store(true)
		r.cancel()
		if err := r.wait(r.grace + returnMargin); err != nil {
			r.s.t.Error(err)
		}
	})
}

// wait waits up to d for Run to return and says what was wrong if it did
// not return, or returned an error.
func (r *run) wait(d time.Duration) error {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-r.done:
		if r.err != nil {
			return fmt.Errorf("%s: Run returned %v, want nil after its context was cancelled", r.name, r.err)
		}
		return nil
	case <-timer.C:
		return fmt.Errorf("%s: Run did not return within %s of its context being cancelled (shutdown grace %s)", r.name, d, r.grace)
	}
}

// checkRuns fails the test if a Run returned before the test stopped it.
func (s *suite) checkRuns() {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, r := range s.runs {
		if r.stopping.Load() {
			continue
		}
		select {
		case <-r.done:
			s.t.Fatalf("%s: Run returned %v before its context was cancelled", r.name, r.err)
		default:
		}
	}
}

// waitFor polls cond until it holds, failing the test after patience or as
// soon as a Run returns on its own.
func (s *suite) waitFor(what string, cond func() bool) {
	s.t.Helper()
	s.waitUpTo(patience, what, cond)
}

func (s *suite) waitUpTo(d time.Duration, what string, cond func() bool) {
	s.t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		s.checkRuns()
		if time.Now().After(deadline) {
			s.t.Fatalf("gave up after %s waiting for %s", d, what)
		}
		time.Sleep(poll)
	}
}

// watch checks, for d, that check keeps returning nil, failing the test at
// the first error or as soon as a Run returns on its own.
func (s *suite) watch(d time.Duration, check func() error) {
	s.t.Helper()
	deadline := time.Now().Add(d)
	for {
		if err := check(); err != nil {
			s.t.Fatal(err)
		}
		s.checkRuns()
		if time.Now().After(deadline) {
			return
		}
		time.Sleep(poll)
	}
}

// delivery is what a handler saw of one delivery.
type delivery struct {
	consumer   string // which run handled it
	id         string // the suite's id (idHeader)
	msgID      string // the broker's id
	key        string
	body       []byte
	headers    map[string]string
	source     string
	lane       string
	attempt    int
	deliveries int
	start      time.Time
	end        time.Time // set by finish
}

// recorder collects deliveries. It is safe for concurrent use.
type recorder struct {
	mu   sync.Mutex
	all  []*delivery
	byID map[string][]*delivery
}

// begin records the start of a delivery and returns it; the handler calls
// finish when it returns.
func (r *recorder) begin(name string, m *consumer.Message) *delivery {
	d := &delivery{
		consumer:   name,
		id:         m.Header(idHeader),
		msgID:      m.ID,
		key:        m.Key,
		body:       slices.Clone(m.Body),
		headers:    maps.Clone(m.Headers),
		source:     m.Source,
		lane:       m.Lane,
		attempt:    m.Attempt,
		deliveries: m.Deliveries,
		start:      time.Now(),
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.byID == nil {
		r.byID = make(map[string][]*delivery)
	}
	r.all = append(r.all, d)
	r.byID[d.id] = append(r.byID[d.id], d)
	return d
}

// finish records the end of d.
func (r *recorder) finish(d *delivery) {
	r.mu.Lock()
	defer r.mu.Unlock()
	d.end = time.Now()
}

// handler returns a handler that records each delivery under name and then
// returns what then returns (nil when then is nil).
func (r *recorder) handler(name string, then func(ctx context.Context, m *consumer.Message) error) consumer.HandlerFunc {
	return func(ctx context.Context, m *consumer.Message) error {
		d := r.begin(name, m)
		defer r.finish(d)
		if then == nil {
			return nil
		}
		return then(ctx, m)
	}
}

// of returns copies of the deliveries of the message with suite id id, in
// the order they started.
func (r *recorder) of(id string) []delivery {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]delivery, len(r.byID[id]))
	for i, d := range r.byID[id] {
		out[i] = *d
	}
	return out
}

// total is the number of deliveries.
func (r *recorder) total() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.all)
}

// distinct is the number of different messages delivered.
func (r *recorder) distinct() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.byID)
}

// distinctBy is the number of different messages delivered to consumer name.
func (r *recorder) distinctBy(name string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	seen := make(map[string]bool)
	for _, d := range r.all {
		if d.consumer == name {
			seen[d.id] = true
		}
	}
	return len(seen)
}

// duplicates lists the suite ids delivered more than once, with the number
// of deliveries, sorted.
func (r *recorder) duplicates() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var dups []string
	for id, ds := range r.byID {
		if len(ds) > 1 {
			dups = append(dups, id+"×"+strconv.Itoa(len(ds)))
		}
	}
	slices.Sort(dups)
	return dups
}

// gauge counts how many of something are going on at once, and the most
// ever seen.
type gauge struct {
	now, peak atomic.Int64
}

func (g *gauge) inc() {
	n := g.now.Add(1)
	for {
		p := g.peak.Load()
		if n <= p || g.peak.CompareAndSwap(p, n) {
			return
		}
	}
}

func (g *gauge) dec() { g.now.Add(-1) }

// sleepCtx waits d or until ctx ends, and returns ctx's error in that case.
func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// firstN returns at most n elements of s, for error messages.
func firstN(s []string, n int) []string {
	if len(s) > n {
		return append(slices.Clone(s[:n]), "...")
	}
	return s
}

// cancelOnly cancels the run's context without waiting; stop waits.
func (r *run) cancelOnly() {
	r.stopping.Store(true)
	r.cancel()
}

// errBox keeps the first non-nil error set on it. It is safe for concurrent
// use.
type errBox struct {
	mu  sync.Mutex
	err error
}

// set keeps err if it is the first non-nil one, and returns err.
func (b *errBox) set(err error) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.err == nil {
		b.err = err
	}
	return err
}

func (b *errBox) get() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.err
}
