package consumer

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/ferrymq/ferry/consumer/driver"
)

// This file is the loop's view of its own health: while Run runs, a sampler
// records the lag and the counters of the loop and of the middleware in its
// chain at a fixed interval, and Health judges the last window of samples:
// a verdict on each lane's lag in Burrow's terms, and one of the states
// that the failures of messaging fall into.

// Verdict is the evaluation of one lane's lag over the health window, in
// the terms of LinkedIn's Burrow.
type Verdict string

// Lag verdicts.
const (
	// VerdictOK: the lane keeps up (its lag reached zero in the window, or
	// shrinks).
	VerdictOK Verdict = "OK"
	// VerdictWarn: the lane progresses, but its lag grows.
	VerdictWarn Verdict = "WARN"
	// VerdictStall: the lane does not progress while its lag grows.
	VerdictStall Verdict = "STALL"
	// VerdictStop: the lane neither progresses nor changes its lag, with
	// messages waiting: nobody consumes it.
	VerdictStop Verdict = "STOP"
	// VerdictRewind: the lane's position went backwards (a reset offset, a
	// redrive): its messages are read again.
	VerdictRewind Verdict = "REWIND"
)

// HealthState is what a consumer's figures over the health window say about
// it: the silent failures of messaging, named.
type HealthState string

// Health states, from the least to the most urgent.
const (
	// HealthSteady: nothing below.
	HealthSteady HealthState = "steady"
	// HealthDownstreamSlow: lag and the backlog's age climb and handlers do
	// not fail: what they call is slow.
	HealthDownstreamSlow HealthState = "downstream slow"
	// HealthRetryStorm: failed runs and retries outnumber the messages
	// done: the load is retries, not work.
	HealthRetryStorm HealthState = "retry storm"
	// HealthBacklogPastRetention: the oldest waiting message is older than
	// the configured fraction of the source's retention (WithRetention):
	// the broker will delete messages before they are handled.
	HealthBacklogPastRetention HealthState = "backlog past retention"
	// HealthProtected: a circuit breaker of the chain is open or held
	// messages in the window: the consumer protects its downstream and
	// waits. This is the breaker doing its job: it is not ready, but alive.
	HealthProtected HealthState = "protected"
	// HealthDeadLetterFailing: a dead-letter publish failed and none has
	// succeeded since: the messages that should go there go back to the
	// broker instead, and (on an ordered source) hold their lane.
	HealthDeadLetterFailing HealthState = "dead-letter failing"
	// HealthStarting: Run has not reached the broker yet (or was not called).
	HealthStarting HealthState = "starting"
	// HealthDisconnected: the last attempt to reach the broker or the
	// source failed (Health.Error says why); the loop retries with backoff.
	HealthDisconnected HealthState = "disconnected"
	// HealthWedged: messages wait, yet the consumer made no progress at all
	// (nothing fetched, finished, settled or held) for longer than
	// WithWedgedAfter: a handler hangs, or the loop is stuck. Not alive.
	HealthWedged HealthState = "wedged"
	// HealthStopped: Run returned (Health.Error holds what it returned).
	// Not alive.
	HealthStopped HealthState = "stopped"
)

// unhealthy reports whether the state calls for someone to act: every
// state but steady and downstream slow. A consumer in such a state is not
// ready (Health.Ready); whether it is alive is another question (live).
func (s HealthState) unhealthy() bool {
	return s != HealthSteady && s != HealthDownstreamSlow
}

// live reports whether a consumer in this state is alive, as a liveness
// probe asks: only a stopped or wedged consumer is not, because only a
// restart can help it. An open breaker (protected), a broker that is down
// (disconnected) or a storm of retries are not cured by a restart; failing
// liveness there would restart every pod during the very outage the
// consumer is riding out.
func (s HealthState) live() bool {
	return s != HealthStopped && s != HealthWedged
}

// LaneHealth is one lane's lag and its verdict.
type LaneHealth struct {
	Lane     string  `json:"lane"`
	Lag      int64   `json:"lag"`
	Position int64   `json:"position"` // committed offset (Kafka), or messages acked where the broker has no position
	Verdict  Verdict `json:"verdict"`
}

// BreakerHealth is one circuit breaker of the chain.
type BreakerHealth struct {
	Name  string `json:"name"`
	State string `json:"state"`
}

