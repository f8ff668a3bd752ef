// Package cli holds what the operating commands of ferry (lag, dlq) share:
// their exit codes, the signals that stop them, flag parsing that lets
// flags follow the arguments, how they report an error, the slog handler
// library logs go through, opening the broker of --broker, and reaching the
// driver beneath a broker opened by ferry.Open.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/brokerkind"
	"github.com/ferrymq/ferry/kafka"
	"github.com/ferrymq/ferry/memory"
	"github.com/ferrymq/ferry/rabbit"
	"github.com/ferrymq/ferry/sqs"
)

// Exit codes of every ferry command.
const (
	// ExitOK: the command did what it was asked.
	ExitOK = 0
	// ExitFailed: the broker, or the work, failed.
	ExitFailed = 1
	// ExitUsage: bad flags or arguments.
	ExitUsage = 2
	// ExitInterrupted: stopped by SIGINT (Ctrl-C), cleanly: 128 + 2.
	ExitInterrupted = 130
	// ExitTerminated: stopped by SIGTERM (a Kubernetes Job's deadline,
	// timeout(1), a pod's shutdown), as cleanly: 128 + 15.
	ExitTerminated = 143
)

// EnvBroker names the environment variable that is --broker's default.
const EnvBroker = "FERRY_BROKER"

// ErrUsage marks an error in the command line: the command prints it with
// the line that names its help, and exits with ExitUsage.
var ErrUsage = errors.New("bad usage")

// Usagef returns an error matching ErrUsage.
func Usagef(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrUsage, fmt.Sprintf(format, args...))
}

// Signal is the cause of a command's context when a signal stopped it
// (context.Cause). It matches context.Canceled, so code that checks for a
// cancelled context needs nothing more.
type Signal struct{ Sig os.Signal }

func (s *Signal) Error() string { return s.Sig.String() + " signal received" }

// Is reports whether target is context.Canceled.
func (s *Signal) Is(target error) bool { return target == context.Canceled }

// NotifyContext returns a copy of parent that is cancelled, with a *Signal
// as its cause, on the first SIGINT or SIGTERM: every command stops on
// either as it does on Ctrl-C. stop releases the signals; a second signal
// after the first is left to the default action (the process dies), so a
// stuck stop can still be forced.
func NotifyContext(parent context.Context) (ctx context.Context, stop func()) {
	ctx, cancel := context.WithCancelCause(parent)
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, os.Interrupt, syscall.SIGTERM)
	done := make(chan struct{})
	go func() {
		select {
		case s := <-ch:
			signal.Stop(ch)
			cancel(&Signal{Sig: s})
		case <-done:
		}
	}()
	var once sync.Once
	return ctx, func() {
		once.Do(func() {
			signal.Stop(ch)
			close(done)
			cancel(context.Canceled)
		})
	}
}

// InterruptedExit is the exit code of a command that ctx's end stopped:
// ExitTerminated when SIGTERM ended it, ExitInterrupted otherwise.
func InterruptedExit(ctx context.Context) int {
	if s := new(Signal); errors.As(context.Cause(ctx), &s) && s.Sig == syscall.SIGTERM {
		return ExitTerminated
	}
	return ExitInterrupted
}

// Interruption says what stopped ctx, for a command's last words:
// "interrupted", or "terminated (SIGTERM)".
func Interruption(ctx context.Context) string {
	if InterruptedExit(ctx) == ExitTerminated {
		return "terminated (SIGTERM)"
	}
	return "interrupted"
}

