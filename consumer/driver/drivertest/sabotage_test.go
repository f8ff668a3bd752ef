package drivertest_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/consumer/driver/drivertest"
	"github.com/ferrymq/ferry/memory"
)

// The suite is only worth running if it fails for a driver that breaks
// the contract. Each sabotage below wraps the memory broker's driver to
// break one clause on purpose, and TestSuiteCatchesSabotage runs the
// subtest of that clause in a child process (a failing subtest cannot be
// watched from the same test binary without failing its parent) and
// expects it to fail.

const sabotageEnv = "FERRY_DRIVERTEST_SABOTAGE"

// sabotages maps a sabotage to the clause that must catch it.
var sabotages = map[string]string{
	"fetch-over-max":  "FetchReturnsPublishedMessagesUpToMax",
	"fetch-drops-dst": "FetchReturnsPublishedMessagesUpToMax",
	"no-source":       "FetchReturnsPublishedMessagesUpToMax",
	"ctx-swallowed":   "FetchReturnsPromptlyWhenContextEnds",
	"ack-returns":     "AckedMessageNeverComesAgain",
	"delay-dropped":   "ReturnComesBackAfterItsDelay",
	"history-dropped": "ReturnComesBackAfterItsDelay",
	"extend-noop":     "ExtendedDeliveryIsNotGivenToASecondDriver",
	"closed-retried":  "FetchAfterCloseIsFatalAndCloseTwiceIsSafe",
	// A stale handle settles the message's current delivery (a delivery
	// tag taken for the same tag on the next channel).
	"stale-acks-current": "StaleHandlesAfterRevocationAckNothing",
	// Drain drops what was fetched ahead (it comes back after its lease).
	"drain-drops": "DrainHandsOverWhatWasPushedAndLosesNothing",
	// Drain hands over again what Fetch handed over last.
	"drain-repeats": "DrainHandsOverWhatWasPushedAndLosesNothing",
}

// broken is the memory driver with one sabotage. It is a Revoker too:
// revoke gives back every delivery it handed out and not settled, so
// that their handles go stale, and says so. And a Drainer: each Fetch
// takes two more than asked, ahead, and Drain hands those over.
type broken struct {
	d       driver.Driver
	how     string
	revoked chan driver.Revocation
	ahead   []driver.Message // fetched ahead; only Fetch and Drain touch it
	last    []driver.Message // what the last Fetch handed over

	mu     sync.Mutex
	ids    map[any]string // every handle handed out, to its message's id
	open   map[any]bool   // handles handed out and not settled
	latest map[string]any // each message id's last handle
}

var (
	_ driver.Revoker  = (*broken)(nil)
	_ driver.Extender = (*broken)(nil)
	_ driver.Drainer  = (*broken)(nil)
)

func (b *broken) Revoked() <-chan driver.Revocation { return b.revoked }

func (b *broken) revoke(t *testing.T) {
	b.mu.Lock()
	var batch []driver.Settlement
	for h := range b.open {
		batch = append(batch, driver.Settlement{Handle: h, Action: driver.Return})
	}
	clear(b.open)
	b.mu.Unlock()
	if err := b.d.Settle(context.Background(), batch); err != nil {
		t.Fatalf("give back %d deliveries: %v", len(batch), err)
	}
	b.revoked <- driver.Revocation{Lanes: []string{""}, Done: make(chan struct{})}
}

func (b *broken) Fetch(ctx context.Context, dst []driver.Message, max int) ([]driver.Message, error) {
	n := len(dst)
	switch b.how {
	case "fetch-over-max":
		max *= 3
	case "fetch-drops-dst":
		dst = nil
	}
	var out []driver.Message
	var err error
	if len(b.ahead) > 0 {
		k := min(max, len(b.ahead))
		out = append(dst, b.ahead[:k]...)
		b.ahead = b.ahead[k:]
	} else {
		out, err = b.d.Fetch(ctx, dst, max+2)
		if len(out)-n > max {
			b.ahead = append(b.ahead, out[n+max:]...)
			out = out[:n+max]
		}
	}
	b.last = slices.Clone(out[min(n, len(out)):])
	b.mu.Lock()
	for _, m := range slices.Concat(out[min(n, len(out)):], b.ahead) {
		b.ids[m.Handle] = m.ID
		b.open[m.Handle] = true
		b.latest[m.ID] = m.Handle
	}
	b.mu.Unlock()
	switch {
	case b.how == "no-source":
		for i := n; i < len(out); i++ {
			out[i].Source = ""
		}
	case b.how == "ctx-swallowed" && ctx.Err() != nil:
		err = nil
	case b.how == "closed-retried" && driver.IsFatal(err):
		err = errors.Unwrap(err)
	}
	return out, err
}

