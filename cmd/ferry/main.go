// Command ferry is Ferry's command line. Its first command, demo, runs the
// whole story of Ferry on the embedded default (the memory broker, with the
// outbox and the idempotency store in SQLite in a temporary folder) and
// checks its invariants:
//
//	go run ./cmd/ferry demo
//
// It exits 0 when every invariant holds, 1 when one broke (the verdict names
// it) or the demo itself failed, 2 on bad usage, and 130 when interrupted
// (143 on SIGTERM).
//
// The operating commands work on every real broker, named by a URL as
// ferry.Open takes it (--broker, or $FERRY_BROKER); mem:// is refused, as a
// new process's in-process broker is empty:
//
//	ferry lag orders --group billing --broker kafka://127.0.0.1:9092 --watch
//	ferry dlq peek orders-dlq --broker amqp://guest:guest@127.0.0.1:5672/ --json
//	ferry dlq redrive orders-dlq --rate 20/s --filter reason=permanent --broker sqs://...
//
// lag prints each lane's lag, the age of the oldest waiting message and
// Burrow's verdict over a window of samples, without joining the group.
// dlq peek shows the dead-lettered messages and the story their ferry-dlq-*
// headers tell, without consuming them, and how many of how many it shows
// (on Kafka it reads past the redrive group's committed offsets when it
// has any, and says so). dlq redrive publishes each message back to the
// source its ferry-dlq-source header names (or --to), confirmed, before it
// removes it, so a crash halfway loses nothing and doubles at most the
// message in flight; it ends saying how many moved and how many are left,
// as the broker counts them. SIGINT and SIGTERM stop every command
// cleanly (a redrive finishes the message in flight and says how far it
// got). Each exits 0 on success, 1 on failure (lag: also when a lane is
// STALL, STOP or REWIND), 2 on bad usage (the error and one line naming
// ferry help COMMAND), 130 on SIGINT and 143 on SIGTERM; ferry help
// COMMAND lists its flags. What the libraries log (the adapters, franz-go,
// the log package) goes through one slog text handler on stderr.
//
// Usage:
//
//	ferry demo [--broker URL] [--db URL] [-orders n] [-steady d] [-slow d] [-failing d] [-protected d] [-recovered d] [-seed n] [-quiet]
//	ferry lag SOURCE --group NAME --broker URL [--watch] [--interval d] [--samples n] [--json]
//	ferry dlq peek DESTINATION --broker URL [--json] [--limit n] [--group NAME | --from-start]
//	ferry dlq redrive DESTINATION --broker URL [--to SOURCE] [--rate N/s] [--filter NAME=PATTERN]... [--limit n] [--progress d]
//	ferry help [command]
//
// With --broker the demo runs on a real broker (kafka://127.0.0.1:9092,
// sqs://KEY:SECRET@127.0.0.1:9324?tls=false&region=us-east-1,
// amqp://guest:guest@127.0.0.1:5672/) in queues or topics of its own, and
// with --db (postgres://USER:PASS@HOST:PORT/DB) it keeps the outbox, the
// payments and the idempotency keys in PostgreSQL, in a schema of its own.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	ferrymq "github.com/ferrymq/ferry"
	_ "github.com/ferrymq/ferry/brokers" // --broker takes any broker's URL
	"github.com/ferrymq/ferry/cmd/ferry/internal/cli"
	"github.com/ferrymq/ferry/cmd/ferry/internal/demo"
	"github.com/ferrymq/ferry/cmd/ferry/internal/dlqcmd"
	"github.com/ferrymq/ferry/cmd/ferry/internal/lagcmd"
	"github.com/ferrymq/ferry/consumer"
)

// Exit codes.
const (
	exitOK          = cli.ExitOK
	exitFailed      = cli.ExitFailed // an invariant broke, or the demo could not run
	exitUsage       = cli.ExitUsage
	exitInterrupted = cli.ExitInterrupted // SIGINT; cli.ExitTerminated on SIGTERM
)