// Parse parses args with fs, letting flags come before, between and after
// the positional arguments (ferry dlq peek orders-dlq --json), and returns
// the positional arguments. "--" ends the flags. For -h and --help it
// prints fs's usage and returns flag.ErrHelp; a bad flag is an error
// matching ErrUsage that fs does not print (Report does, with one line
// naming the help, not the whole usage).
func Parse(fs *flag.FlagSet, args []string) ([]string, error) {
	usage, out := fs.Usage, fs.Output()
	fs.Usage = func() {}
	fs.SetOutput(io.Discard)
	defer func() { fs.Usage = usage; fs.SetOutput(out) }()
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				fs.SetOutput(out)
				usage()
				return nil, err
			}
			return nil, fmt.Errorf("%w: %w", ErrUsage, err)
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		if len(args) > len(rest) && args[len(args)-len(rest)-1] == "--" {
			return append(pos, rest...), nil
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

// Opener opens the broker of a --broker URL: Open, or in tests one that
// also opens the in-process mem:// brokers.
type Opener func(ctx context.Context, url string) (ferry.Broker, error)

// ErrMemoryBroker is the usage error of a mem:// URL given to lag or dlq.
var ErrMemoryBroker = errors.New("mem:// is the in-process broker: a new ferry process has its own, empty one, so there is nothing to read or move; name the broker the service uses (kafka://, sqs://, amqp://)")

// Open opens the broker of url (--broker, else $FERRY_BROKER). A missing
// URL, a mem:// one (see ErrMemoryBroker) and one ferry.Open refuses are
// usage errors.
func Open(ctx context.Context, url string) (ferry.Broker, error) {
	if url == "" {
		url = os.Getenv(EnvBroker)
	}
	if url == "" {
		return nil, Usagef("--broker URL is required (or set %s): kafka://HOST:PORT, sqs://..., amqp://...", EnvBroker)
	}
	if scheme, _, ok := strings.Cut(url, "://"); ok && strings.EqualFold(scheme, "mem") {
		return nil, fmt.Errorf("%w: %w", ErrUsage, ErrMemoryBroker)
	}
	b, err := ferry.Open(ctx, url)
	if errors.Is(err, ferry.ErrBadURL) {
		return nil, fmt.Errorf("%w: %w", ErrUsage, err)
	}
	return b, err
}

// Kind names the broker behind b, as ferrytest.Kind does (the constants
// of package brokerkind): "memory", "kafka", "sqs" or "rabbitmq", from
// the messaging.system its adapter names. It is "unknown" for a broker
// that names none, or one of no adapter of Ferry's.
func Kind(b ferry.Broker) string {
	sn, ok := b.(consumer.SystemNamer)
	if !ok {
		return "unknown"
	}
	switch sn.System() {
	case kafka.MessagingSystem:
		return brokerkind.Kafka
	case sqs.MessagingSystem:
		return brokerkind.SQS
	case rabbit.MessagingSystem:
		return brokerkind.RabbitMQ
	case memory.MessagingSystem:
		return brokerkind.Memory
	}
	return "unknown"
}

// Driver returns the driver of source on b, outside any delivery loop:
// on Kafka a member of group (which joins the group on its first Fetch),
// on RabbitMQ one whose prefetch is prefetch (1 to 65535), on SQS and
// memory a receiver of the queue.
func Driver(ctx context.Context, b ferry.Broker, source, group string, prefetch int) (driver.Driver, error) {
	o, ok := b.(driver.Opener)
	if !ok {
		return nil, fmt.Errorf("no driver for a broker of type %T", b)
	}
	return o.Driver(ctx, source, driver.Config{Name: group, MaxInFlight: min(max(prefetch, 1), 65535)})
}

// Terminal reports whether w is a terminal that can rewrite a line in
// place (not TERM=dumb).
func Terminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok || os.Getenv("TERM") == "dumb" {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// NewLogHandler returns the slog handler of every ferry command: text
// lines (time=... level=WARN msg=... key=value) on w, which is stderr, at
// level Info and above. The commands install it as slog's default before
// they open a broker (see SetLogging), so what the libraries log (the
// adapters, which take slog.Default when built, franz-go through the
// Kafka adapter, anything that uses the log package) comes out in this one
// format, apart from the command's output on stdout.
func NewLogHandler(w io.Writer) slog.Handler {
	return slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelInfo})
}

// SetLogging makes a logger over NewLogHandler(w) slog's default, and so
// the log package's too (slog.SetDefault routes log.Print through it), and
// returns it.
func SetLogging(w io.Writer) *slog.Logger {
	l := slog.New(NewLogHandler(w))
	slog.SetDefault(l)
	return l
}

// HelpHint is the line a usage error ends with: the command whose help
// lists the flags. cmd is the command's name as its errors begin ("ferry
// dlq peek").
func HelpHint(cmd string) string {
	help := "ferry help"
	if rest, ok := strings.CutPrefix(cmd, "ferry "); ok {
		help += " " + rest
	}
	return fmt.Sprintf("run '%s' for its usage and flags", help)
}

// Report prints err for the command named cmd and returns its exit code:
// ExitUsage for a usage error (printed with one line naming the command's
// help, not the whole help: the error must stay in sight), the code of
// InterruptedExit when ctx ended on a signal, ExitFailed otherwise.
func Report(ctx context.Context, stderr io.Writer, cmd string, err error) int {
	switch {
	case err == nil:
		return ExitOK
	case errors.Is(err, ErrUsage):
		fmt.Fprintf(stderr, "%s: %s\n%s\n", cmd, strings.TrimPrefix(err.Error(), ErrUsage.Error()+": "), HelpHint(cmd))
		return ExitUsage
	case ctx.Err() != nil && errors.Is(err, context.Canceled):
		fmt.Fprintf(stderr, "%s: %s\n", cmd, Interruption(ctx))
		return InterruptedExit(ctx)
	}
	fmt.Fprintf(stderr, "%s: %v\n", cmd, ferry.Redact(err.Error()))
	return ExitFailed
}
