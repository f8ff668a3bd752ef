package consumer

import (
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// Errors a consumer that cannot consume reports: in Health (the cause of
// HealthDisconnected), in its WARN lines, and from Run when the driver
// gives up for good. Broker adapters wrap them, with the source, the
// broker's address (never a secret) and what the client saw, so that
// errors.Is tells the cases apart on every broker.
var (
	// ErrUnreachable: the broker cannot be reached (a refused or timed-out
	// dial, a lost connection, a DNS failure). Retried with backoff.
	ErrUnreachable = errors.New("broker unreachable")

	// ErrSourceNotFound: the broker answers, but the topic or queue to
	// consume does not exist. Retried with backoff: it may be created by
	// a deployment that runs after this one, and a restart would not make
	// it.
	ErrSourceNotFound = errors.New("source not found")

	// ErrRefused: the broker refused this client for good: credentials or
	// permissions refused, a TLS client on a plaintext listener or the
	// reverse, a configuration the broker rejects. Run ends with it
	// (wrapped by driver.Fatal): no retry can fix it.
	ErrRefused = errors.New("refused by the broker")
)

// connPhase is where a Loop stands with its broker.
type connPhase uint8

const (
	phaseIdle         connPhase = iota // Run not called yet
	phaseStarting                      // Run called; the broker has not answered yet
	phaseConnected                     // the last Connect or Fetch answered
	phaseDisconnected                  // the last Connect or Fetch failed
	phaseStopped                       // Run returned
)

// connState is what the loop knows of its link to the broker, for Health
// and for the lines it logs when the link changes.
type connState struct {
	mu       sync.Mutex
	phase    connPhase
	since    time.Time   // when the phase began
	err      error       // the cause: of the disconnection, or the error Run returned
	failures int         // consecutive failed Connect or Fetch calls
	reported bool        // a slow start was logged
	ok       atomic.Bool // phase is phaseConnected: the fetcher's fast path
}

func (c *connState) get() (phase connPhase, since time.Time, failures int, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.phase, c.since, c.failures, c.err
}

// starting marks the start of Run.
func (l *Loop) connStarting() {
	c := &l.conn
	c.mu.Lock()
	defer c.mu.Unlock()
	c.phase, c.since, c.err, c.failures, c.reported = phaseStarting, time.Now(), nil, 0, false
	c.ok.Store(false)
}

// connAnswered records a Connect or Fetch that returned without an error:
// the broker answers. After a disconnection it logs the reconnection.
func (l *Loop) connAnswered(log *slog.Logger) {
	c := &l.conn
	c.mu.Lock()
	if c.phase == phaseConnected {
		c.mu.Unlock()
		return
	}
	was, since, failures, cause := c.phase, c.since, c.failures, c.err
	c.phase, c.since, c.err, c.failures = phaseConnected, time.Now(), nil, 0
	c.ok.Store(true)
	c.mu.Unlock()
	switch was {
	case phaseDisconnected:
		log.Info("ferry: consuming again: the broker answers", "source", l.caps.Source, "after", time.Since(since).Round(time.Millisecond),
			"failures", failures, "last_err", cause)
	case phaseStarting:
		log.Info("ferry: consuming: the broker answered", "source", l.caps.Source, "after", time.Since(since).Round(time.Millisecond))
	}
}

// connFailed records a failed Connect or Fetch and logs it: the first
// failure of a disconnection always, the rest rate-limited.
func (l *Loop) connFailed(log *slog.Logger, err error, retryIn time.Duration) {
	c := &l.conn
	c.mu.Lock()
	first := c.phase != phaseDisconnected
	if first {
		c.phase, c.since = phaseDisconnected, time.Now()
		c.ok.Store(false)
	}
	c.err = err
	c.failures++
	failures, since := c.failures, c.since
	c.mu.Unlock()
	l.stats.fetchErrors.Add(1)
	ok, left := l.logs.Allow("disconnected")
	if !first && !ok {
		return
	}
	log.Warn("ferry: cannot consume: "+connCause(err)+"; retrying", "source", l.caps.Source, "err", err,
		"retry_in", retryIn.Round(time.Millisecond), "failures", failures, "down_for", time.Since(since).Round(time.Millisecond),
		"unlogged", left)
}

// connStopped records that Run returned err.
func (l *Loop) connStopped(err error) {
	c := &l.conn
	c.mu.Lock()
	defer c.mu.Unlock()
	c.phase, c.since, c.err = phaseStopped, time.Now(), err
	c.ok.Store(false)
}

// connSlowStart logs, once a Run, that the broker has not answered within
// the report delay (WithReportAfter) of the start: a driver without
// Connect whose first Fetch still blocks.
func (l *Loop) connSlowStart(log *slog.Logger) {
	c := &l.conn
	c.mu.Lock()
	if c.phase != phaseStarting || c.reported {
		c.mu.Unlock()
		return
	}
	c.reported = true
	since := c.since
	c.mu.Unlock()
	log.Warn("ferry: cannot consume: the broker has not answered since the start", "source", l.caps.Source,
		"waiting_for", time.Since(since).Round(time.Millisecond))
}

// connCause names the kind of a connection error for a log line.
func connCause(err error) string {
	switch {
	case errors.Is(err, ErrSourceNotFound):
		return "the source does not exist"
	case errors.Is(err, ErrRefused):
		return "the broker refused the client"
	case errors.Is(err, ErrUnreachable):
		return "the broker is unreachable"
	}
	return "fetching failed"
}