func main() {
	// Before any broker is opened: the adapters take slog.Default when
	// they are built.
	cli.SetLogging(os.Stderr)
	ctx, stop := cli.NotifyContext(context.Background())
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

const usage = `Usage: ferry <command> [flags]

Commands:
  demo          run the whole story on the embedded broker (or --broker URL), check its invariants
  lag           a consumer group's lag per lane, backlog age and Burrow verdict
  dlq peek      the dead-lettered messages of a destination and their story
  dlq redrive   move dead-lettered messages back to their source
  help          show this help, or a command's: ferry help demo, ferry help dlq redrive

lag and dlq take the broker as a URL: --broker (or $FERRY_BROKER)
kafka://HOST:PORT, sqs://KEY:SECRET@HOST:PORT?region=R&tls=false, amqp://...
(not mem://: a new process's in-process broker is empty).

Exit status: 0 success, 1 failure, 2 bad usage, 130 interrupted (SIGINT),
143 terminated (SIGTERM).
`

// run runs the command line args and returns the exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runWith(ctx, args, stdout, stderr, nil)
}

// runWith is run with a hook that changes the demo's configuration after
// the flags are parsed (tests break invariants with it).
func runWith(ctx context.Context, args []string, stdout, stderr io.Writer, tweak func(*demo.Config)) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return exitUsage
	}
	switch cmd, rest := args[0], args[1:]; cmd {
	case "demo":
		return runDemo(ctx, rest, stdout, stderr, tweak)
	case "lag":
		return lagcmd.Run(ctx, rest, stdout, stderr)
	case "dlq":
		return dlqcmd.Run(ctx, rest, stdout, stderr)
	case "help", "-h", "-help", "--help":
		return help(rest, stdout, stderr)
	default:
		fmt.Fprintf(stderr, "ferry: unknown command %q\n%s\n", cmd, cli.HelpHint("ferry"))
		return exitUsage
	}
}

func help(args []string, stdout, stderr io.Writer) int {
	switch {
	case len(args) == 0:
		fmt.Fprint(stdout, usage)
		return exitOK
	case len(args) == 1 && args[0] == "demo":
		fs, _ := demoFlags(stdout)
		fs.Usage()
		return exitOK
	case len(args) == 1 && args[0] == "help":
		fmt.Fprint(stdout, usage)
		return exitOK
	case len(args) == 1 && args[0] == "lag":
		lagcmd.Help(stdout)
		return exitOK
	case len(args) <= 2 && args[0] == "dlq":
		sub := ""
		if len(args) == 2 {
			sub = args[1]
		}
		if dlqcmd.Help(stdout, sub) {
			return exitOK
		}
	}
	fmt.Fprintf(stderr, "ferry help: unknown command %q\n%s\n", strings.Join(args, " "), cli.HelpHint("ferry"))
	return exitUsage
}

const demoUsage = `Usage: ferry demo [flags]

Runs an order service that writes orders and their events through a
transactional outbox, a relay, and two billing consumers that pay each order
through the standard middleware and idempotency, on the embedded memory broker
and SQLite, or on the broker of --broker and the PostgreSQL of --db. The
payments API they call is steady, then slow, then down (failing, then
protected by the breaker), then recovered. Some events are poison, some are
published twice on purpose, and one consumer is killed mid-handler. A status
line shows the progress every second; at the end the verdict checks that
every order was paid exactly once, every poison message is in the dead-letter
queue with its reason, no good message is, and nothing was lost.

On a real broker the demo makes its own queues (Kafka: topics) under fresh
names and deletes them at the end; with --db it works in a schema of its own,
dropped at the end. Broker URLs:
  kafka://127.0.0.1:9092
  sqs://KEY:SECRET@127.0.0.1:9324?tls=false&region=us-east-1
  amqp://guest:guest@127.0.0.1:5672/

Exit status: 0 if every invariant holds; 1 if one broke (the verdict names it)
or the demo could not run; 2 for bad usage (a bad URL too); 130 when
interrupted (SIGINT), 143 when terminated (SIGTERM).

Flags:
`

