package demo

import (
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
)

// MinOrders is the fewest orders a run takes: room for the four poison
// orders, the duplicates and enough good orders to tell a story.
const MinOrders = 20

// Config configures a run. Start from DefaultConfig and change what you
// need: Run rejects zero values rather than guessing what they mean.
type Config struct {
	// Broker is the URL of the broker to run on, as ferry.Open takes it:
	// mem:// (the embedded memory broker), kafka://HOST:PORT, sqs://...,
	// amqp://USER:PASS@HOST:PORT/. On a real broker the run creates its
	// queues (or topics) under names of its own and deletes them at the
	// end. Default "" (mem://).
	Broker string

	// DB is the URL of a PostgreSQL database for the outbox, the payments
	// and the idempotency keys, which the run keeps in a schema of its own
	// and drops at the end. Default "": SQLite files in a temporary folder.
	DB string

	// Orders is how many orders the order service commits, spread evenly
	// over the steady, slow, failing and protected phases. Default 300;
	// at least MinOrders.
	Orders int

	// Steady, Slow, Failing and Protected are the lengths of the first four
	// phases (see the package documentation). Defaults 8s, 10s, 5s and 8s.
	Steady, Slow, Failing, Protected time.Duration

	// Recovered is the longest the last phase may take to drain the
	// backlog; the run ends as soon as everything is handled. Default 20s.
	Recovered time.Duration

	// Seed drives every random choice about the orders. Default 1.
	Seed uint64

	// Out receives the status lines and the verdict. Default (nil)
	// io.Discard.
	Out io.Writer

	// IsTerminal makes the status a single line that updates in place
	// (carriage return and erase); otherwise each status is a line of its
	// own. Default false.
	IsTerminal bool

	// Width is the terminal's width in columns: on a terminal, the status
	// line is cut to fit. Default 0: unknown, never cut.
	Width int

	// Quiet prints the verdict only. Default false.
	Quiet bool

	// StatusInterval is how often the status line is printed. Default 1s.
	StatusInterval time.Duration

	// BaseLatency is the payments API's latency when healthy, and
	// SlowLatency its latency at the end of the slow phase. Defaults 50ms
	// and 2s.
	BaseLatency, SlowLatency time.Duration

	// VisibilityTimeout is the orders queue's visibility timeout on the
	// memory broker and SQS: how long the messages of a killed consumer stay
	// hidden before another takes them (SQS counts it in whole seconds,
	// rounded up). RabbitMQ and Kafka have none: see the package
	// documentation. Default 2s.
	VisibilityTimeout time.Duration

	// Logger receives the logs of the consumers, the middleware and the
	// relay. Default (nil) none: the status lines tell the story.
	Logger *slog.Logger

	// DisableIdempotency runs the billing handler without the idempotency
	// middleware and without the inbox, so that duplicates are paid twice
	// and the verdict must say so. For tests of the verdict; default false.
	DisableIdempotency bool
}

// DefaultConfig returns the configuration of `ferry demo` without flags: a
// run of at most a minute.
func DefaultConfig() Config {
	return Config{
		Orders:            300,
		Steady:            8 * time.Second,
		Slow:              10 * time.Second,
		Failing:           5 * time.Second,
		Protected:         8 * time.Second,
		Recovered:         20 * time.Second,
		Seed:              1,
		StatusInterval:    time.Second,
		BaseLatency:       50 * time.Millisecond,
		SlowLatency:       2 * time.Second,
		VisibilityTimeout: 2 * time.Second,
	}
}

// Validate reports the first field with a value Run cannot use, as a
// *consumer.ConfigError naming it.
func (c Config) Validate() error {
	if c.Orders < MinOrders {
		return &consumer.ConfigError{Field: "Orders", Reason: fmt.Sprintf("must be at least %d, got %d", MinOrders, c.Orders)}
	}
	for _, d := range []struct {
		field string
		v     time.Duration
	}{
		{"Steady", c.Steady}, {"Slow", c.Slow}, {"Failing", c.Failing}, {"Protected", c.Protected},
		{"Recovered", c.Recovered}, {"StatusInterval", c.StatusInterval},
		{"BaseLatency", c.BaseLatency}, {"SlowLatency", c.SlowLatency},
		{"VisibilityTimeout", c.VisibilityTimeout},
	} {
		if d.v <= 0 {
			return &consumer.ConfigError{Field: d.field, Reason: fmt.Sprintf("must be > 0, got %s", d.v)}
		}
	}
	if c.SlowLatency < c.BaseLatency {
		return &consumer.ConfigError{Field: "SlowLatency", Reason: fmt.Sprintf("%s is below BaseLatency %s", c.SlowLatency, c.BaseLatency)}
	}
	if c.VisibilityTimeout < driver.MinLease {
		// A shorter lease could not be extended in time.
		return &consumer.ConfigError{Field: "VisibilityTimeout", Reason: fmt.Sprintf("must be >= %s, got %s", driver.MinLease, c.VisibilityTimeout)}
	}
	return nil
}

// production is how long the order service commits orders: the first four
// phases.
func (c Config) production() time.Duration {
	return c.Steady + c.Slow + c.Failing + c.Protected
}

// handlerTimeout is the deadline of one run of the billing handler: well
// above the slowest healthy call.
func (c Config) handlerTimeout() time.Duration {
	return max(c.SlowLatency*5/2, time.Second)
}

// openFor is how long the breaker stays open before a trial call: a few
// trials fit in the protected phase.
func (c Config) openFor() time.Duration {
	return min(max(c.Protected/4, 100*time.Millisecond), time.Second)
}