// Health is a consumer's state and the figures behind it, over the window
// of samples ending at At.
type Health struct {
	Consumer string      `json:"consumer"`
	Source   string      `json:"source,omitempty"` // the topic or queue, where the driver names it
	State    HealthState `json:"state"`
	Reason   string      `json:"reason"` // one sentence naming the figures that decided the state
	Live     bool        `json:"live"`   // the state is neither stopped nor wedged: what a liveness probe should see
	Ready    bool        `json:"ready"`  // the state is steady or downstream slow: what a readiness probe should see
	// Error is the cause of a disconnection, or what Run returned.
	Error   string    `json:"error,omitempty"`
	At      time.Time `json:"at"`
	Window  string    `json:"window"` // the time the samples span
	Samples int       `json:"samples"`

	Lag       int64   `json:"lag"`        // messages not yet done now, waiting or in flight (see MetricLag; -1 where the broker does not say)
	LagGrowth int64   `json:"lag_growth"` // lag now minus lag at the window's start
	OldestAge float64 `json:"oldest_age_seconds"`

	// Counted over the window.
	Acked        int64 `json:"acked"`
	Failed       int64 `json:"failed"`
	Retries      int64 `json:"retries"`
	Held         int64 `json:"held"`
	DeadLettered int64 `json:"dead_lettered"`

	Breakers []BreakerHealth `json:"breakers,omitempty"`
	Lanes    []LaneHealth    `json:"lanes,omitempty"`
}

// healthSample is what the sampler records at one tick.
type healthSample struct {
	at           time.Time
	lagKnown     bool
	lag          int64 // not yet done: lagOf the driver's Lag
	delayed      int64 // of lag, what the broker holds until a time (Lag.Delayed)
	oldest       time.Duration
	lanes        map[string]int64
	positions    map[string]int64
	acked        int64
	failed       int64
	retries      int64
	held         int64
	deadLettered int64
	dlqFailures  int64
	progress     int64 // every count that moves when the loop makes progress
	inFlight     int64
}

// healthWindow keeps the last samples, oldest first.
type healthWindow struct {
	mu       sync.Mutex
	samples  []healthSample
	size     int
	parts    chainParts
	interval time.Duration
	// lastProgress is when a sample last saw progress (or the first sample).
	lastProgress time.Time
}

func (w *healthWindow) add(s healthSample) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.samples) == w.size {
		copy(w.samples, w.samples[1:])
		w.samples = w.samples[:w.size-1]
	}
	if n := len(w.samples); n == 0 || w.samples[n-1].progress != s.progress || w.lastProgress.IsZero() {
		w.lastProgress = s.at
	}
	w.samples = append(w.samples, s)
}

// sampleHealth records samples every interval until ctx ends.
func (l *Loop) sampleHealth(ctx context.Context) {
	t := time.NewTicker(l.health.interval)
	defer t.Stop()
	for {
		l.health.add(l.takeSample(ctx))
		select {
		case <-t.C:
		case <-ctx.Done():
			return
		}
	}
}

func (l *Loop) takeSample(ctx context.Context) healthSample {
	st := l.Stats()
	s := healthSample{
		at:       time.Now(),
		acked:    st.Acked,
		failed:   st.Failed,
		held:     st.Held,
		inFlight: st.InFlight,
		progress: st.Fetched + st.Acked + st.Returned + st.Failed + st.Held + st.Deferred + st.Retried + st.Revoked + st.Dropped,
	}
	p := l.health.parts
	for _, r := range p.retries {
		s.retries += r.Retries()
	}
	for _, d := range p.deadLetters {
		s.deadLettered += d.Count()
		s.dlqFailures += d.PublishFailures()
	}
	for _, b := range p.breakers {
		s.held += b.Held()
	}
	s.progress += s.retries + s.held + s.deadLettered
	if _, ok := l.drv.(driver.LagReporter); ok {
		lctx, cancel := context.WithTimeout(ctx, max(l.health.interval, time.Second))
		lag, err := l.Lag(lctx)
		cancel()
		if err == nil {
			s.lagKnown, s.lag, s.oldest, s.lanes, s.positions = true, lagOf(lag), lag.OldestAge, lag.Lanes, lag.Positions
			s.delayed = min(max(lag.Delayed, 0), s.lag)
		}
	}
	return s
}

