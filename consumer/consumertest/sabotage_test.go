package consumertest_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/consumertest"
)

// The suite is only worth running if it fails for a consumer that breaks
// the contract. Each sabotage below breaks one clause of it on purpose, on
// the real memory broker, and TestSuiteCatchesSabotage runs the suite's
// subtest for that clause in a child process and expects it to fail.
// (A failing subtest cannot be observed from inside the same test binary
// without failing the parent, hence the child process.)

// sabotageEnv names the sabotage a child process runs under.
const sabotageEnv = "FERRY_CONSUMERTEST_SABOTAGE"

// sabotages maps a sabotage to the subtest that must catch it and the
// harness that commits it.
var sabotages = map[string]struct {
	clause  string
	harness func() *memHarness
}{
	// Every message handled twice.
	"handle-twice": {"EveryMessageDeliveredOnceWhenHandlersSucceed", func() *memHarness {
		return wrapped(func(h consumer.Handler) consumer.Handler {
			return consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
				_ = h.Handle(ctx, m)
				return h.Handle(ctx, m)
			})
		}, false)
	}},
	// Attempt never counted.
	"attempt-stuck": {"PanicIsRedeliveredAndRunGoesOn", func() *memHarness {
		return wrapped(func(h consumer.Handler) consumer.Handler {
			return consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
				m.Attempt = 1
				return h.Handle(ctx, m)
			})
		}, false)
	}},
	// RetryAfter's delay dropped.
	"retry-now": {"RetryAfterNotRedeliveredBeforeDelay", func() *memHarness {
		return wrapped(func(h consumer.Handler) consumer.Handler {
			return consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
				err := h.Handle(ctx, m)
				var ra *consumer.RetryAfterError
				if errors.As(err, &ra) {
					return consumer.RetryAfter(ra.Err, 0)
				}
				return err
			})
		}, false)
	}},
	// Handlers run in the background and the message is acked at once: no
	// bound on running handlers.
	"ack-early": {"MaxInFlightBoundsRunningAndUnackedMessages", func() *memHarness {
		return wrapped(func(h consumer.Handler) consumer.Handler {
			return consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
				c := *m
				go func() { _ = h.Handle(context.WithoutCancel(ctx), &c) }()
				return nil
			})
		}, false)
	}},
	// NotBefore dropped: a delayed message published at once.
	"publish-now": {"NotBeforeHoldsAMessageOrIsRefused", func() *memHarness {
		return &memHarness{publishNow: true}
	}},
	// A broker that delays claimed not to: the clause wants a refusal the
	// publish never makes.
	"claim-no-delays": {"NotBeforeHoldsAMessageOrIsRefused", func() *memHarness {
		return &memHarness{claimNoDelays: true}
	}},
	// Leases never extended.
	"no-extend": {"LongHandlerKeepsItsLease", func() *memHarness {
		return &memHarness{noExtend: true}
	}},
	// Bodies cut in half.
	"truncate-body": {"BodyKeyAndHeadersRoundTrip", func() *memHarness {
		return wrapped(func(h consumer.Handler) consumer.Handler {
			return consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
				m.Body = m.Body[:len(m.Body)/2]
				return h.Handle(ctx, m)
			})
		}, false)
	}},
	// A nil handler silently replaced by one that does nothing.
	"nil-handler-runs": {"NilHandlerIsAnError", func() *memHarness {
		return wrapped(nil, true)
	}},
	// Later messages of a key overtake earlier ones.
	"overtake": {"OrderedSourceKeepsKeyOrderWithConcurrency", func() *memHarness {
		return wrapped(overtake, false)
	}},
	// Hold treated as a failure: holds burn attempts.
	"hold-counts": {"HoldDoesNotCountAsAnAttempt", func() *memHarness {
		return wrapped(func(h consumer.Handler) consumer.Handler {
			return consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
				if err := h.Handle(ctx, m); errors.Is(err, consumer.ErrHeld) {
					return errors.New("held, counted as a failure")
				} else {
					return err
				}
			})
		}, false)
	}},
	// Attempt never counted, seen through plain handler errors.
	"attempt-stuck-on-error": {"HandlerErrorRedeliversWithNextAttempt", func() *memHarness {
		return wrapped(func(h consumer.Handler) consumer.Handler {
			return consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
				m.Attempt = 1
				return h.Handle(ctx, m)
			})
		}, false)
	}},
	// A failed handler run again in process, whatever the delivery mode.
	"retry-in-process": {"AtMostOnceNeverRedelivers", func() *memHarness {
		return wrapped(func(h consumer.Handler) consumer.Handler {
			return consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
				if err := h.Handle(ctx, m); err == nil {
					return nil
				}
				return h.Handle(ctx, m)
			})
		}, false)
	}},
	// Handlers cancelled the moment Run's context ends: no shutdown grace.
	"no-grace": {"ShutdownLetsRunningHandlerFinishAndAcks", func() *memHarness {
		return &memHarness{wrap: func(c consumer.Consumer) consumer.Consumer {
			return consumerFunc(func(ctx context.Context, h consumer.Handler) error {
				return c.Run(ctx, consumer.HandlerFunc(func(hctx context.Context, m *consumer.Message) error {
					hctx, cancel := context.WithCancel(hctx)
					defer cancel()
					defer context.AfterFunc(ctx, cancel)()
					return h.Handle(hctx, m)
				}))
			})
		}}
	}},
	// A consumer that hands back, at shutdown, what it fetched and did not
	// start (no grace to run it in).
	"hand-back-on-shutdown": {"GracefulShutdownHandsNothingBack", func() *memHarness {
		return &memHarness{opts: []consumer.Option{consumer.WithShutdownGrace(0)}}
	}},
	// A driver that does not let handlers reach its deliveries.
	"no-as": {"AsReachesTheBrokersDelivery", func() *memHarness {
		return &memHarness{plain: true}
	}},
	// A consumer that acks what it should give back at shutdown: the message
	// cut short is lost.
	"ack-on-shutdown": {"CancelMidHandlerLosesNothing", func() *memHarness {
		return &memHarness{ackReturns: true}
	}},
	// Run lingers long after its context ended.
	"slow-return": {"RunReturnsPromptlyAfterCancel", func() *memHarness {
		return &memHarness{wrap: func(c consumer.Consumer) consumer.Consumer {
			return consumerFunc(func(ctx context.Context, h consumer.Handler) error {
				err := c.Run(ctx, h)
				time.Sleep(10 * time.Second)
				return err
			})
		}}
	}},
	// Every message given back to the queue as soon as it is fetched, while
	// its handler runs: the other consumer takes it too.
	"give-back": {"TwoConsumersNeverHoldTheSameMessage", func() *memHarness {
		return &memHarness{giveBack: true}
	}},
	// As "overtake", under OrderByKey.
	"overtake-by-key": {"OrderByKeyKeepsKeyOrderWithConcurrency", func() *memHarness {
		return wrapped(overtake, false)
	}},
}

