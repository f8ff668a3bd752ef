// Package dlqcmd is the ferry dlq command: it shows what a dead-letter
// destination holds, with the story the ferry-dlq-* headers tell (peek),
// and moves messages back to their source (redrive), on every broker
// ferry.Open opens. The command refuses mem:// (a new process has an empty
// in-process broker); Peek and Redrive take any ferry.Broker, the memory
// broker too.
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

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/cmd/ferry/internal/cli"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/kafka"
)

// Usage is the help of ferry dlq.
const Usage = `Usage: ferry dlq <peek|redrive> DESTINATION --broker URL [flags]

  ferry dlq peek DESTINATION      show the dead-lettered messages and their story
  ferry dlq redrive DESTINATION   move them back to their source

ferry help dlq peek and ferry help dlq redrive list the flags.
`

const peekUsage = `Usage: ferry dlq peek DESTINATION --broker URL [--json] [--limit N] [--group NAME | --from-start]

Shows the messages of the dead-letter queue or topic DESTINATION with the
story consumer.DeadLetter wrote in their ferry-dlq-* headers: the source,
the reason, the handler runs (attempts; "~" when some were inferred from
deliveries nobody saw), the first and last failure and the last error,
and how many of how many it shows ("5 of 43"). Nothing is consumed:
  kafka     the topic is read without joining a consumer group, nothing
            committed, from the committed offsets of the redrive's group
            (ferry-redrive) when it has any: what a redrive would still
            move; --group NAME reads past another group's, --from-start
            the whole log. The first line says which. Counts are of
            offsets (a transaction marker takes one too)
  sqs       messages are received, then made visible again at once (each
            receive counts in ApproximateReceiveCount); the count is SQS's
            approximate one
  rabbitmq  messages are delivered, then nacked back to their place (a
            quorum queue counts a delivery in x-delivery-count); the count
            is of ready messages (another consumer's unacked ones are not
            in it: AMQP does not tell them)
With --json the array is all of stdout; the lines about it go to stderr.

Exit status: 0 done, 1 failed, 2 bad usage, 130 interrupted (143 on SIGTERM).

Flags:
`

const redriveUsage = `Usage: ferry dlq redrive DESTINATION --broker URL [--to SOURCE] [--filter NAME=PATTERN]... [flags]

Moves the messages of the dead-letter destination DESTINATION back to
their source, one at a time: each is published (and confirmed by the
broker) before it is removed, so a crash halfway loses nothing and leaves
at most one message published twice (the one in flight); run the command
again to go on. The message keeps its body, key and headers; the
ferry-dlq-* headers are dropped and ferry-redriven-from is added. Its id
is the original's followed by ~r and a hash of its last failure's time:
every copy of one dead letter has the same (idempotent consumers drop the
one a crash doubled), and an SQS FIFO source does not take it for a
duplicate of the original.

Each message goes back to the source its ferry-dlq-source header names,
unless --to SOURCE sends them all to one. A message without that header
(or whose header names DESTINATION itself) stays where it is and the
summary counts it; on Kafka its partition is not redriven past it (the
group's offset stays before it), so nothing behind it is passed over, and
a run with --to moves it. SOURCE is a queue (SQS, RabbitMQ) or a topic
(Kafka); on RabbitMQ a name that is not a queue's is an exchange's (the
message's key is the routing key), and amq.exchange/EXCHANGE names an
exchange outright. On Kafka, "removed" means the redrive's consumer group
(--group) commits past the record: the topic keeps it, and a second redrive with
the same group starts where the first stopped (ferry dlq peek shows what
is left past it).

--filter picks messages by a field of their story (id, key, source,
reason, consumer, host, error, error-kind, error-type) or any header; '*'
matches any text; several filters must all match. Messages the filter
leaves stay where they are (on Kafka the group passes over them).

The summary says how many moved and how many are left, as the broker
counts them: exactly (Kafka: by offsets; RabbitMQ: ready messages and
those the redrive holds), about (SQS), or unknown, with why. On a
terminal a progress bar shows on stderr; off one (a Job's log) a progress
line comes every --progress.

On SQS, --native moves server side instead, with SQS's message move task
(StartMessageMoveTask): every message with its ferry-dlq-* story, under a
new message id (SQS's; no ferry-redriven-from), to --to, or without it to
the queues SQS records as their sources (those whose redrive policy
dead-lettered them; a message Ferry's DeadLetter sent there has none: give
--to). SQS takes only a DESTINATION that is the dead-letter queue of some
queue's redrive policy, and a --to of the same type (FIFO to FIFO). It
takes no --filter or --limit; --rate, when given, is a whole number from
1 to 500/s, else SQS picks the rate. The progress shows what SQS reports
moved; stopped by a signal, it cancels the task and waits until SQS says
so (what moved stays moved); a second signal leaves the task running. No
message passes through this process.

Stopped by SIGINT (Ctrl-C) or SIGTERM (a Job's deadline, timeout(1)), it
finishes the message in flight, gives the others back, says how many
moved, and exits 130 (SIGINT) or 143 (SIGTERM); nothing in flight is
lost. A second signal kills it at once: that loses nothing either, and
leaves at most the message in flight published twice.

Exit status: 0 done, 1 failed, 2 bad usage, 130 interrupted, 143 terminated.

Flags:
`

