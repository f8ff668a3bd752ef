// Command chaos is Ferry's "break it" run (make chaos): on each real broker
// it runs an order service that commits orders and their events through the
// PostgreSQL outbox, two relays that publish them, and three billing
// consumers that pay each order through consumer.Standard and the PostgreSQL
// transactional inbox, each an OS process of its own (this binary, run again
// with FERRY_CHAOS_ROLE set). Meanwhile, on a schedule drawn from the seed,
// it SIGKILLs and restarts consumers and relays, restarts the broker
// (integration/brokers.sh restart), takes the payments API down for a while
// (the breaker must hold the messages, not dead-letter them), and feeds it
// poison orders and one slow consumer whose handler outlasts the lease.
//
// At the end it waits for the backlog to drain, prints a table per broker,
// and exits 0 only if every good order was paid exactly once (payments is a
// table with no unique constraint), every poison order is in the dead-letter
// queue with its story, no good order is there, and nothing was lost.
//
// A planted fault (-fault no-idempotency or -fault ack-first) must make the
// run fail, naming the broken invariant.
//
//	go run ./integration/chaos                       # all three brokers, 100k orders each
//	go run ./integration/chaos -broker kafka -orders 5000 -duration 30s
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/ferrymq/ferry/internal/testenv"
)

func main() {
	if role := os.Getenv(envRole); role != "" {
		os.Exit(runChild(role))
	}
	cfg, err := parseFlags(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		os.Exit(2)
	}
	if err := useClusters(cfg); err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	results, err := run(ctx, cfg, os.Stdout)
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		os.Exit(1)
	}
	for _, r := range results {
		if !r.OK() {
			os.Exit(1)
		}
	}
}

// config is the run's settings, from the flags.
type config struct {
	Brokers        []string
	Orders         int
	Duration       time.Duration // how long the order service takes to commit them
	Seed           uint64
	Poison         float64
	DupRate        float64
	KillEvery      time.Duration
	BrokerRestarts int
	Outage         time.Duration
	Slow           time.Duration
	SlowEvery      int
	Fault          string
	DrainTimeout   time.Duration
	BrokersSh      string
	RestartCmd     string
	PostgresURL    string
	Partitions     int
	Capacity       int
	KafkaSession   time.Duration
	Keep           bool
	KeepFailed     bool
	Quiet          bool
	Cluster        bool // break three-node clusters: a broker restart kills a random node
}

// The clusters of integration/brokers.sh up kafka-cluster and up
// rabbitmq-cluster, which -cluster runs against.
const (
	clusterKafka    = "127.0.0.1:19091,127.0.0.1:19092,127.0.0.1:19093"
	clusterRabbitMQ = "amqp://guest:guest@127.0.0.1:5691,127.0.0.1:5692,127.0.0.1:5693/"
)