// overtake acks each message at once and handles it in the background after
// a pause that shrinks along the key's sequence (the ordering test's body),
// so later messages of a key overtake earlier ones.
func overtake(h consumer.Handler) consumer.Handler {
	return consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		c := *m
		seq, _ := strconv.Atoi(string(m.Body))
		go func() {
			time.Sleep(time.Duration(20-seq) * 5 * time.Millisecond)
			_ = h.Handle(context.WithoutCancel(ctx), &c)
		}()
		return nil
	})
}

// consumerFunc turns a function into a consumer.Consumer.
type consumerFunc func(ctx context.Context, h consumer.Handler) error

func (f consumerFunc) Run(ctx context.Context, h consumer.Handler) error { return f(ctx, h) }

// wrapped returns a harness whose consumers run every handler through mw
// and, when nilRuns, run a no-op handler in place of a nil one.
func wrapped(mw consumer.Middleware, nilRuns bool) *memHarness {
	return &memHarness{wrap: func(c consumer.Consumer) consumer.Consumer {
		return brokenConsumer{c: c, mw: mw, nilRuns: nilRuns}
	}}
}

type brokenConsumer struct {
	c       consumer.Consumer
	mw      consumer.Middleware
	nilRuns bool
}

func (b brokenConsumer) Run(ctx context.Context, h consumer.Handler) error {
	if h == nil && b.nilRuns {
		h = consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	}
	if h != nil && b.mw != nil {
		h = b.mw(h)
	}
	return b.c.Run(ctx, h)
}

// TestSabotaged runs one clause of the suite against a sabotaged memory
// broker. It runs only in the child processes of TestSuiteCatchesSabotage.
func TestSabotaged(t *testing.T) {
	name := os.Getenv(sabotageEnv)
	if name == "" {
		t.Skip("runs only as a child of TestSuiteCatchesSabotage")
	}
	sb, ok := sabotages[name]
	if !ok {
		t.Fatalf("unknown sabotage %q", name)
	}
	// The sabotaged clause fails whether its waits give up after 30 s or
	// after 5 s; the child need not take the long way.
	t.Cleanup(consumertest.SetPatience(5 * time.Second))
	consumertest.Run(t, sb.harness())
}

// TestSuiteCatchesSabotage checks that each clause of the suite fails for a
// consumer that breaks it.
func TestSuiteCatchesSabotage(t *testing.T) {
	if os.Getenv(sabotageEnv) != "" {
		t.Skip("already a child")
	}
	if testing.Short() {
		t.Skip("runs the suite in child processes; skipped with -short")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for name, sb := range sabotages {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			cmd := exec.CommandContext(t.Context(), exe,
				"-test.run=^TestSabotaged$/^"+sb.clause+"$", "-test.count=1", "-test.v")
			cmd.Env = append(os.Environ(), sabotageEnv+"="+name)
			out, err := cmd.CombinedOutput()
			var exit *exec.ExitError
			if !errors.As(err, &exit) {
				t.Fatalf("child run under sabotage %q: want a failing exit, got %v\n%s", name, err, out)
			}
			if want := "--- FAIL: TestSabotaged/" + sb.clause; !strings.Contains(string(out), want) {
				t.Fatalf("sabotage %q: the child failed, but not in %s:\n%s", name, sb.clause, out)
			}
			t.Logf("%s caught %s", sb.clause, name)
		})
	}
}
