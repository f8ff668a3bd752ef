package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/memory"
)

// starts records when each handler run began.
type starts struct {
	mu sync.Mutex
	at []time.Time
}

func (s *starts) add() {
	s.mu.Lock()
	s.at = append(s.at, time.Now())
	s.mu.Unlock()
}

// overRate returns the first moment at which more runs had started since
// begin than a bucket of burst refilled at perSecond allows, if any. A slow
// machine only starts runs later, never earlier, so this bound holds
// however loaded the machine is.
func (s *starts) overRate(begin time.Time, perSecond float64, burst int) (int, time.Duration, bool) {
	s.mu.Lock()
	at := slices.Clone(s.at)
	s.mu.Unlock()
	slices.SortFunc(at, func(a, b time.Time) int { return a.Compare(b) })
	for i, t := range at {
		allowed := float64(burst) + perSecond*t.Sub(begin).Seconds()
		if float64(i+1) > allowed+1e-9 {
			return i + 1, t.Sub(begin), true
		}
	}
	return 0, 0, false
}

// Sixteen workers with work for all of them start no more runs than the
// rate allows, and every message is handled once: the wait is not an
// attempt.
func TestRateLimitStartsNoMoreRunsThanTheRate(t *testing.T) {
	s := newScenario(t, "ratelimit", time.Minute)
	s.publish("m", 60)
	const perSecond = 100
	rl, err := consumer.NewRateLimit(perSecond, consumer.RateLimitBurst(5))
	if err != nil {
		t.Fatal(err)
	}
	var st starts
	var calls counter
	begin := time.Now()
	l, _ := s.run(rl.Wrap(consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
		st.add()
		calls.add(m.ID)
		if m.Attempt != 1 {
			return fmt.Errorf("attempt %d: a wait counted as an attempt", m.Attempt)
		}
		return nil
	})), consumer.WithConcurrency(16))
	testenv.WaitFor(t, 30*time.Second, "60 messages acked", func() bool { return l.Stats().Acked == 60 },
		func() string { return fmt.Sprintf("%+v", l.Stats()) })
	if n, at, over := st.overRate(begin, perSecond, 5); over {
		t.Fatalf("%d runs had started %s after the consumer began: more than a burst of 5 and %d a second allow", n, at, perSecond)
	}
	if calls.len() != 60 || l.Stats().Failed != 0 {
		t.Fatalf("%d messages handled, %d runs failed; want 60 and none", calls.len(), l.Stats().Failed)
	}
	if rl.Waited() == 0 || rl.WaitedFor() <= 0 {
		t.Errorf("Waited %d, WaitedFor %s: the waits were not counted", rl.Waited(), rl.WaitedFor())
	}
}

// The check above catches a limiter that lets runs through too fast: with
// no rate limit the same runs break the bound.
func TestRateLimitCheckCatchesAnUnlimitedConsumer(t *testing.T) {
	s := newScenario(t, "unlimited", time.Minute)
	s.publish("m", 60)
	var st starts
	begin := time.Now()
	l, _ := s.run(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		st.add()
		return nil
	}), consumer.WithConcurrency(16))
	testenv.WaitFor(t, 30*time.Second, "60 messages acked", func() bool { return l.Stats().Acked == 60 })
	if _, _, over := st.overRate(begin, 100, 5); !over {
		t.Fatal("60 unlimited runs stayed within 100 a second: the check cannot fail")
	}
}

// The Standard stack with a rate limit limits the handler's runs, and a
// run whose context's deadline comes before its turn (a RateLimit a user
// put inside a Timeout) is handed back at once, unattempted, rather than
// wait out the deadline.
func TestStandardRateLimitLimitsAndHandsBackWhatCannotStartInTime(t *testing.T) {
	s := newScenario(t, "standard-rate", time.Minute)
	st := standard(t, s.b, s.dlq, consumer.StandardRateLimit(50))
	if st.RateLimit == nil {
		t.Fatal("StandardRateLimit(50) made no RateLimit")
	}
	s.publish("m", 20)
	var st2 starts
	begin := time.Now()
	l, _ := s.run(st.Wrap(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		st2.add()
		return nil
	})), consumer.WithConcurrency(8))
	testenv.WaitFor(t, 30*time.Second, "20 messages acked", func() bool { return l.Stats().Acked == 20 })
	if n, at, over := st2.overRate(begin, 50, 1); over {
		t.Fatalf("%d runs had started %s in: more than the stack's 50 a second allow", n, at)
	}

	rl, err := consumer.NewRateLimit(1)
	if err != nil {
		t.Fatal(err)
	}
	h := rl.Wrap(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }))
	if err := h.Handle(context.Background(), &consumer.Message{}); err != nil { // takes the one token
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	began := time.Now()
	err = h.Handle(ctx, &consumer.Message{})
	if !consumer.IsDeferred(err) || !errors.Is(err, consumer.ErrRateLimited) {
		t.Fatalf("a run whose deadline comes before its turn = %v, want a Defer of ErrRateLimited", err)
	}
	if waited := time.Since(began); waited > 40*time.Millisecond {
		t.Errorf("it waited %s for a turn it could not reach before its deadline", waited)
	}
}

