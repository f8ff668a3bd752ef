package rabbit_test

import (
	"context"
	"fmt"
	"log/slog"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/rabbit"
)

// amqpURL returns the broker's URL, skipping (or failing, under
// FERRY_REQUIRE_BROKERS=1) when RabbitMQ does not answer.
func amqpURL(t testing.TB) string {
	t.Helper()
	return testenv.RequireRabbitMQ(t)
}

// testLogger logs to the test's output.
func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// dial dials a Broker closed when t ends.
func dial(t testing.TB, opts ...rabbit.Option) *rabbit.Broker {
	t.Helper()
	opts = append([]rabbit.Option{rabbit.WithLogger(testLogger(t)), rabbit.WithReconnectBackoff(50*time.Millisecond, time.Second)}, opts...)
	b, err := rabbit.Dial(amqpURL(t), opts...)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// rawChannel is a plain amqp091 channel for looking at the broker from
// outside the package under test.
func rawChannel(t testing.TB) *amqp.Channel {
	t.Helper()
	conn, err := amqp.DialConfig(amqpURL(t), amqp.Config{Dial: amqp.DefaultDial(5 * time.Second)})
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	t.Cleanup(func() { conn.CloseDeadline(time.Now().Add(time.Second)) })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	return ch
}

// deleteLater deletes queues (with their delay queues, through
// consumer.Admin's DeleteSource on a Broker of its own) and exchanges
// (which the Admin contract does not cover: raw, each on a channel of its
// own, a failure closing a channel) when t ends.
func deleteLater(t testing.TB, queues, exchanges []string) {
	t.Helper()
	deleteLaterAt(t, amqpURL(t), queues, exchanges)
}

// deleteLaterAt is deleteLater on the broker at url (which may name several
// nodes: exchanges are deleted through the first that answers).
func deleteLaterAt(t testing.TB, url string, queues, exchanges []string) {
	t.Helper()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if b, err := rabbit.Dial(url, rabbit.WithLogger(slog.New(slog.DiscardHandler))); err == nil {
			for _, q := range queues {
				_ = b.DeleteSource(ctx, q)
			}
			_ = b.Close()
		}
		if len(exchanges) == 0 {
			return
		}
		nodes, err := rabbit.NodeURLs(url)
		if err != nil {
			return
		}
		var conn *amqp.Connection
		for _, node := range nodes { // the first that answers: a test may have killed some
			if conn, err = amqp.DialConfig(node, amqp.Config{Dial: amqp.DefaultDial(5 * time.Second)}); err == nil {
				break
			}
		}
		if err != nil {
			return
		}
		defer conn.CloseDeadline(time.Now().Add(time.Second))
		for _, e := range exchanges {
			if ch, err := conn.Channel(); err == nil {
				_ = ch.ExchangeDelete(e, false, false)
				ch.Close()
			}
		}
	})
}

// ctlMu serialises rabbitmqctl calls: the node's CLI is slow, and the fault
// tests must not overlap.
var ctlMu sync.Mutex

// ctl runs rabbitmqctl against the node under test and returns its output:
// FERRY_RABBITMQCTL names the command (default rabbitmqctl on PATH; make
// test-rabbit4 gives the 4.0 node's, which runs inside its Debian root) and
// FERRY_RABBITMQ_NODE the node (default rabbit@localhost).
func ctl(t testing.TB, args ...string) string {
	t.Helper()
	return ctlAt(t, envOr("FERRY_RABBITMQ_NODE", "rabbit@localhost"), args...)
}

// ctlAt runs rabbitmqctl against node.
func ctlAt(t testing.TB, node string, args ...string) string {
	t.Helper()
	path, err := exec.LookPath(envOr("FERRY_RABBITMQCTL", "rabbitmqctl"))
	if err != nil {
		if testenv.RequireBrokers() {
			t.Fatalf("rabbitmqctl not found (%v): the fault tests need it (integration/brokers.sh up installs it)", err)
		}
		t.Skip("rabbitmqctl not found; the fault tests need it")
	}
	ctlMu.Lock()
	defer ctlMu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, path, append([]string{"-n", node, "-q"}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("rabbitmqctl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// unacked asks the broker how many of queue's messages are delivered and
// not acked.
func unacked(t testing.TB, queue string) int {
	t.Helper()
	for _, line := range strings.Split(ctl(t, "list_queues", "name", "messages_unacknowledged"), "\n") {
		f := strings.Fields(line)
		if len(f) == 2 && f[0] == queue {
			n, _ := strconv.Atoi(f[1])
			return n
		}
	}
	return 0
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

var _ = fmt.Sprint

func splitLines(s string) []string { return strings.Split(s, "\n") }

func fields(s string) []string { return strings.Fields(s) }

func containsAll(s string, subs ...string) bool {
	for _, x := range subs {
		if !strings.Contains(s, x) {
			return false
		}
	}
	return true
}

// queueDriver is every interface the driver of rabbit.Broker.Driver
// implements beyond driver.Driver.
type queueDriver interface {
	driver.Driver
	driver.Connector
	driver.Revoker
	driver.Drainer
	driver.Aser
	driver.LagReporter
}

// openDriver is b.Driver(queue, cfg), as the queueDriver it is.
func openDriver(t *testing.T, b *rabbit.Broker, queue string, cfg driver.Config) (queueDriver, error) {
	d, err := b.Driver(t.Context(), queue, cfg)
	if err != nil {
		return nil, err
	}
	return d.(queueDriver), nil
}
