package kafka_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
)

// The killed-member test runs one group member in a separate OS process:
// this test binary, run again with childEnv set, which TestMain hands to
// runChild. The child reports on stdout, one line each: "H p o" when a
// handler starts partition p offset o, "C p o" when a commit of offset o
// for p was accepted, and "B p o" when its handler of p o blocks for good.
const (
	childEnv        = "FERRY_KAFKA_TEST_CHILD"
	childTopicEnv   = "FERRY_KAFKA_TEST_CHILD_TOPIC"
	childGroupEnv   = "FERRY_KAFKA_TEST_CHILD_GROUP"
	childBlockEnv   = "FERRY_KAFKA_TEST_CHILD_BLOCK_AFTER"
	childSessionEnv = "FERRY_KAFKA_TEST_CHILD_SESSION"
	childProtoEnv   = "FERRY_KAFKA_TEST_CHILD_PROTOCOL"
	// childRetryEnv makes the child run a retrying consumer (see
	// runRetryChild).
	childRetryEnv = "FERRY_KAFKA_TEST_CHILD_RETRY"
)

func runChild() int {
	var mu sync.Mutex
	out := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		fmt.Fprintf(os.Stdout, format+"\n", args...)
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	session, _ := time.ParseDuration(os.Getenv(childSessionEnv))
	proto := kafka.Classic
	switch os.Getenv(childProtoEnv) {
	case kafka.NextGen.String():
		proto = kafka.NextGen
	case kafka.Share.String():
		proto = kafka.Share
	}
	b, err := kafka.New(testenv.KafkaBrokers(),
		kafka.WithLogger(log),
		kafka.WithGroupProtocol(proto),
		kafka.WithSessionTimeout(session),
		kafka.WithClientOpts(kgo.HeartbeatInterval(500*time.Millisecond)),
		kafka.WithCommitHook(func(ev kafka.CommitEvent) {
			for p, o := range ev.Offset {
				out("C %d %d", p, o)
			}
		}),
		kafka.WithRebalanceHook(func(ev kafka.RebalanceEvent) {
			for _, p := range ev.Lost {
				out("L %d", p)
			}
			for _, p := range ev.Assigned {
				out("A %d", p)
			}
		}))
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	if os.Getenv(childRetryEnv) != "" {
		return runRetryChild(b, log, out)
	}
	c, err := b.NewConsumer(context.Background(), os.Getenv(childTopicEnv), consumer.WithName(os.Getenv(childGroupEnv)),
		consumer.WithConcurrency(4), consumer.WithLogger(log))
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	blockAfter, _ := strconv.Atoi(os.Getenv(childBlockEnv))
	var n atomic.Int64
	err = c.Run(context.Background(), consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		lane := m.Lane
		var r *kgo.Record
		if lane == "" && m.As(&r) {
			lane = strconv.Itoa(int(r.Partition)) // a share group's records have no lane
		}
		out("H %s %d", lane, m.Offset)
		if n.Add(1) == int64(blockAfter) {
			out("B %s %d", lane, m.Offset)
			<-ctx.Done()
			return ctx.Err()
		}
		time.Sleep(5 * time.Millisecond)
		return nil
	}))
	fmt.Fprintln(os.Stderr, "child: Run returned", err)
	return 1
}

// child is the parent's view of a child process.
type child struct {
	cmd     *exec.Cmd
	mu      sync.Mutex
	handled map[[2]int64]int
	commits map[int32]int64 // highest committed offset per partition
	log     []string        // every line, in order
	blocked bool
	blockAt [2]int64 // the partition and offset whose handler blocked
	done    chan struct{}
}