func parseFlags(args []string) (config, error) {
	var c config
	fs := flag.NewFlagSet("chaos", flag.ContinueOnError)
	brokers := fs.String("broker", "all", "the brokers to break: all (kafka, sqs, rabbitmq, kafka-share), or a comma-separated list of them (kafka-share: Kafka's share groups)")
	fs.IntVar(&c.Orders, "orders", 100_000, "orders per broker")
	fs.DurationVar(&c.Duration, "duration", 3*time.Minute, "how long the order service takes to commit the orders (the chaos runs meanwhile)")
	fs.Uint64Var(&c.Seed, "seed", 1, "the seed of the orders and of the fault schedule")
	fs.Float64Var(&c.Poison, "poison", 0.01, "fraction of poison orders (a permanent error)")
	fs.Float64Var(&c.DupRate, "dup", 0.005, "fraction of good orders whose event is written to the outbox twice")
	fs.DurationVar(&c.KillEvery, "kill-every", 4*time.Second, "mean time between SIGKILLs of a consumer or relay (0: none)")
	fs.IntVar(&c.BrokerRestarts, "broker-restarts", 2, "broker restarts per broker (integration/brokers.sh restart)")
	fs.DurationVar(&c.Outage, "outage", 30*time.Second, "how long the payments API is down (0: never)")
	fs.DurationVar(&c.Slow, "slow", 3*time.Second, "handler time of the slow consumer (above the SQS visibility timeout of 2s); 0: none")
	fs.IntVar(&c.SlowEvery, "slow-every", 20, "the slow consumer is slow on one order in this many (on Kafka a member slow on every record holds its partitions to its pace)")
	fs.StringVar(&c.Fault, "fault", "", "plant a fault that must fail the run: no-idempotency or ack-first")
	fs.DurationVar(&c.DrainTimeout, "drain-timeout", 10*time.Minute, "how long to wait for the backlog to drain after the last order (on Kafka the slow member holds its partitions to its pace: at 100k orders its backlog takes minutes)")
	fs.StringVar(&c.BrokersSh, "brokers-sh", os.Getenv("FERRY_CHAOS_BROKERS_SH"), "the brokers.sh that restarts the brokers (default: integration/brokers.sh of this module, or $FERRY_CHAOS_BROKERS_SH)")
	fs.StringVar(&c.RestartCmd, "restart-cmd", "", "a shell command that restarts the broker instead of brokers.sh ($FERRY_CHAOS_SERVICE names it: kafka, sqs, rabbitmq)")
	fs.StringVar(&c.PostgresURL, "postgres", testenv.PostgresURL(), "PostgreSQL URL (default from FERRY_POSTGRES_URL)")
	fs.IntVar(&c.Partitions, "partitions", 6, "partitions of the Kafka topic")
	fs.IntVar(&c.Capacity, "concurrency", 8, "handlers per billing consumer")
	fs.DurationVar(&c.KafkaSession, "kafka-session", 6*time.Second, "the Kafka billing group's session timeout (0: franz-go's default, 45s): how long a SIGKILLed member's partitions wait")
	fs.BoolVar(&c.Keep, "keep", false, "keep the run's schema, queues and logs")
	fs.BoolVar(&c.KeepFailed, "keep-failed", true, "keep the schema, queues and logs of a failed run")
	fs.BoolVar(&c.Quiet, "quiet", false, "no progress lines, only the tables")
	fs.BoolVar(&c.Cluster, "cluster", false, "break three-node clusters instead of single brokers (kafka and rabbitmq; integration/brokers.sh up kafka-cluster, up rabbitmq-cluster): each broker restart SIGKILLs a random node and starts it again 5s later (brokers.sh kill-node)")
	short := fs.Bool("short", false, "the short setting CI runs: 10,000 orders over 1m, one broker restart, a 10s outage (flags given after it override it)")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if *short { // its values, except where a flag was given
		c.Orders, c.Duration, c.BrokerRestarts, c.Outage, c.KillEvery, c.DrainTimeout = shortOverride(fs, c)
	}
	switch *brokers {
	case "all", "":
		c.Brokers = []string{"kafka", "sqs", "rabbitmq", "kafka-share"}
	default:
		for b := range strings.SplitSeq(*brokers, ",") {
			switch b {
			case "kafka", "sqs", "rabbitmq", "kafka-share":
				c.Brokers = append(c.Brokers, b)
			default:
				return c, fmt.Errorf("-broker: %q is not kafka, sqs, rabbitmq or kafka-share", b)
			}
		}
	}
	if c.Cluster {
		if *brokers == "all" || *brokers == "" {
			c.Brokers = []string{"kafka", "rabbitmq"}
		}
		for _, b := range c.Brokers {
			if b != "kafka" && b != "rabbitmq" {
				return c, fmt.Errorf("-cluster: %q has no cluster to break (kafka and rabbitmq have)", b)
			}
		}
		if c.RestartCmd != "" {
			return c, fmt.Errorf("-cluster picks its own -restart-cmd (brokers.sh kill-node)")
		}
	}
	switch c.Fault {
	case faultNone, faultNoIdem, faultAckFirst:
	default:
		return c, fmt.Errorf("-fault: %q is not no-idempotency or ack-first", c.Fault)
	}
	if c.Orders < 1 || c.Duration <= 0 || c.Poison < 0 || c.Poison >= 1 || c.Capacity < 1 || c.Partitions < 1 {
		return c, fmt.Errorf("-orders, -duration, -concurrency and -partitions must be positive and -poison in [0,1)")
	}
	if c.BrokersSh == "" {
		root, err := moduleRoot()
		if err != nil {
			return c, err
		}
		c.BrokersSh = filepath.Join(root, "integration", "brokers.sh")
	}
	if c.Cluster {
		c.RestartCmd = `"$FERRY_CHAOS_BROKERS_SH" kill-node "$FERRY_CHAOS_SERVICE-cluster" 5`
	}
	return c, nil
}

// useClusters starts the clusters the run breaks (brokers.sh up, which
// starts only the nodes that are down) and points this process and the
// children it starts (they inherit its environment) at them.
func useClusters(c config) error {
	if !c.Cluster {
		return nil
	}
	for _, b := range c.Brokers {
		cmd := exec.Command(c.BrokersSh, "up", b+"-cluster")
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("%s up %s-cluster: %w", c.BrokersSh, b, err)
		}
	}
	os.Setenv(testenv.EnvKafkaBrokers, clusterKafka)
	os.Setenv(testenv.EnvAMQPURL, clusterRabbitMQ)
	return nil
}

// shortOverride keeps the -short values except where a flag was given
// explicitly.
func shortOverride(fs *flag.FlagSet, c config) (int, time.Duration, int, time.Duration, time.Duration, time.Duration) {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	orders, dur, restarts, outage, kill, drain := 10_000, time.Minute, 1, 10*time.Second, 3*time.Second, 3*time.Minute
	if set["orders"] {
		orders = c.Orders
	}
	if set["duration"] {
		dur = c.Duration
	}
	if set["broker-restarts"] {
		restarts = c.BrokerRestarts
	}
	if set["outage"] {
		outage = c.Outage
	}
	if set["kill-every"] {
		kill = c.KillEvery
	}
	if set["drain-timeout"] {
		drain = c.DrainTimeout
	}
	return orders, dur, restarts, outage, kill, drain
}

// moduleRoot finds the directory of go.mod above the working directory.
func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("no go.mod above the working directory: set -brokers-sh")
		}
		dir = parent
	}
}