// demoFlags returns the demo's flag set, writing errors and usage to w, and
// the configuration its flags fill in.
func demoFlags(w io.Writer) (*flag.FlagSet, *demo.Config) {
	cfg := demo.DefaultConfig()
	fs := flag.NewFlagSet("ferry demo", flag.ContinueOnError)
	fs.SetOutput(w)
	fs.StringVar(&cfg.Broker, "broker", "mem://", "the broker: mem://, kafka://, sqs:// or amqp://")
	fs.StringVar(&cfg.DB, "db", "", "PostgreSQL URL for the outbox, the payments and the idempotency keys,\nsuch as postgres://ferry:ferry@127.0.0.1:5432/ferry\n(default: SQLite in a temporary folder)")
	fs.IntVar(&cfg.Orders, "orders", cfg.Orders, fmt.Sprintf("number of orders to commit (at least %d)", demo.MinOrders))
	fs.DurationVar(&cfg.Steady, "steady", cfg.Steady, "length of the steady phase")
	fs.DurationVar(&cfg.Slow, "slow", cfg.Slow, "length of the slow phase (the payments API slows down)")
	fs.DurationVar(&cfg.Failing, "failing", cfg.Failing, "length of the failing phase (the payments API is down)")
	fs.DurationVar(&cfg.Protected, "protected", cfg.Protected, "length of the protected phase (the breaker holds)")
	fs.DurationVar(&cfg.Recovered, "recovered", cfg.Recovered, "longest the recovered phase may take to drain the backlog")
	fs.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "random seed: runs with one seed commit the same orders and reach\nthe same verdict")
	fs.BoolVar(&cfg.Quiet, "quiet", false, "print the verdict only")
	fs.Usage = func() {
		fmt.Fprint(w, demoUsage)
		fs.PrintDefaults()
	}
	return fs, &cfg
}

// flagOf names the flag that sets a Config field, for error messages.
var flagOf = map[string]string{
	"Orders": "-orders", "Steady": "-steady", "Slow": "-slow", "Failing": "-failing",
	"Protected": "-protected", "Recovered": "-recovered",
}

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer, tweak func(*demo.Config)) int {
	fs, cfg := demoFlags(stderr)
	// The flag package prints the whole usage after a bad flag; the error
	// alone, and where the help is, keep the error in sight.
	usage := fs.Usage
	fs.Usage = func() {}
	fs.SetOutput(io.Discard)
	err := fs.Parse(args)
	fs.Usage = usage
	fs.SetOutput(stderr)
	hint := cli.HelpHint("ferry demo")
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			usage()
			return exitOK
		}
		fmt.Fprintf(stderr, "ferry demo: %v\n%s\n", err, hint)
		return exitUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "ferry demo: unexpected argument %q\n%s\n", fs.Arg(0), hint)
		return exitUsage
	}
	cfg.Out = stdout
	cfg.IsTerminal, cfg.Width = terminal(stdout)
	if tweak != nil {
		tweak(cfg)
	}
	if err := cfg.Validate(); err != nil {
		var ce *consumer.ConfigError
		if errors.As(err, &ce) && flagOf[ce.Field] != "" {
			fmt.Fprintf(stderr, "ferry demo: invalid value for %s: %s\n", flagOf[ce.Field], ce.Reason)
		} else {
			fmt.Fprintf(stderr, "ferry demo: %v\n", err)
		}
		fmt.Fprintln(stderr, hint)
		return exitUsage
	}

	v, err := demo.Run(ctx, *cfg)
	switch {
	case errors.Is(err, context.Canceled) && ctx.Err() != nil:
		fmt.Fprintf(stderr, "ferry demo: %s\n", cli.Interruption(ctx))
		return cli.InterruptedExit(ctx)
	case errors.Is(err, ferrymq.ErrBadURL), errors.Is(err, demo.ErrBadDBURL):
		fmt.Fprintf(stderr, "ferry demo: %v\n", err) // a *ferry.URLError shows no password
		return exitUsage
	case err != nil:
		fmt.Fprintf(stderr, "ferry demo: %v\n", ferrymq.Redact(err.Error()))
		return exitFailed
	case !v.OK():
		fmt.Fprintf(stderr, "ferry demo: invariant broken: %s\n", strings.Join(v.Broken(), ", "))
		return exitFailed
	}
	return exitOK
}

// terminal reports whether w is a terminal, and its width in columns when
// it can tell (0 otherwise). TERM=dumb counts as no terminal: it cannot
// rewrite a line in place.
func terminal(w io.Writer) (bool, int) {
	f, ok := w.(*os.File)
	if !ok || os.Getenv("TERM") == "dumb" {
		return false, 0
	}
	st, err := f.Stat()
	if err != nil || st.Mode()&os.ModeCharDevice == 0 {
		return false, 0
	}
	return true, width(f)
}
