package demo

import (
	"bytes"
	"context"
	"errors"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
	"github.com/ferrymq/ferry/sqs"
)

// brokerURLs returns the URL of each real broker, from the environment
// variables of internal/testenv; a broker that does not answer skips its
// run (or fails it, with FERRY_REQUIRE_BROKERS=1).
func brokerURL(t *testing.T, service testenv.Service) string {
	t.Helper()
	switch service {
	case testenv.Kafka:
		return "kafka://" + strings.Join(testenv.RequireKafka(t), ",")
	case testenv.SQS:
		u, err := url.Parse(testenv.RequireSQS(t))
		if err != nil {
			t.Fatal(err)
		}
		tls := "true"
		if u.Scheme == "http" {
			tls = "false"
		}
		return "sqs://" + url.UserPassword(testenv.SQSAccessKey, testenv.SQSSecretKey).String() + "@" + u.Host +
			"?tls=" + tls + "&region=" + url.QueryEscape(testenv.SQSRegion())
	case testenv.RabbitMQ:
		return testenv.RequireRabbitMQ(t)
	}
	t.Fatalf("no URL for %s", service)
	return ""
}

// brokerConfig is a short run on a real broker: about 8s of orders, and
// up to 30s to drain.
func brokerConfig(out *bytes.Buffer, broker string) Config {
	c := DefaultConfig()
	c.Broker = broker
	c.Orders = 40
	c.Steady, c.Slow, c.Failing, c.Protected = 2*time.Second, 3*time.Second, time.Second, 2*time.Second
	c.Recovered = 30 * time.Second
	c.SlowLatency = time.Second
	c.StatusInterval = 500 * time.Millisecond
	c.Out = out
	return c
}

// The whole story on each real broker, and on Kafka's share groups: the
// verdict passes, and the kill is the broker's own kind of takeover.
func TestRunOnEachRealBrokerHoldsEveryInvariant(t *testing.T) {
	for _, tc := range []struct {
		name     string
		service  testenv.Service
		query    string // added to the broker's URL
		broker   string // Verdict.Broker
		takeover string // how the killed consumer's messages came back
	}{
		{"kafka", testenv.Kafka, "", "Kafka", "after the rebalance"},
		{"kafka-share", testenv.Kafka, "?group_protocol=share", "Kafka", "once the broker had them back"},
		{"sqs", testenv.SQS, "", "SQS", "after the visibility timeout"},
		{"rabbitmq", testenv.RabbitMQ, "", "RabbitMQ", "once RabbitMQ requeued them"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			c := brokerConfig(&out, brokerURL(t, tc.service)+tc.query)
			start := time.Now()
			v := runDemo(t, c)
			t.Logf("%s in %s; output:\n%s", tc.name, time.Since(start).Round(100*time.Millisecond), out.String())

			if !v.OK() {
				t.Fatalf("verdict broken on %s: %v", tc.name, v.Broken())
			}
			if v.Broker != tc.broker {
				t.Errorf("ran on %q, want %q", v.Broker, tc.broker)
			}
			if v.Orders != c.Orders || v.Paid != int64(c.Orders-4) {
				t.Errorf("orders %d, paid %d; want %d and %d", v.Orders, v.Paid, c.Orders, c.Orders-4)
			}
			if v.DuplicatesPublished == 0 || v.DuplicatesSuppressed < v.DuplicatesPublished {
				t.Errorf("%d duplicates published, %d suppressed", v.DuplicatesPublished, v.DuplicatesSuppressed)
			}
			if v.Killed != Victim || v.Orphaned == 0 || v.TakenOver != v.Orphaned {
				t.Errorf("kill: %q killed holding %d messages, %d taken over", v.Killed, v.Orphaned, v.TakenOver)
			}
			if v.TakenOverHow != tc.takeover {
				t.Errorf("taken over %q, want %q", v.TakenOverHow, tc.takeover)
			}
			if !strings.Contains(out.String(), "all invariants hold") {
				t.Errorf("output lacks the verdict")
			}

			// The run's queues (topics) are gone: a second run starts clean.
			orders := ordersQueueOf(t, out.String())
			if exists := queueExists(t, c.Broker, orders); exists {
				t.Errorf("%s still exists after the run", orders)
			}
		})
	}
}