// lagOf is the one number that Health.Lag, the lag metric and ferry lag
// say: the messages not yet done, those waiting (Lag.Messages) and those
// taken and not yet settled (Lag.InFlight). A log's driver counts the
// records its member fetched in InFlight and not in Messages, so that the
// sum is the end offsets minus the committed ones, as ferry lag reads it.
func lagOf(lag driver.Lag) int64 {
	return lag.Messages + max(lag.InFlight, 0)
}

// lastLag returns the lag of the newest health sample, when Run took one
// within the last two sampling intervals: readers of the lag between
// samples (the metrics) need not ask the broker again.
func (l *Loop) lastLag() (notDone int64, oldest time.Duration, ok bool) {
	l.health.mu.Lock()
	defer l.health.mu.Unlock()
	n := len(l.health.samples)
	if n == 0 {
		return 0, 0, false
	}
	s := l.health.samples[n-1]
	if !s.lagKnown || time.Since(s.at) > 2*l.health.interval {
		return 0, 0, false
	}
	return s.lag, s.oldest, true
}

// Health returns the consumer's state and the figures behind it, judged
// over the samples of the health window (WithHealthWindow). Before Run has
// taken two samples the figures are partial and the state is judged on
// what is known (a breaker open, the backlog's age).
func (l *Loop) Health() Health {
	l.health.mu.Lock()
	samples := slices.Clone(l.health.samples)
	parts := l.health.parts
	lastProgress := l.health.lastProgress
	l.health.mu.Unlock()
	h := judge(l.cfg, samples, parts)
	h.Source = l.caps.Source
	var delayed int64
	if n := len(samples); n > 0 && samples[n-1].lagKnown {
		delayed = samples[n-1].delayed
	}
	l.judgeLink(&h, lastProgress, delayed)
	h.Live, h.Ready = h.State.live(), !h.State.unhealthy()
	return h
}

// judgeLink puts the loop's link to the broker, and whether it makes
// progress, before what the samples say: a consumer that is stopped,
// wedged, disconnected or starting is that, whatever its figures. delayed
// is how much of the lag the broker holds until a time: a consumer whose
// only lag is that has nothing to do, and is not wedged.
func (l *Loop) judgeLink(h *Health, lastProgress time.Time, delayed int64) {
	phase, since, failures, err := l.conn.get()
	if err != nil {
		h.Error = err.Error()
	}
	switch phase {
	case phaseStopped:
		h.State = HealthStopped
		h.Reason = fmt.Sprintf("Run returned %s ago", time.Since(since).Round(time.Second))
		if err == nil {
			h.Reason += " (its context ended)"
		}
		return
	case phaseIdle:
		h.State, h.Reason = HealthStarting, "Run has not been called"
		return
	}
	waiting := h.Lag-delayed > 0 || l.inflight.Load() > 0
	if stuck := time.Since(lastProgress); phase == phaseConnected && waiting && !lastProgress.IsZero() && stuck > l.cfg.wedgedAfter {
		h.State = HealthWedged
		h.Reason = fmt.Sprintf("no progress for %s with %d messages in flight and a lag of %d (WithWedgedAfter %s)",
			stuck.Round(time.Second), l.inflight.Load(), h.Lag, l.cfg.wedgedAfter)
		return
	}
	switch phase {
	case phaseDisconnected:
		h.State = HealthDisconnected
		h.Reason = fmt.Sprintf("%s for %s (%d failures in a row); retrying", connCause(err), time.Since(since).Round(time.Second), failures)
	case phaseStarting:
		h.State = HealthStarting
		h.Reason = fmt.Sprintf("the broker has not answered yet (%s since Run began)", time.Since(since).Round(time.Second))
	}
}