// Run runs ferry dlq with args (after "dlq") and returns the exit code.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return run(ctx, args, stdout, stderr, cli.Open)
}

// run is Run with the opener of --broker.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, open cli.Opener) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, Usage)
		return cli.ExitUsage
	}
	switch args[0] {
	case "peek":
		return runPeek(ctx, args[1:], stdout, stderr, open)
	case "redrive":
		return runRedrive(ctx, args[1:], stdout, stderr, open)
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, Usage)
		return cli.ExitOK
	}
	fmt.Fprintf(stderr, "ferry dlq: unknown command %q (peek or redrive)\n%s\n", args[0], cli.HelpHint("ferry dlq"))
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

// brokerFlag is the help of --broker.
const brokerFlag = "kafka://HOST:PORT, sqs://... or amqp://... (default $" + cli.EnvBroker + ")"

type peekOpts struct {
	broker, group   string
	json, fromStart bool
	limit           int
	wait            time.Duration
}

func peekFlags(w io.Writer) (*flag.FlagSet, *peekOpts) {
	o := &peekOpts{}
	fs := flag.NewFlagSet("ferry dlq peek", flag.ContinueOnError)
	fs.SetOutput(w)
	fs.StringVar(&o.broker, "broker", "", brokerFlag)
	fs.BoolVar(&o.json, "json", false, "print a JSON array instead of a table")
	fs.IntVar(&o.limit, "limit", 100, "show at most this many messages")
	fs.StringVar(&o.group, "group", "", "kafka: read past this consumer group's committed offsets\n(default: "+DefaultGroup+"'s when it has any, else the log start)")
	fs.BoolVar(&o.fromStart, "from-start", false, "kafka: read from the log start, what redrives moved too")
	fs.DurationVar(&o.wait, "wait", 2*time.Second, "sqs, rabbitmq: how long to wait for one more message")
	fs.Usage = func() {
		fmt.Fprint(w, peekUsage)
		fs.PrintDefaults()
	}
	return fs, o
}

func runPeek(ctx context.Context, args []string, stdout, stderr io.Writer, open cli.Opener) int {
	const cmd = "ferry dlq peek"
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
		if o.fromStart && o.group != "" {
			return cli.Usagef("--group and --from-start name two places to start: give one")
		}
		b, err := open(ctx, o.broker)
		if err != nil {
			return err
		}
		defer b.Close()
		if err := refuseShareGroups(b); err != nil {
			return err
		}
		p, err := Peek(ctx, b, pos[0], PeekOptions{Group: o.group, FromStart: o.fromStart, Limit: o.limit, Wait: o.wait})
		if err != nil {
			return fmt.Errorf("peek %s: %w", pos[0], err)
		}
		// Lines about the messages go where they cannot spoil the JSON.
		notes := stdout
		if o.json {
			notes = stderr
		}
		if p.From != "" {
			fmt.Fprintln(notes, p.From)
		}
		stories := make([]Story, len(p.Messages))
		for i, m := range p.Messages {
			stories[i] = storyOf(m)
		}
		if o.json {
			enc := json.NewEncoder(stdout)
			enc.SetIndent("", "  ")
			if err := enc.Encode(stories); err != nil {
				return err
			}
		} else if len(stories) > 0 {
			if err := writeTable(stdout, stories); err != nil {
				return err
			}
		}
		fmt.Fprintln(notes, shown(pos[0], len(stories), o.limit, p.Total))
		return nil
	}()
	return cli.Report(ctx, stderr, cmd, err)
}

// shown is peek's last line: how many messages of how many it showed.
func shown(dest string, n, limit int, total Count) string {
	if n == 0 && total.N == 0 {
		return dest + " holds no messages"
	}
	if total.N < 0 {
		return fmt.Sprintf("%d messages of %s shown; how many it holds is unknown: %s", n, dest, total.Why)
	}
	s := fmt.Sprintf("%d of %s messages in %s", n, total.Of(n), dest)
	if n == limit && total.N > int64(n) {
		s += fmt.Sprintf(" (--limit %d)", limit)
	}
	return s
}

type redriveOpts struct {
	broker, to, group, rate string
	filters                 []string
	limit                   int
	wait, idle, progress    time.Duration
	native                  bool
}