// ordersQueueOf reads the name of the run's orders queue (or topic) from
// its first line.
func ordersQueueOf(t *testing.T, out string) string {
	t.Helper()
	first, _, _ := strings.Cut(out, "\n")
	for _, f := range strings.Fields(first) {
		if strings.HasPrefix(f, "ferry-demo-") && strings.HasSuffix(f, "-orders") {
			return f
		}
	}
	t.Fatalf("the first line names no orders queue: %s", first)
	return ""
}

// queueExists asks the broker behind rawURL whether a queue (Kafka: a
// topic) named name exists.
func queueExists(t *testing.T, rawURL, name string) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b, err := ferry.Open(ctx, rawURL)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	switch k := b.(type) {
	case *kafka.Broker:
		topics, err := k.Admin().ListTopics(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		return topics.Has(name)
	case *sqs.Broker:
		_, err := k.Client().GetQueueUrl(ctx, &awssqs.GetQueueUrlInput{QueueName: aws.String(name)})
		var missing *types.QueueDoesNotExist
		if errors.As(err, &missing) {
			return false
		}
		if err != nil {
			t.Fatal(err)
		}
		return true
	}
	s := &site{url: rawURL}
	found := false
	err = s.rabbitConn(ctx, func(conn *amqp.Connection) error {
		return onChannel(conn, func(ch *amqp.Channel) error {
			_, err := ch.QueueDeclarePassive(name, true, false, false, false, nil)
			found = err == nil
			var ae *amqp.Error
			if errors.As(err, &ae) && ae.Code == amqp.NotFound {
				return nil
			}
			return err
		})
	})
	if err != nil {
		t.Fatal(err)
	}
	return found
}

// A URL ferry.Open refuses fails the run with its *ferry.URLError, which
// names the part and hides the password.
func TestRunRejectsABadBrokerURL(t *testing.T) {
	c := DefaultConfig()
	c.Broker = "kafka://billing:s3cret@127.0.0.1:9092"
	_, err := Run(context.Background(), c)
	var ue *ferry.URLError
	if !errors.As(err, &ue) || !errors.Is(err, ferry.ErrBadURL) {
		t.Fatalf("Run: %v, want a *ferry.URLError", err)
	}
	if ue.Part != "user" {
		t.Errorf("part %q, want user", ue.Part)
	}
	if strings.Contains(err.Error(), "s3cret") {
		t.Errorf("the error shows the password: %v", err)
	}
}

// With DB, the outbox, the payments and the idempotency keys live in
// PostgreSQL, in a schema of the run's own that is dropped at the end.
func TestRunWithPostgresHoldsEveryInvariant(t *testing.T) {
	dbURL := testenv.RequirePostgres(t)
	var out bytes.Buffer
	c := brokerConfig(&out, brokerURL(t, testenv.SQS))
	c.DB = dbURL
	v := runDemo(t, c)
	t.Logf("output:\n%s", out.String())
	if !v.OK() {
		t.Fatalf("verdict broken with PostgreSQL: %v", v.Broken())
	}
	first, _, _ := strings.Cut(out.String(), "\n")
	_, rest, ok := strings.Cut(first, "PostgreSQL (schema ")
	if !ok {
		t.Fatalf("the first line does not name the schema: %s", first)
	}
	schema, _, _ := strings.Cut(rest, ",")

	conn, err := pgx.Connect(context.Background(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var n int
	if err := conn.QueryRow(context.Background(), `SELECT count(*) FROM pg_namespace WHERE nspname = $1`, schema).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Errorf("schema %s is still there after the run", schema)
	}
}

// A database URL that is not PostgreSQL's fails the run with ErrBadDBURL,
// without its password.
func TestRunRejectsABadDatabaseURL(t *testing.T) {
	c := DefaultConfig()
	c.DB = "postgres://ferry:s3cret@127.0.0.1:5432/ferry?sslmode=sometimes"
	_, err := Run(context.Background(), c)
	if !errors.Is(err, ErrBadDBURL) {
		t.Fatalf("Run: %v, want ErrBadDBURL", err)
	}
	if strings.Contains(err.Error(), "s3cret") {
		t.Errorf("the error shows the password: %v", err)
	}
}