// judge decides the health from a window of samples.
func judge(cfg config, samples []healthSample, parts chainParts) Health {
	h := Health{Consumer: cfg.name, State: HealthSteady, Samples: len(samples), Lag: -1}
	for _, b := range parts.breakers {
		h.Breakers = append(h.Breakers, BreakerHealth{Name: b.Name(), State: b.State().String()})
	}
	if len(samples) == 0 {
		h.At = time.Now()
		h.Reason = "no samples yet"
		return h
	}
	first, last := samples[0], samples[len(samples)-1]
	h.At = last.at
	h.Window = last.at.Sub(first.at).Round(time.Millisecond).String()
	h.Acked = last.acked - first.acked
	h.Failed = last.failed - first.failed
	h.Retries = last.retries - first.retries
	h.Held = last.held - first.held
	h.DeadLettered = last.deadLettered - first.deadLettered
	if last.lagKnown {
		h.Lag = last.lag
		h.OldestAge = last.oldest.Seconds()
		if first.lagKnown {
			h.LagGrowth = last.lag - first.lag
		}
	}
	h.Lanes = laneVerdicts(samples)

	// From h.Breakers, read once above: a breaker that changes state
	// meanwhile must not make the state disagree with the list.
	open, openState := "", ""
	for _, b := range h.Breakers {
		if b.State != BreakerClosed.String() {
			open, openState = b.Name, b.State
			break
		}
	}
	retryLoad := h.Failed + h.Retries
	switch {
	case deadLetterFailing(samples):
		h.State = HealthDeadLetterFailing
		h.Reason = fmt.Sprintf("%d dead-letter publishes failed in %s and none succeeded since",
			last.dlqFailures-first.dlqFailures, h.Window)
	case open != "" || h.Held > 0:
		h.State = HealthProtected
		if open != "" {
			h.Reason = fmt.Sprintf("breaker %q is %s", open, openState)
		} else {
			h.Reason = fmt.Sprintf("%d runs held by a breaker in %s", h.Held, h.Window)
		}
	case cfg.retention > 0 && last.oldest > time.Duration(float64(cfg.retention)*cfg.retentionFraction):
		h.State = HealthBacklogPastRetention
		h.Reason = fmt.Sprintf("the oldest waiting message is %s old, past %.0f%% of the %s retention",
			last.oldest.Round(time.Second), 100*cfg.retentionFraction, cfg.retention)
	case len(samples) >= 2 && retryLoad >= minStorm && retryLoad > h.Acked:
		h.State = HealthRetryStorm
		h.Reason = fmt.Sprintf("%d failed runs and %d retries against %d messages done in %s", h.Failed, h.Retries, h.Acked, h.Window)
	case len(samples) >= 3 && h.Failed == 0 && climbing(samples):
		h.State = HealthDownstreamSlow
		h.Reason = fmt.Sprintf("lag grew by %d to %d in %s (oldest %s) with no failed run", h.LagGrowth, h.Lag, h.Window,
			last.oldest.Round(time.Millisecond))
	default:
		h.Reason = fmt.Sprintf("%d messages done in %s; lag %d", h.Acked, h.Window, h.Lag)
	}
	return h
}

// deadLetterFailing reports whether a dead-letter publish failed in the
// window with no message dead-lettered in the samples since.
func deadLetterFailing(samples []healthSample) bool {
	failedAt, lettered := -1, -1
	for i := 1; i < len(samples); i++ {
		if samples[i].dlqFailures > samples[i-1].dlqFailures {
			failedAt = i
		}
		if samples[i].deadLettered > samples[i-1].deadLettered {
			lettered = i
		}
	}
	return failedAt > 0 && lettered < failedAt
}

// minStorm is the fewest failed runs and retries in a window that make a
// retry storm: a handful of failures among few messages is not one.
const minStorm = 10

// climbing reports whether the lag grew over the window without reaching
// zero (the consumer never caught up), shrinking at no more than a quarter
// of the steps (lag sampled under load jitters), and the backlog's age grew
// too where the broker reports it.
func climbing(samples []healthSample) bool {
	first, last := samples[0], samples[len(samples)-1]
	if !first.lagKnown || !last.lagKnown || last.lag <= first.lag {
		return false
	}
	down := 0
	for i := range samples {
		if !samples[i].lagKnown || samples[i].lag == 0 {
			return false
		}
		if i > 0 && samples[i].lag < samples[i-1].lag {
			down++
		}
	}
	if 4*down > len(samples)-1 {
		return false
	}
	if last.oldest > 0 || first.oldest > 0 {
		return last.oldest > first.oldest
	}
	return true
}