func (b *broken) Settle(ctx context.Context, batch []driver.Settlement) error {
	batch = append([]driver.Settlement(nil), batch...)
	b.mu.Lock()
	for i := range batch {
		h := batch[i].Handle
		delete(b.open, h)
		if b.how == "stale-acks-current" {
			batch[i].Handle = b.latest[b.ids[h]]
		}
	}
	b.mu.Unlock()
	for i := range batch {
		switch b.how {
		case "ack-returns":
			batch[i].Action = driver.Return
		case "delay-dropped":
			batch[i].Delay = 0
		case "history-dropped":
			batch[i].History = driver.History{}
		}
	}
	return b.d.Settle(ctx, batch)
}

func (b *broken) Capabilities() driver.Capabilities { return b.d.Capabilities() }

// Drain hands over what was fetched ahead.
func (b *broken) Drain(_ context.Context, dst []driver.Message) ([]driver.Message, error) {
	ahead := b.ahead
	b.ahead = nil
	switch b.how {
	case "drain-drops":
		b.mu.Lock()
		for _, m := range ahead {
			delete(b.open, m.Handle) // not given back on Close either
		}
		b.mu.Unlock()
		return dst, nil
	case "drain-repeats":
		dst = append(dst, b.last...)
	}
	return append(dst, ahead...), nil
}

// Close gives back what was handed out and not settled first, as
// RabbitMQ does: the next driver need not wait out the lease.
func (b *broken) Close() error {
	b.mu.Lock()
	var batch []driver.Settlement
	for h := range b.open {
		batch = append(batch, driver.Settlement{Handle: h, Action: driver.Return})
	}
	clear(b.open)
	b.mu.Unlock()
	_ = b.d.Settle(context.Background(), batch)
	return b.d.Close()
}
func (b *broken) Lease() time.Duration { return b.d.(driver.Extender).Lease() }

func (b *broken) Extend(ctx context.Context, handles []any, d time.Duration) error {
	if b.how == "extend-noop" {
		return nil
	}
	return b.d.(driver.Extender).Extend(ctx, handles, d)
}

type harness struct {
	b   *memory.Broker
	how string
	seq atomic.Int64
}

func (h *harness) NewSource(t *testing.T, cfg drivertest.SourceConfig) string {
	name := "sabotage-" + strconv.FormatInt(h.seq.Add(1), 10)
	if err := h.b.CreateQueue(name, memory.QueueConfig{VisibilityTimeout: cfg.Lease}); err != nil {
		t.Fatal(err)
	}
	return name
}

// Revoke has d give back what it holds and revoke it.
func (h *harness) Revoke(t *testing.T, _ string, _ driver.Config, d driver.Driver) driver.Driver {
	d.(*broken).revoke(t)
	return nil
}

func (h *harness) Publisher(*testing.T) consumer.Publisher { return h.b }

func (h *harness) Opener(*testing.T, string) driver.Opener { return opener{h} }

type opener struct{ h *harness }

func (o opener) Driver(ctx context.Context, source string, cfg driver.Config) (driver.Driver, error) {
	d, err := o.h.b.Driver(ctx, source, cfg)
	if err != nil {
		return nil, err
	}
	return &broken{
		d: d, how: o.h.how, revoked: make(chan driver.Revocation, 1),
		ids: make(map[any]string), open: make(map[any]bool), latest: make(map[string]any),
	}, nil
}

func (h *harness) Capabilities() drivertest.Capabilities {
	return drivertest.Capabilities{Redelivers: true, Lease: time.Second, CountsDeliveries: true, CarriesHistory: true}
}

// TestUnbrokenPasses runs the suite over the wrapper with no sabotage: the
// wrapper itself breaks nothing.
func TestUnbrokenPasses(t *testing.T) {
	if testing.Short() {
		t.Skip("the whole suite; skipped with -short")
	}
	b, err := memory.New(memory.WithAutoCreate(false))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	drivertest.Run(t, &harness{b: b})
}

func TestSabotaged(t *testing.T) {
	how := os.Getenv(sabotageEnv)
	if how == "" {
		t.Skip("runs only as a child of TestSuiteCatchesSabotage")
	}
	b, err := memory.New(memory.WithAutoCreate(false))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	t.Cleanup(drivertest.SetWait(10 * time.Second))
	drivertest.Run(t, &harness{b: b, how: how})
}

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
	for how, clause := range sabotages {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			cmd := exec.CommandContext(t.Context(), exe, "-test.run=^TestSabotaged$/^"+clause+"$", "-test.count=1", "-test.v")
			cmd.Env = append(os.Environ(), sabotageEnv+"="+how)
			out, err := cmd.CombinedOutput()
			var exit *exec.ExitError
			if !errors.As(err, &exit) {
				t.Fatalf("under sabotage %q: want a failing exit, got %v\n%s", how, err, out)
			}
			if want := "--- FAIL: TestSabotaged/" + clause; !strings.Contains(string(out), want) {
				t.Fatalf("sabotage %q: the child failed, but not in %s:\n%s", how, clause, out)
			}
		})
	}
}
