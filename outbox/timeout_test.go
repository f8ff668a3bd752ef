package outbox_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/memory"
	"github.com/ferrymq/ferry/outbox"
)

// budgets is a Publisher that takes every message and records how long each
// call was given: its context's deadline less the time of the call.
type budgets struct {
	mu   sync.Mutex
	got  []time.Duration
	none int // calls without a deadline
}

func (p *budgets) Publish(ctx context.Context, _ string, _ ...consumer.Message) error {
	d, ok := ctx.Deadline()
	p.mu.Lock()
	defer p.mu.Unlock()
	if !ok {
		p.none++
		return nil
	}
	p.got = append(p.got, time.Until(d))
	return nil
}

func (p *budgets) calls() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.got) + p.none
}

// A publish gets the time WithPublishTimeout says, whenever in the lease
// period it starts, not what happens to be left of the lease.
func TestPublishGetsThePublishTimeout(t *testing.T) {
	b := openSQLite(t)
	ctx := testenv.Context(t, 30*time.Second)
	const timeout = 800 * time.Millisecond
	pub := &budgets{}
	runRelay(t, b.store(t, ""), pub, fast(outbox.WithPublishTimeout(timeout))...) // lease TTL 1s
	for i := range 8 {
		// Events come at random moments of the relay's lease period.
		time.Sleep(rand.N(400 * time.Millisecond))
		if err := b.add(ctx, outbox.Event{Destination: queue, Key: strconv.Itoa(i)}); err != nil {
			t.Fatal(err)
		}
		testenv.WaitFor(t, 10*time.Second, "the event was not published", func() bool { return pub.calls() > i })
	}
	pub.mu.Lock()
	defer pub.mu.Unlock()
	if pub.none > 0 {
		t.Fatalf("%d publish calls had no deadline", pub.none)
	}
	for _, d := range pub.got {
		// A call's budget is measured a moment after the relay set it.
		if d < timeout-50*time.Millisecond || d > timeout {
			t.Fatalf("publish calls were given %v, want %v each", pub.got, timeout)
		}
	}
}

// A publish timeout that does not fit in the lease is refused when the relay
// is built, whatever the order of the options.
func TestPublishTimeoutMustFitInTheLease(t *testing.T) {
	br, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer br.Close()
	st := openSQLite(t).store(t, "")
	var ce *consumer.ConfigError
	for _, opts := range [][]outbox.Option{
		{outbox.WithPublishTimeout(30 * time.Second)}, // default lease TTL 5s
		{outbox.WithLeaseTTL(time.Second), outbox.WithPublishTimeout(900 * time.Millisecond)},
		{outbox.WithPublishTimeout(900 * time.Millisecond), outbox.WithLeaseTTL(time.Second)},
	} {
		if _, err := outbox.NewRelay(st, br, opts...); !errors.As(err, &ce) || ce.Field != "PublishTimeout" {
			t.Errorf("NewRelay = %v, want a ConfigError for PublishTimeout", err)
		}
	}
	for _, opts := range [][]outbox.Option{
		nil,
		{outbox.WithLeaseTTL(time.Second)}, // the default timeout follows the TTL
		{outbox.WithLeaseTTL(time.Second), outbox.WithPublishTimeout(800 * time.Millisecond)},
		{outbox.WithLeaseTTL(time.Minute), outbox.WithPublishTimeout(30 * time.Second)},
	} {
		if _, err := outbox.NewRelay(st, br, opts...); err != nil {
			t.Errorf("NewRelay = %v", err)
		}
	}
}
