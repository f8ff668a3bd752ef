// Package cli holds what the operating commands of ferry (lag, dlq) share:
// their exit codes, flag parsing that lets flags follow the arguments,
// opening the broker of --broker, and reaching the driver beneath a
// broker opened by ferry.Open.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/rabbit"
)

// Exit codes of every ferry command.
const (
	// ExitOK: the command did what it was asked.
	ExitOK = 0
	// ExitFailed: the broker, or the work, failed.
	ExitFailed = 1
	// ExitUsage: bad flags or arguments.
	ExitUsage = 2
	// ExitInterrupted: stopped by SIGINT, cleanly.
	ExitInterrupted = 130
)

// EnvBroker names the environment variable that is --broker's default.
const EnvBroker = "FERRY_BROKER"

// ErrUsage marks an error in the command line: the command prints it with
// its usage and exits with ExitUsage.
var ErrUsage = errors.New("bad usage")

// Usagef returns an error matching ErrUsage.
func Usagef(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrUsage, fmt.Sprintf(format, args...))
}

// Parse parses args with fs, letting flags come before, between and after
// the positional arguments (ferry dlq peek orders-dlq --json), and returns
// the positional arguments. "--" ends the flags. It returns flag.ErrHelp
// for -h and --help, and an error matching ErrUsage for a bad flag.
func Parse(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
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

// Open opens the broker of url (--broker, else $FERRY_BROKER). A missing
// URL is a usage error.
func Open(ctx context.Context, url string) (ferry.Broker, error) {
	if url == "" {
		url = os.Getenv(EnvBroker)
	}
	if url == "" {
		return nil, Usagef("--broker URL is required (or set %s): mem://NAME, kafka://HOST:PORT, sqs://..., amqp://...", EnvBroker)
	}
	b, err := ferry.Open(ctx, url)
	if errors.Is(err, ferry.ErrBadURL) {
		return nil, fmt.Errorf("%w: %w", ErrUsage, err)
	}
	return b, err
}

// Kind names the broker behind b: "memory", "kafka", "sqs" or "rabbitmq".
func Kind(b ferry.Broker) string {
	switch b.(type) {
	case kafkaDriverer:
		return "kafka"
	case sqsDriverer:
		return "sqs"
	case rabbitDriverer:
		return "rabbitmq"
	case memDriverer:
		return "memory"
	}
	return "unknown"
}

type (
	kafkaDriverer interface {
		Driver(topic, group string) (driver.Driver, error)
	}
	sqsDriverer interface {
		Driver(ctx context.Context, queue string) (driver.Driver, error)
	}
	rabbitDriverer interface {
		Driver(queue string, opts ...rabbit.DriverOption) (*rabbit.Driver, error)
	}
	memDriverer interface {
		Driver(queue string) (driver.Driver, error)
	}
)

// Driver returns the driver of source on b, outside any delivery loop:
// on Kafka a member of group (which joins the group on its first Fetch),
// on RabbitMQ one whose prefetch is prefetch (1 to 65535), on SQS and
// memory a receiver of the queue.
func Driver(ctx context.Context, b ferry.Broker, source, group string, prefetch int) (driver.Driver, error) {
	switch x := b.(type) {
	case kafkaDriverer:
		return x.Driver(source, group)
	case sqsDriverer:
		return x.Driver(ctx, source)
	case rabbitDriverer:
		return x.Driver(source, rabbit.Prefetch(min(max(prefetch, 1), 65535)))
	case memDriverer:
		return x.Driver(source)
	}
	return nil, fmt.Errorf("no driver for a broker of type %T", b)
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

// Report prints err for the command named cmd and returns its exit code:
// ExitUsage (with usage) for a usage error, ExitInterrupted when ctx was
// interrupted, ExitFailed otherwise.
func Report(ctx context.Context, stderr io.Writer, cmd string, err error, usage func()) int {
	switch {
	case err == nil:
		return ExitOK
	case errors.Is(err, ErrUsage):
		fmt.Fprintf(stderr, "%s: %s\n\n", cmd, strings.TrimPrefix(err.Error(), ErrUsage.Error()+": "))
		if usage != nil {
			usage()
		}
		return ExitUsage
	case ctx.Err() != nil && errors.Is(err, context.Canceled):
		fmt.Fprintf(stderr, "%s: interrupted\n", cmd)
		return ExitInterrupted
	}
	fmt.Fprintf(stderr, "%s: %v\n", cmd, ferry.Redact(err.Error()))
	return ExitFailed
}