// A consumer stopped while runs wait for their turn hands them back
// unattempted and stops promptly: the wait is cut short, and nothing is
// lost or failed.
func TestRateLimitWaitEndsWithTheConsumer(t *testing.T) {
	s := newScenario(t, "stopping", time.Minute)
	s.publish("m", 20)
	rl, err := consumer.NewRateLimit(0.5) // a run every two seconds
	if err != nil {
		t.Fatal(err)
	}
	var ran atomic.Int32
	l, stop := s.run(rl.Wrap(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		ran.Add(1)
		return nil
	})), consumer.WithConcurrency(4), consumer.WithShutdownGrace(100*time.Millisecond))
	testenv.WaitFor(t, 10*time.Second, "runs waiting for their turn", func() bool { return rl.Waiting() > 0 })
	stopped := make(chan struct{})
	go func() { stop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(20 * time.Second):
		t.Fatal("the consumer did not stop while its runs waited for their turn")
	}
	st := l.Stats()
	if st.Failed != 0 || st.Acked != int64(ran.Load()) {
		t.Fatalf("stats %+v after %d runs: a cut wait must fail nothing and ack only what ran", st, ran.Load())
	}
	if rl.Waiting() != 0 {
		t.Errorf("%d runs still counted as waiting after the stop", rl.Waiting())
	}
}

// Bad configuration fails at construction with a ConfigError naming it.
func TestNewRateLimitRefusesBadConfigNamingTheField(t *testing.T) {
	for _, c := range []struct {
		field string
		rate  float64
		opts  []consumer.RateLimitOption
	}{
		{"RateLimit.PerSecond", 0, nil},
		{"RateLimit.PerSecond", -1, nil},
		{"RateLimit.Burst", 1, []consumer.RateLimitOption{consumer.RateLimitBurst(0)}},
	} {
		_, err := consumer.NewRateLimit(c.rate, c.opts...)
		var ce *consumer.ConfigError
		if !errors.As(err, &ce) || ce.Field != c.field {
			t.Errorf("NewRateLimit(%v, ...) = %v, want a ConfigError naming %s", c.rate, err, c.field)
		}
	}
	b, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if _, err := consumer.Standard(b, "dlq", consumer.StandardRateLimit(0)); err == nil {
		t.Error("Standard accepted a rate limit of 0")
	}
}

// BenchmarkRateLimitHoldsItsRate runs two seconds of messages through a
// RateLimit over the memory broker, at 1k and 10k a second, and reports
// the rate the runs started at as a share of the limit (of-limit: 1 is
// exact; the goal is within 5%), measured from the first run's start to
// the last's.
//
//	go test -run '^$' -bench BenchmarkRateLimitHoldsItsRate -benchtime 3x ./consumer/
func BenchmarkRateLimitHoldsItsRate(b *testing.B) {
	for _, perSecond := range []int{1000, 10000} {
		b.Run(fmt.Sprintf("rate=%d", perSecond), func(b *testing.B) {
			n := 2 * perSecond
			var ratios []float64
			for range b.N {
				ratios = append(ratios, runRateLimited(b, perSecond, n))
			}
			slices.Sort(ratios)
			b.ReportMetric(ratios[len(ratios)/2], "of-limit")
		})
	}
}

func runRateLimited(b *testing.B, perSecond, n int) float64 {
	b.Helper()
	br, err := memory.New()
	if err != nil {
		b.Fatal(err)
	}
	defer br.Close()
	msgs := make([]consumer.Message, n)
	for i := range msgs {
		msgs[i] = consumer.Message{ID: strconv.Itoa(i), Body: []byte("x")}
	}
	if err := br.Publish(context.Background(), "rl", msgs...); err != nil {
		b.Fatal(err)
	}
	rl, err := consumer.NewRateLimit(float64(perSecond))
	if err != nil {
		b.Fatal(err)
	}
	l, err := br.NewConsumer(context.Background(), "rl", consumer.WithName("rl"), consumer.WithConcurrency(32), consumer.WithLogger(quiet))
	if err != nil {
		b.Fatal(err)
	}
	var mu sync.Mutex
	var first, last time.Time
	var count int
	done := make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	runDone := make(chan error, 1)
	go func() {
		runDone <- l.Run(ctx, rl.Wrap(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
			now := time.Now()
			mu.Lock()
			if count == 0 {
				first = now
			}
			last = now
			count++
			if count == n {
				close(done)
			}
			mu.Unlock()
			return nil
		})))
	}()
	<-done
	cancel()
	if err := <-runDone; err != nil {
		b.Fatal(err)
	}
	return float64(n-1) / last.Sub(first).Seconds() / float64(perSecond)
}
