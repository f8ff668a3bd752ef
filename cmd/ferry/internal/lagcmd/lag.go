// Package lagcmd is the ferry lag command: how far a consumer group is
// behind on a source, lane by lane, how old its backlog is, and Burrow's
// verdict on each lane over a window of samples (consumer.Evaluate), on
// every broker ferry.Open opens, without joining the group. The command
// refuses mem:// (a new process's in-process broker is empty); the
// sampling works on any ferry.Broker, the memory broker too.
package lagcmd

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/cmd/ferry/internal/cli"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/brokerkind"
)

const usage = `Usage: ferry lag SOURCE --group NAME --broker URL [--watch] [--interval d] [--samples n] [--json]

Shows how far the consumer group NAME is behind on SOURCE (a topic or a
queue): the lag of each lane, the age of the oldest waiting message, and
the verdict on each lane in the terms of LinkedIn's Burrow, over a window
of samples taken every --interval:
  OK      the lane keeps up (its lag touched zero, or shrinks)
  WARN    the lane moves, but its lag grows
  STALL   the lane does not move while its lag grows
  STOP    the lane does not move and its lag does not change, with messages waiting
  REWIND  the lane's position went back (a reset offset)
Without --watch it takes --samples samples and prints once; with --watch it
prints after every sample, judging the last --samples, until interrupted.
Nothing joins the group or moves its position. What lag means per broker:
  kafka     per partition: the end offset minus the group's committed offset;
            the position is the committed offset; the backlog's age is
            that of the first record past it. A share group (a --broker URL
            with group_protocol=share): the records not yet acknowledged, as
            the group coordinator counts them; the position is the end
            offset less that lag (it moves as records are acknowledged);
            the broker tells no age of the backlog (the consumers' /healthz
            has the age of the records they hold)
  sqs       the queue's approximate visible, delayed and in-flight (not
            visible) messages: every message not yet deleted (one lane), as
            the consumers' /healthz and ferry.consumer.lag count it; SQS
            tells no position: a sample in which consumers hold messages
            (ApproximateNumberOfMessagesNotVisible > 0) counts as progress;
            the backlog's age is in CloudWatch only, as the metric
            ApproximateAgeOfOldestMessage
  rabbitmq  the queue's ready messages (one lane); RabbitMQ tells no position
            over AMQP, so the verdict reads the depth alone (STOP: it did
            not move)
The group matters for Kafka only; queues are shared by their consumers.

Exit status: 0 every lane OK or WARN, 1 a lane STALL, STOP or REWIND, or
the broker failed; 2 bad usage; 130 interrupted, 143 terminated (SIGTERM);
--watch ends so, and exits 0 then.

Flags:
`

// Run runs ferry lag with args (after "lag") and returns the exit code.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return run(ctx, args, stdout, stderr, cli.Open)
}

// run is Run with the opener of --broker.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, open cli.Opener) int {
	fs, o := flags(stderr)
	pos, err := cli.Parse(fs, args)
	if errors.Is(err, flag.ErrHelp) {
		return cli.ExitOK
	}
	bad := false
	err = func() error {
		if err != nil {
			return err
		}
		if len(pos) != 1 {
			return cli.Usagef("want one SOURCE, got %d arguments", len(pos))
		}
		if o.interval <= 0 || o.samples < 2 {
			return cli.Usagef("--interval must be positive and --samples at least 2")
		}
		b, err := open(ctx, o.broker)
		if err != nil {
			return err
		}
		defer b.Close()
		if cli.Kind(b) == brokerkind.Kafka && o.group == "" {
			return cli.Usagef("--group NAME is required on Kafka")
		}
		bad, err = watch(ctx, b, pos[0], o, stdout)
		return err
	}()
	if err == nil && bad {
		return cli.ExitFailed
	}
	if o.watch && err != nil && ctx.Err() != nil && errors.Is(err, context.Canceled) {
		return cli.ExitOK
	}
	return cli.Report(ctx, stderr, "ferry lag", err)
}

// Help prints ferry lag's help to w.
func Help(w io.Writer) {
	fs, _ := flags(w)
	fs.Usage()
}

type opts struct {
	broker, group string
	watch, json   bool
	interval      time.Duration
	samples       int
}

func flags(w io.Writer) (*flag.FlagSet, *opts) {
	o := &opts{}
	fs := flag.NewFlagSet("ferry lag", flag.ContinueOnError)
	fs.SetOutput(w)
	fs.StringVar(&o.broker, "broker", "", "kafka://HOST:PORT, sqs://... or amqp://... (default $"+cli.EnvBroker+")")
	fs.StringVar(&o.group, "group", "", "the consumer group (its consumer.WithName); required on Kafka")
	fs.BoolVar(&o.watch, "watch", false, "print after every sample until interrupted")
	fs.DurationVar(&o.interval, "interval", 2*time.Second, "time between samples")
	fs.IntVar(&o.samples, "samples", 5, "samples in the verdict's window (at least 2)")
	fs.BoolVar(&o.json, "json", false, "print JSON (one object per report)")
	fs.Usage = func() {
		fmt.Fprint(w, usage)
		fs.PrintDefaults()
	}
	return fs, o
}

// Sample is one reading of the lag.
type Sample struct {
	At        time.Time
	Lanes     map[string]int64 // lag per lane ("" for a queue)
	Positions map[string]int64 // position per lane (see the usage)
	InFlight  int64            // -1: unknown
	OldestAge time.Duration    // 0: unknown
}