// laneVerdicts evaluates each lane of the last sample over the window. A
// lane's position is its committed position where the broker reports one,
// else (a queue, lane "") the messages acked by this consumer.
func laneVerdicts(samples []healthSample) []LaneHealth {
	last := samples[len(samples)-1]
	if !last.lagKnown {
		return nil
	}
	lanes := last.lanes
	if len(lanes) == 0 {
		lanes = map[string]int64{"": last.lag}
	}
	out := make([]LaneHealth, 0, len(lanes))
	for lane := range lanes {
		var lags, positions []int64
		for _, s := range samples {
			if !s.lagKnown {
				continue
			}
			lag, pos, ok := laneAt(s, lane)
			if !ok {
				continue
			}
			lags = append(lags, lag)
			positions = append(positions, pos)
		}
		out = append(out, LaneHealth{Lane: lane, Lag: lags[len(lags)-1], Position: positions[len(positions)-1],
			Verdict: Evaluate(lags, positions)})
	}
	slices.SortFunc(out, func(a, b LaneHealth) int {
		if a.Lane < b.Lane {
			return -1
		}
		if a.Lane > b.Lane {
			return 1
		}
		return 0
	})
	return out
}

func laneAt(s healthSample, lane string) (lag, pos int64, ok bool) {
	if len(s.lanes) == 0 {
		if lane != "" {
			return 0, 0, false
		}
		return s.lag, s.acked, true
	}
	lag, ok = s.lanes[lane]
	if !ok {
		return 0, 0, false
	}
	if p, has := s.positions[lane]; has {
		return lag, p, true
	}
	return lag, s.acked, true
}

// Evaluate gives the verdict on one lane from its lag and its position at
// each sample of a window, oldest first, by Burrow's rules: a lag of zero
// anywhere in the window is OK; a position that went down is REWIND; a
// position that never moved with messages waiting is STOP when the lag did
// not change either, and STALL when it grew; a position that moved while
// the lag grew and never shrank is WARN; anything else is OK. Fewer than
// two samples are OK.
func Evaluate(lags, positions []int64) Verdict {
	n := min(len(lags), len(positions))
	if n < 2 {
		return VerdictOK
	}
	for i := 0; i < n; i++ {
		if lags[i] == 0 {
			return VerdictOK
		}
	}
	for i := 1; i < n; i++ {
		if positions[i] < positions[i-1] {
			return VerdictRewind
		}
	}
	first, last := 0, n-1
	if positions[last] == positions[first] {
		if lags[last] == lags[first] {
			return VerdictStop
		}
		if lags[last] > lags[first] {
			return VerdictStall
		}
		return VerdictOK
	}
	if lags[last] > lags[first] {
		for i := 1; i < n; i++ {
			if lags[i] < lags[i-1] {
				return VerdictOK
			}
		}
		return VerdictWarn
	}
	return VerdictOK
}

// ReadinessHandler serves the Health of each loop as JSON, with status 200
// when every consumer is ready (Health.Ready) and 503 when any is not:
// starting, disconnected, protected, retrying in a storm, dead-lettering
// nowhere, past its retention, wedged or stopped. Wire it to a Kubernetes
// readinessProbe: a consumer process serves no traffic, so failing it costs
// nothing and shows on every dashboard that something needs attention.
func ReadinessHandler(loops ...*Loop) http.Handler {
	return healthHandler(loops, func(h Health) bool { return h.Ready })
}

// LivenessHandler serves the Health of each loop as JSON, with status 200
// unless a consumer is stopped (its Run returned) or wedged (no progress
// while messages wait, for longer than WithWedgedAfter): the two cases a
// restart cures. Wire it to a Kubernetes livenessProbe. A consumer whose
// breaker is open, or whose broker is down, stays live: restarting it
// would not bring the dependency back, and restarting every pod during an
// outage undoes what the breaker does.
func LivenessHandler(loops ...*Loop) http.Handler {
	return healthHandler(loops, func(h Health) bool { return h.Live })
}

func healthHandler(loops []*Loop, ok func(Health) bool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		out := struct {
			Consumers []Health `json:"consumers"`
		}{Consumers: make([]Health, 0, len(loops))}
		status := http.StatusOK
		for _, l := range loops {
			h := l.Health()
			if !ok(h) {
				status = http.StatusServiceUnavailable
			}
			out.Consumers = append(out.Consumers, h)
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_ = json.NewEncoder(w).Encode(out)
	})
}
