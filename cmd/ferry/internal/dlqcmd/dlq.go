// Package dlqcmd is the ferry dlq command: it shows what a dead-letter
// destination holds, with the story the ferry-dlq-* headers tell (peek),
// and moves messages back to their source (redrive), on every broker
// ferry.Open opens.
package dlqcmd

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/ferrymq/ferry/cmd/ferry/internal/cli"
)

// Usage is the help of ferry dlq.
const Usage = `Usage: ferry dlq <peek|redrive> DESTINATION --broker URL [flags]

  ferry dlq peek DESTINATION     show the dead-lettered messages and their story
  ferry dlq redrive DESTINATION --to SOURCE   move them back

ferry help dlq peek and ferry help dlq redrive list the flags.
`

const peekUsage = `Usage: ferry dlq peek DESTINATION --broker URL [--json] [--limit N]

Shows the messages of the dead-letter queue or topic DESTINATION with the
story consumer.DeadLetter wrote in their ferry-dlq-* headers: the source,
the reason, the handler runs (attempts; "~" when some were inferred from
deliveries nobody saw), the first and last failure and the last error.
Nothing is consumed:
  memory    the queue is read as it is
  kafka     the topic is read without a consumer group, nothing committed
            (--group starts from that group's committed offsets instead)
  sqs       messages are received, then made visible again at once
            (each receive counts in ApproximateReceiveCount)
  rabbitmq  messages are delivered, then nacked back to their place
            (a quorum queue counts a delivery in x-delivery-count)

Exit status: 0 done, 1 failed, 2 bad usage, 130 interrupted.

Flags:
`

const redriveUsage = `Usage: ferry dlq redrive DESTINATION --to SOURCE --broker URL [--rate N/s] [--filter NAME=PATTERN]...

Moves the messages of the dead-letter destination DESTINATION back to
SOURCE, one at a time: each is published (and confirmed by the broker)
before it is removed, so a crash halfway loses nothing and leaves at most
one message published twice (the one in flight); run the command again to
go on. The message keeps its body, key and headers; the ferry-dlq-*
headers are dropped and ferry-redriven-from is added. Its id is the
original's followed by ~r and a hash of its last failure's time: every
copy of one dead letter has the same (idempotent consumers drop the one a
crash doubled), and an SQS FIFO source does not take it for a duplicate of
the original.

SOURCE is a queue (memory, SQS), a topic (Kafka), or on RabbitMQ an
exchange (the message's key is the routing key) or amq.default/QUEUE.
On Kafka, "removed" means the redrive's consumer group (--group) commits
past the record: the topic keeps it, and a second redrive with the same
group starts where the first stopped.

--filter picks messages by a field of their story (id, key, source,
reason, consumer, host, error, error-kind, error-type) or any header; '*'
matches any text; several filters must all match. Messages the filter
leaves stay where they are.

Interrupted (Ctrl-C), the message in flight is finished and the command
says how far it got. A progress bar shows on stderr when it is a terminal.

Exit status: 0 done, 1 failed, 2 bad usage, 130 interrupted.

Flags:
`

// Run runs ferry dlq with args (after "dlq") and returns the exit code.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, Usage)
		return cli.ExitUsage
	}
	switch args[0] {
	case "peek":
		return runPeek(ctx, args[1:], stdout, stderr)
	case "redrive":
		return runRedrive(ctx, args[1:], stdout, stderr)
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, Usage)
		return cli.ExitOK
	}
	fmt.Fprintf(stderr, "ferry dlq: unknown command %q\n\n%s", args[0], Usage)
	return cli.ExitUsage
}

// Help prints the help of ferry dlq, or of its subcommand sub ("peek",
// "redrive"), to w, and reports whether sub is known.
func Help(w io.Writer, sub string) bool {
	switch sub {
	case "":
		fmt.Fprint(w, Usage)
	case "peek":
		fs, _ := peekFlags(w)
		fs.Usage()
	case "redrive":
		fs, _ := redriveFlags(w)
		fs.Usage()
	default:
		return false
	}
	return true
}

type peekOpts struct {
	broker, group string
	json          bool
	limit         int
	wait          time.Duration
}

func peekFlags(w io.Writer) (*flag.FlagSet, *peekOpts) {
	o := &peekOpts{}
	fs := flag.NewFlagSet("ferry dlq peek", flag.ContinueOnError)
	fs.SetOutput(w)
	fs.StringVar(&o.broker, "broker", "", "broker URL (mem://NAME, kafka://HOST:PORT, sqs://..., amqp://...); default $"+cli.EnvBroker)
	fs.BoolVar(&o.json, "json", false, "print a JSON array instead of a table")
	fs.IntVar(&o.limit, "limit", 100, "show at most this many messages")
	fs.StringVar(&o.group, "group", "", "kafka: start from this consumer group's committed offsets (default: the log start)")
	fs.DurationVar(&o.wait, "wait", 2*time.Second, "sqs, rabbitmq: how long to wait for one more message")
	fs.Usage = func() {
		fmt.Fprint(w, peekUsage)
		fs.PrintDefaults()
	}
	return fs, o
}

