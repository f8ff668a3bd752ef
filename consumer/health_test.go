package consumer_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/memory"
)

func TestEvaluateFollowsBurrowsRules(t *testing.T) {
	cases := []struct {
		name       string
		lags, pos  []int64
		want       consumer.Verdict
		whyItMatts string
	}{
		{"caught up once", []int64{5, 0, 7}, []int64{1, 2, 3}, consumer.VerdictOK, "a lag of zero in the window"},
		{"draining", []int64{9, 7, 4}, []int64{1, 3, 6}, consumer.VerdictOK, "lag shrinks"},
		{"falling behind", []int64{3, 5, 9}, []int64{1, 2, 3}, consumer.VerdictWarn, "progress, growing lag"},
		{"stalled", []int64{3, 5, 9}, []int64{4, 4, 4}, consumer.VerdictStall, "no progress, growing lag"},
		{"stopped", []int64{6, 6, 6}, []int64{4, 4, 4}, consumer.VerdictStop, "no progress, lag unchanged"},
		{"rewound", []int64{3, 9, 9}, []int64{10, 4, 5}, consumer.VerdictRewind, "position went down"},
		{"bumpy but growing", []int64{3, 8, 6, 9}, []int64{1, 2, 3, 4}, consumer.VerdictOK, "the lag shrank once: not monotone"},
		{"one sample", []int64{3}, []int64{1}, consumer.VerdictOK, "too few samples to judge"},
	}
	for _, c := range cases {
		if got := consumer.Evaluate(c.lags, c.pos); got != c.want {
			t.Errorf("%s (%s): Evaluate(%v, %v) = %s, want %s", c.name, c.whyItMatts, c.lags, c.pos, got, c.want)
		}
	}
}

// healthScenario runs a loop over a memory queue with a fast health window
// and a publisher that adds perSecond messages a second until the test
// ends.
type healthScenario struct {
	t    *testing.T
	b    *memory.Broker
	loop *consumer.Loop
	stop func()
}

func newHealthScenario(t *testing.T, perTick int, h consumer.Handler, opts ...consumer.Option) *healthScenario {
	t.Helper()
	b, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	if err := b.CreateQueue("q", memory.QueueConfig{VisibilityTimeout: 10 * time.Second}); err != nil {
		t.Fatal(err)
	}
	l, err := b.NewConsumer(t.Context(), "q", append([]consumer.Option{
		consumer.WithName("billing"),
		consumer.WithHealthWindow(50*time.Millisecond, 8),
		consumer.WithRedeliveryBackoff(time.Millisecond, time.Millisecond),
	}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- l.Run(ctx, h) }()
	pubDone := make(chan struct{})
	go func() {
		defer close(pubDone)
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			msgs := make([]consumer.Message, perTick)
			if err := b.Publish(context.Background(), "q", msgs...); err != nil {
				return
			}
			select {
			case <-tick.C:
			case <-ctx.Done():
				return
			}
		}
	}()
	s := &healthScenario{t: t, b: b, loop: l}
	s.stop = func() {
		cancel()
		<-pubDone
		if err := <-done; err != nil {
			t.Error(err)
		}
	}
	t.Cleanup(s.stop)
	return s
}

// waitState waits until Health says want, and checks the HTTP answer then.
func (s *healthScenario) waitState(want consumer.HealthState) consumer.Health {
	s.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		h := s.loop.Health()
		if h.State == want {
			rec := httptest.NewRecorder()
			consumer.ReadinessHandler(s.loop).ServeHTTP(rec, httptest.NewRequest("GET", "/healthz", nil))
			wantCode := http.StatusOK
			if !h.Ready {
				wantCode = http.StatusServiceUnavailable
			}
			var body struct{ Consumers []consumer.Health }
			if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
				s.t.Fatalf("health JSON: %v: %s", err, rec.Body)
			}
			if rec.Code != wantCode || len(body.Consumers) != 1 || body.Consumers[0].Consumer != "billing" {
				s.t.Fatalf("GET /healthz in state %s = %d %s, want %d", want, rec.Code, rec.Body, wantCode)
			}
			return h
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("state never became %q; last %+v", want, h)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestHealthSteadyWhenTheConsumerKeepsUp(t *testing.T) {
	s := newHealthScenario(t, 5, consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }))
	time.Sleep(500 * time.Millisecond) // a full window of samples
	h := s.waitState(consumer.HealthSteady)
	if h.Acked == 0 || h.Samples < 3 {
		t.Fatalf("steady with no work seen: %+v", h)
	}
	for _, lane := range h.Lanes {
		if lane.Verdict != consumer.VerdictOK {
			t.Errorf("a consumer keeping up has lane %q %s", lane.Lane, lane.Verdict)
		}
	}
}