// runRetryChild runs a retrying consumer (retryChildConfig) of the
// child's topic whose handler fails every record on the topic and on the
// first tier, so that each goes on to the second, and handles it there,
// printing "S body"; its blockAfter-th run there prints "B 0 0" and
// blocks.
func runRetryChild(b *kafka.Broker, log *slog.Logger, out func(string, ...any)) int {
	topic := os.Getenv(childTopicEnv)
	rc, err := b.NewRetryingConsumer(context.Background(), topic, retryChildConfig(topic),
		consumer.WithName(os.Getenv(childGroupEnv)), consumer.WithConcurrency(4), consumer.WithLogger(log))
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	blockAfter, _ := strconv.Atoi(os.Getenv(childBlockEnv))
	var n atomic.Int64
	err = rc.Run(context.Background(), consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if m.Source != rc.Topics()[1] {
			return errors.New("fails before the last tier")
		}
		if n.Add(1) == int64(blockAfter) {
			out("B 0 0")
			<-ctx.Done()
			return ctx.Err()
		}
		time.Sleep(5 * time.Millisecond)
		out("S %s", m.Body)
		return nil
	}))
	fmt.Fprintln(os.Stderr, "child: Run returned", err)
	return 1
}

// startRetryChild starts a child running runRetryChild, in classic groups
// whose sessions time out in 6 s.
func startRetryChild(t *testing.T, topic, group string, blockAfter int) *child {
	return startChild(t, kafka.Classic, topic, group, blockAfter, 6*time.Second, childRetryEnv+"=1")
}

func startChild(t *testing.T, proto kafka.GroupProtocol, topic, group string, blockAfter int, session time.Duration, env ...string) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=1", childTopicEnv+"="+topic, childGroupEnv+"="+group,
		childBlockEnv+"="+strconv.Itoa(blockAfter), childSessionEnv+"="+session.String(), childProtoEnv+"="+proto.String())
	cmd.Env = append(cmd.Env, env...)
	cmd.Stderr = t.Output()
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &child{cmd: cmd, handled: make(map[[2]int64]int), commits: make(map[int32]int64), done: make(chan struct{})}
	go func() {
		defer close(c.done)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			f := strings.Fields(sc.Text())
			c.mu.Lock()
			c.log = append(c.log, sc.Text())
			switch {
			case len(f) == 3 && f[0] == "B":
				c.blocked = true
				c.blockAt[0], _ = strconv.ParseInt(f[1], 10, 64)
				c.blockAt[1], _ = strconv.ParseInt(f[2], 10, 64)
			case len(f) == 3:
				p, _ := strconv.ParseInt(f[1], 10, 64)
				o, _ := strconv.ParseInt(f[2], 10, 64)
				if f[0] == "H" {
					c.handled[[2]int64{p, o}]++
				} else if f[0] == "C" {
					c.commits[int32(p)] = max(c.commits[int32(p)], o)
				}
			}
			c.mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return c
}

func (c *child) kill(t *testing.T) {
	t.Helper()
	if err := c.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatalf("kill child: %v", err)
	}
	<-c.done
	_ = c.cmd.Wait()
}

func (c *child) state() (handled map[[2]int64]int, commits map[int32]int64, blocked bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	h := make(map[[2]int64]int, len(c.handled))
	for k, v := range c.handled {
		h[k] = v
	}
	cm := make(map[int32]int64, len(c.commits))
	for k, v := range c.commits {
		cm[k] = v
	}
	return h, cm, c.blocked
}

// shortenGroupSession sets a KIP-848 group's session timeout and heartbeat
// interval, which are group configs on the broker (the client's
// SessionTimeout applies to classic groups only).
func shortenGroupSession(t *testing.T, group string, session time.Duration) {
	t.Helper()
	setGroupConfig(t, group, map[string]string{
		"consumer.session.timeout.ms":    strconv.Itoa(int(session.Milliseconds())),
		"consumer.heartbeat.interval.ms": "500",
	})
}

// lines returns every line the child printed so far.
func (c *child) lines() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.log...)
}

func (c *child) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if err := c.cmd.Process.Signal(sig); err != nil {
		t.Fatalf("signal %v: %v", sig, err)
	}
}