// Report is the lag of a group on a source over a window of samples.
type Report struct {
	Source    string      `json:"source"`
	Group     string      `json:"group,omitempty"`
	Broker    string      `json:"broker"`
	At        time.Time   `json:"at"`
	Window    string      `json:"window"`
	Samples   int         `json:"samples"`
	Lag       int64       `json:"lag"`
	InFlight  int64       `json:"in_flight"`                    // -1: the broker does not say
	OldestAge *float64    `json:"oldest_age_seconds,omitempty"` // absent: the broker does not say
	Verdict   string      `json:"verdict"`                      // the worst lane's
	Lanes     []LaneState `json:"lanes"`
}

// LaneState is one lane's lag, position and verdict.
type LaneState struct {
	Lane     string `json:"lane"`
	Lag      int64  `json:"lag"`
	Position int64  `json:"position"`
	Verdict  string `json:"verdict"`
}

// severity orders verdicts from the least to the most urgent.
var severity = map[consumer.Verdict]int{
	consumer.VerdictOK: 0, consumer.VerdictWarn: 1, consumer.VerdictRewind: 2, consumer.VerdictStall: 3, consumer.VerdictStop: 4,
}

// Judge reports on a window of samples, oldest first.
func Judge(source, group, broker string, window []Sample) Report {
	last := window[len(window)-1]
	r := Report{Source: source, Group: group, Broker: broker, At: last.At, Samples: len(window),
		Window: last.At.Sub(window[0].At).Round(time.Millisecond).String(), InFlight: last.InFlight,
		Verdict: string(consumer.VerdictOK)}
	if last.OldestAge > 0 {
		s := last.OldestAge.Seconds()
		r.OldestAge = &s
	}
	worst := consumer.VerdictOK
	for _, lane := range sortedLanes(last.Lanes) {
		var lags, positions []int64
		for _, s := range window {
			lag, ok := s.Lanes[lane]
			if !ok {
				continue
			}
			lags = append(lags, lag)
			positions = append(positions, s.Positions[lane])
		}
		v := consumer.Evaluate(lags, positions)
		if severity[v] > severity[worst] {
			worst = v
		}
		r.Lag += last.Lanes[lane]
		r.Lanes = append(r.Lanes, LaneState{Lane: lane, Lag: last.Lanes[lane], Position: last.Positions[lane], Verdict: string(v)})
	}
	r.Verdict = string(worst)
	return r
}

func sortedLanes(m map[string]int64) []string {
	out := make([]string, 0, len(m))
	for l := range m {
		out = append(out, l)
	}
	slices.SortFunc(out, func(a, b string) int {
		ai, aerr := strconv.Atoi(a)
		bi, berr := strconv.Atoi(b)
		if aerr == nil && berr == nil {
			return ai - bi
		}
		if a < b {
			return -1
		}
		if a > b {
			return 1
		}
		return 0
	})
	return out
}

// Bad reports whether the verdict calls for someone to look: STALL, STOP
// or REWIND.
func (r Report) Bad() bool {
	switch consumer.Verdict(r.Verdict) {
	case consumer.VerdictStall, consumer.VerdictStop, consumer.VerdictRewind:
		return true
	}
	return false
}

// watch samples and prints; it reports whether the last report was bad.
func watch(ctx context.Context, b ferry.Broker, source string, o *opts, out io.Writer) (bool, error) {
	s, err := newSampler(ctx, b, source, o.group)
	if err != nil {
		return false, err
	}
	var window []Sample
	t := time.NewTicker(o.interval)
	defer t.Stop()
	for {
		smp, err := s.sample(ctx)
		if err != nil {
			return false, err
		}
		window = append(window, smp)
		if len(window) > o.samples {
			window = window[1:]
		}
		if o.watch || len(window) == o.samples {
			r := Judge(source, o.group, cli.Kind(b), window)
			if err := print(out, r, o.json); err != nil {
				return false, err
			}
			if !o.watch {
				return r.Bad(), nil
			}
		}
		select {
		case <-ctx.Done():
			return false, ctx.Err()
		case <-t.C:
		}
	}
}

func print(w io.Writer, r Report, asJSON bool) error {
	if asJSON {
		return json.NewEncoder(w).Encode(r)
	}
	age := "unknown"
	if r.OldestAge != nil {
		age = (time.Duration(*r.OldestAge * float64(time.Second))).Round(time.Millisecond).String()
	}
	inflight := "unknown"
	if r.InFlight >= 0 {
		inflight = strconv.FormatInt(r.InFlight, 10)
	}
	group := ""
	if r.Group != "" {
		group = " group " + r.Group
	}
	fmt.Fprintf(w, "%s %s%s (%s): lag %d, in flight %s, oldest %s, verdict %s over %d samples in %s\n",
		r.At.UTC().Format("15:04:05"), r.Source, group, r.Broker, r.Lag, inflight, age, r.Verdict, r.Samples, r.Window)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "  LANE\tLAG\tPOSITION\tVERDICT")
	for _, l := range r.Lanes {
		lane := l.Lane
		if lane == "" {
			lane = "-"
		}
		fmt.Fprintf(tw, "  %s\t%d\t%d\t%s\n", lane, l.Lag, l.Position, l.Verdict)
	}
	return tw.Flush()
}