func TestHealthDownstreamSlowWhenLagClimbsWithoutErrors(t *testing.T) {
	s := newHealthScenario(t, 20, consumer.HandlerFunc(func(ctx context.Context, _ *consumer.Message) error {
		time.Sleep(20 * time.Millisecond) // 8 workers: 400 a second against 1,000 published
		return nil
	}))
	h := s.waitState(consumer.HealthDownstreamSlow)
	if h.LagGrowth <= 0 || h.Failed != 0 {
		t.Fatalf("downstream slow with lag growth %d and %d failures", h.LagGrowth, h.Failed)
	}
	if len(h.Lanes) != 1 || h.Lanes[0].Verdict != consumer.VerdictWarn {
		t.Fatalf("lanes %+v, want one lane WARN (progress, growing lag)", h.Lanes)
	}
}

func TestHealthRetryStormWhenFailuresOutnumberTheWorkDone(t *testing.T) {
	s := newHealthScenario(t, 2, consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		return errors.New("downstream refuses")
	}))
	h := s.waitState(consumer.HealthRetryStorm)
	if h.Failed < 10 || h.Failed <= h.Acked {
		t.Fatalf("retry storm on %d failures against %d acked", h.Failed, h.Acked)
	}
}

func TestHealthProtectedWhileABreakerIsOpen(t *testing.T) {
	br, err := consumer.NewBreaker(consumer.BreakerName("payments-api"), consumer.BreakerFailures(3), consumer.BreakerOpenFor(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	s := newHealthScenario(t, 2, br.Wrap(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		return errors.New("payments API down")
	})))
	h := s.waitState(consumer.HealthProtected)
	if len(h.Breakers) != 1 || h.Breakers[0].Name != "payments-api" || h.Breakers[0].State != consumer.BreakerOpen.String() {
		t.Fatalf("protected with breakers %+v", h.Breakers)
	}
}

func TestHealthBacklogPastRetentionWhenTheOldestMessageAges(t *testing.T) {
	var started atomic.Bool
	s := newHealthScenario(t, 1, consumer.HandlerFunc(func(ctx context.Context, _ *consumer.Message) error {
		started.Store(true)
		<-ctx.Done() // a handler that never finishes: what waits behind it ages
		return ctx.Err()
	}), consumer.WithConcurrency(1), consumer.WithMaxInFlight(1), consumer.WithRetention(2*time.Second, 0.25),
		consumer.WithShutdownGrace(10*time.Millisecond))
	h := s.waitState(consumer.HealthBacklogPastRetention)
	if h.OldestAge < 0.5 {
		t.Fatalf("past retention with the oldest %vs old", h.OldestAge)
	}
}

func TestHealthOptionsRefuseNonsense(t *testing.T) {
	b, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	for name, opt := range map[string]consumer.Option{
		"interval 0":   consumer.WithHealthWindow(0, 10),
		"2 samples":    consumer.WithHealthWindow(time.Second, 2),
		"retention 0":  consumer.WithRetention(0, 0.5),
		"fraction 1.5": consumer.WithRetention(time.Hour, 1.5),
	} {
		if _, err := b.NewConsumer(t.Context(), "q", opt); !errors.Is(err, consumer.ErrInvalidConfig) {
			t.Errorf("%s: NewConsumer = %v, want a ConfigError", name, err)
		}
	}
}