func redriveFlags(w io.Writer) (*flag.FlagSet, *redriveOpts) {
	o := &redriveOpts{}
	fs := flag.NewFlagSet("ferry dlq redrive", flag.ContinueOnError)
	fs.SetOutput(w)
	fs.StringVar(&o.broker, "broker", "", brokerFlag)
	fs.StringVar(&o.to, "to", "", "send every message here: a queue, a topic or (RabbitMQ) an exchange\n(default: each to the source its "+consumer.HeaderDLQSource+" header names)")
	fs.StringVar(&o.rate, "rate", "50/s", "most messages per second (N/s, N/m; 0: no limit)")
	fs.Func("filter", "move only messages whose NAME matches PATTERN (NAME=PATTERN, repeatable)", func(s string) error {
		if _, err := ParseFilter(s); err != nil {
			return errors.New(strings.TrimPrefix(err.Error(), cli.ErrUsage.Error()+": "))
		}
		o.filters = append(o.filters, s)
		return nil
	})
	fs.IntVar(&o.limit, "limit", 0, "move at most this many messages (0: all)")
	fs.StringVar(&o.group, "group", DefaultGroup, "kafka: the consumer group whose offsets on DESTINATION record\nthe redrive's progress")
	fs.DurationVar(&o.wait, "wait", 2*time.Second, "how long one receive waits before asking what is left")
	fs.DurationVar(&o.idle, "idle", 40*time.Second, "stop when no message came for this long although the broker says\nsome are left (on SQS, what a killed run held comes back after the\nvisibility timeout)")
	fs.DurationVar(&o.progress, "progress", 5*time.Second, "off a terminal, print a progress line this often (0: none)")
	fs.BoolVar(&o.native, "native", false, "sqs: move server side with SQS's message move task\n(StartMessageMoveTask), every message to --to or to the sources SQS\nrecords (no --filter or --limit; --rate from 1 to 500/s, else SQS's)")
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

func runRedrive(ctx context.Context, args []string, stdout, stderr io.Writer, open cli.Opener) int {
	const cmd = "ferry dlq redrive"
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
		if o.to == pos[0] {
			return cli.Usagef("--to names the destination itself")
		}
		rate, err := ParseRate(o.rate)
		if err != nil {
			return err
		}
		if o.limit < 0 || o.wait <= 0 || o.idle <= 0 || o.progress < 0 {
			return cli.Usagef("--limit, --wait, --idle and --progress must be positive")
		}
		cfg := RedriveConfig{Destination: pos[0], To: o.to, Group: o.group, Rate: rate, Limit: o.limit, Wait: o.wait, Idle: o.idle}
		for _, s := range o.filters {
			f, _ := ParseFilter(s)
			cfg.Filter = append(cfg.Filter, f...)
		}
		cfg.Progress, cfg.ProgressEvery = stderr, o.progress
		cfg.ProgressBar = cli.Terminal(stderr)
		b, err := open(ctx, o.broker)
		if err != nil {
			return err
		}
		defer b.Close()
		if err := refuseShareGroups(b); err != nil {
			return err
		}
		if o.native {
			// SQS picks the task's rate unless --rate was given.
			given := false
			fs.Visit(func(f *flag.Flag) { given = given || f.Name == "rate" })
			if !given {
				cfg.Rate = 0
			}
			if err := nativeRefusal(b, cfg); err != nil {
				return err
			}
		}
		ran = true
		if o.native {
			res, err = RedriveNative(ctx, b, cfg)
		} else {
			res, err = Redrive(ctx, b, cfg)
		}
		return err
	}()
	if ran {
		fmt.Fprintln(stdout, res.Summary(pos[0], o.to))
	}
	if ran && res.Unrouted > 0 {
		fmt.Fprintf(stderr, "%s: %d messages carry no %s header (or name %s itself) and stay in %s; move them with --to SOURCE\n",
			cmd, res.Unrouted, consumer.HeaderDLQSource, pos[0], pos[0])
	}
	for _, s := range res.Stopped {
		fmt.Fprintf(stderr, "%s: %s\n", cmd, s)
	}
	if err == nil && res.GaveUpWaiting {
		fmt.Fprintf(stderr, "%s: %s messages are still in %s but none came for %s: in flight elsewhere, delayed, or beyond the filter's reach; run again later\n",
			cmd, res.Left.Of(0), pos[0], o.idle)
	}
	if err == nil && res.Interrupted {
		fmt.Fprintf(stderr, "%s: %s after moving %d messages; nothing in flight was lost: run the same command again to go on\n",
			cmd, cli.Interruption(ctx), res.Moved)
		return cli.InterruptedExit(ctx)
	}
	if err != nil && ran && res.Moved > 0 {
		fmt.Fprintf(stderr, "%s: stopped after moving %d messages\n", cmd, res.Moved)
	}
	return cli.Report(ctx, stderr, cmd, err)
}

// refuseShareGroups refuses a Kafka broker whose consumers join share
// groups: ferry dlq reads a dead-letter topic from a consumer group's
// offsets and moves a record by committing past it, which a share group
// has neither of. A dead-letter topic is a topic like any other, whatever
// group wrote to its source.
func refuseShareGroups(b ferry.Broker) error {
	if kb, ok := b.(*kafka.Broker); ok && kb.GroupProtocol() == kafka.Share {
		return cli.Usagef("ferry dlq reads and moves a dead-letter topic through a consumer group of its own, not a share group: " +
			"give the kafka:// URL without group_protocol=share (the dead-letter topic is a topic like any other, whatever kind of group consumes its source)")
	}
	return nil
}