func runPeek(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs, o := peekFlags(stderr)
	pos, err := cli.Parse(fs, args)
	if errors.Is(err, flag.ErrHelp) {
		return cli.ExitOK
	}
	err = func() error {
		if err != nil {
			return err
		}
		if len(pos) != 1 {
			return cli.Usagef("want one DESTINATION, got %d arguments", len(pos))
		}
		if o.limit < 1 || o.wait <= 0 {
			return cli.Usagef("--limit and --wait must be positive")
		}
		b, err := cli.Open(ctx, o.broker)
		if err != nil {
			return err
		}
		defer b.Close()
		msgs, err := Peek(ctx, b, pos[0], o.group, o.limit, o.wait)
		if err != nil {
			return fmt.Errorf("peek %s: %w", pos[0], err)
		}
		stories := make([]Story, len(msgs))
		for i, m := range msgs {
			stories[i] = storyOf(m)
		}
		if o.json {
			enc := json.NewEncoder(stdout)
			enc.SetIndent("", "  ")
			return enc.Encode(stories)
		}
		if len(stories) == 0 {
			fmt.Fprintf(stdout, "%s holds no messages\n", pos[0])
			return nil
		}
		return writeTable(stdout, stories)
	}()
	return cli.Report(ctx, stderr, "ferry dlq peek", err, fs.Usage)
}

type redriveOpts struct {
	broker, to, group, rate string
	filters                 []string
	limit                   int
	wait, idle              time.Duration
}

func redriveFlags(w io.Writer) (*flag.FlagSet, *redriveOpts) {
	o := &redriveOpts{}
	fs := flag.NewFlagSet("ferry dlq redrive", flag.ContinueOnError)
	fs.SetOutput(w)
	fs.StringVar(&o.broker, "broker", "", "broker URL (mem://NAME, kafka://HOST:PORT, sqs://..., amqp://...); default $"+cli.EnvBroker)
	fs.StringVar(&o.to, "to", "", "where the messages go: their source queue, topic or exchange (required)")
	fs.StringVar(&o.rate, "rate", "50/s", "most messages read and moved per second (N/s or N/m; 0 for no limit)")
	fs.Func("filter", "move only messages whose NAME matches PATTERN (NAME=PATTERN, repeatable)", func(s string) error {
		if _, err := ParseFilter(s); err != nil {
			return errors.New(strings.TrimPrefix(err.Error(), cli.ErrUsage.Error()+": "))
		}
		o.filters = append(o.filters, s)
		return nil
	})
	fs.IntVar(&o.limit, "limit", 0, "move at most this many messages (0: all)")
	fs.StringVar(&o.group, "group", DefaultGroup, "kafka: the consumer group whose offsets on DESTINATION record the redrive's progress")
	fs.DurationVar(&o.wait, "wait", 2*time.Second, "how long a receive waits before asking the broker what is left")
	fs.DurationVar(&o.idle, "idle", 40*time.Second, "stop when no message came for this long although the broker says some are left (on SQS, what a killed run held comes back after the visibility timeout)")
	fs.Usage = func() {
		fmt.Fprint(w, redriveUsage)
		fs.PrintDefaults()
	}
	return fs, o
}

// ParseRate parses N/s, N/m or N (per second) into messages per second.
func ParseRate(s string) (float64, error) {
	num, unit, _ := strings.Cut(s, "/")
	n, err := strconv.ParseFloat(num, 64)
	if err != nil || n < 0 {
		return 0, cli.Usagef("--rate %q is not N/s or N/m", s)
	}
	switch unit {
	case "", "s":
		return n, nil
	case "m":
		return n / 60, nil
	}
	return 0, cli.Usagef("--rate %q is not N/s or N/m", s)
}

func runRedrive(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs, o := redriveFlags(stderr)
	pos, err := cli.Parse(fs, args)
	if errors.Is(err, flag.ErrHelp) {
		return cli.ExitOK
	}
	var res Result
	ran := false
	err = func() error {
		if err != nil {
			return err
		}
		if len(pos) != 1 {
			return cli.Usagef("want one DESTINATION, got %d arguments", len(pos))
		}
		if o.to == "" {
			return cli.Usagef("--to SOURCE is required")
		}
		if o.to == pos[0] {
			return cli.Usagef("--to names the destination itself")
		}
		rate, err := ParseRate(o.rate)
		if err != nil {
			return err
		}
		if o.limit < 0 || o.wait <= 0 || o.idle <= 0 {
			return cli.Usagef("--limit, --wait and --idle must be positive")
		}
		cfg := RedriveConfig{Destination: pos[0], To: o.to, Group: o.group, Rate: rate, Limit: o.limit, Wait: o.wait, Idle: o.idle}
		for _, s := range o.filters {
			f, _ := ParseFilter(s)
			cfg.Filter = append(cfg.Filter, f...)
		}
		if cli.Terminal(stderr) {
			cfg.Progress = stderr
		}
		b, err := cli.Open(ctx, o.broker)
		if err != nil {
			return err
		}
		defer b.Close()
		ran = true
		res, err = Redrive(ctx, b, cfg)
		return err
	}()
	if ran {
		left := ""
		if res.Left >= 0 {
			left = fmt.Sprintf("; %d left in %s", res.Left, pos[0])
		}
		fmt.Fprintf(stdout, "moved %d messages from %s to %s in %s (%d skipped by the filter%s)\n",
			res.Moved, pos[0], o.to, res.Elapsed.Round(time.Millisecond), res.Skipped, left)
	}
	if err == nil && res.GaveUpWaiting {
		fmt.Fprintf(stderr, "ferry dlq redrive: %d messages are still in %s but none came for %s: in flight elsewhere, delayed, or beyond the filter's reach; run again later\n",
			res.Left, pos[0], o.idle)
	}
	if err == nil && res.Interrupted {
		fmt.Fprintf(stderr, "ferry dlq redrive: interrupted after moving %d messages; nothing in flight was lost: run the same command again to go on\n", res.Moved)
		return cli.ExitInterrupted
	}
	if err != nil && ran && res.Moved > 0 {
		fmt.Fprintf(stderr, "ferry dlq redrive: stopped after moving %d messages\n", res.Moved)
	}
	return cli.Report(ctx, stderr, "ferry dlq redrive", err, fs.Usage)
}
