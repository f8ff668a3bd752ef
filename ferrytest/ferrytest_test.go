package ferrytest_test

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/ferrytest"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/memory"
)

// eachKind runs f once per broker, in parallel subtests.
func eachKind(t *testing.T, f func(t *testing.T, kind ferrytest.Kind)) {
	t.Helper()
	for _, kind := range ferrytest.Kinds {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			f(t, kind)
		})
	}
}

// existsOutside asks the broker, through its own client and not through
// ferrytest, whether a topic or queue exists.
func existsOutside(t *testing.T, kind ferrytest.Kind, name string) bool {
	t.Helper()
	ctx := testenv.Context(t, 20*time.Second)
	switch kind {
	case ferrytest.Kafka, ferrytest.KafkaShare:
		cl, err := kgo.NewClient(kgo.SeedBrokers(testenv.KafkaBrokers()...))
		if err != nil {
			t.Fatal(err)
		}
		defer cl.Close()
		td, err := kadm.NewClient(cl).ListTopics(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return td.Has(name)
	case ferrytest.SQS:
		c := awssqs.New(awssqs.Options{
			Region:       testenv.SQSRegion(),
			BaseEndpoint: aws.String(testenv.SQSEndpoint()),
			Credentials:  credentials.NewStaticCredentialsProvider(testenv.SQSAccessKey, testenv.SQSSecretKey, ""),
		})
		out, err := c.ListQueues(ctx, &awssqs.ListQueuesInput{QueueNamePrefix: aws.String(name)})
		if err != nil {
			t.Fatal(err)
		}
		for _, u := range out.QueueUrls {
			if strings.HasSuffix(u, "/"+name) {
				return true
			}
		}
		return false
	case ferrytest.RabbitMQ:
		conn, err := amqp.DialConfig(testenv.AMQPURL(), amqp.Config{Dial: amqp.DefaultDial(5 * time.Second)})
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		ch, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		_, err = ch.QueueDeclarePassive(name, true, false, false, false, nil)
		var ae *amqp.Error
		if errors.As(err, &ae) && ae.Code == amqp.NotFound {
			return false
		}
		if err != nil {
			t.Fatal(err)
		}
		ch.Close()
		return true
	}
	t.Fatalf("no outside look at %s", kind)
	return false
}

// groupExists asks Kafka, through its own client, whether a consumer group
// exists.
func groupExists(t *testing.T, group string) bool {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(testenv.KafkaBrokers()...))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	gs, err := kadm.NewClient(cl).ListGroups(testenv.Context(t, 20*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	return slices.Contains(gs.Groups(), group)
}

// goneSoon waits until the broker says name is gone: a deleted Kafka topic
// leaves the metadata of every broker shortly after the delete returns.
func goneSoon(t *testing.T, kind ferrytest.Kind, name string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for existsOutside(t, kind, name) {
		if time.Now().After(deadline) {
			t.Fatalf("%s %q still exists after its test ended", kind, name)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// A queue made for a test is removed when the test ends, and one made with
// NewQueue when the Broker closes: the broker's own admin API no longer
// knows it. On the memory broker, the broker itself is closed.
func TestQueuesAreRemovedWhenTheTestEnds(t *testing.T) {
	eachKind(t, func(t *testing.T, kind ferrytest.Kind) {
		var b *ferrytest.Broker
		var q *ferrytest.Queue
		var group atomic.Value // the consumer group RunUntil made
		t.Run("test", func(t *testing.T) {
			b = ferrytest.Open(t, kind)
			q = b.Queue(t, "cleanup")
			ctx := testenv.Context(t, 30*time.Second)
			if err := q.Publish(ctx, consumer.Message{Key: "k", Body: []byte("x")}); err != nil {
				t.Fatal(err)
			}
			if kind != ferrytest.Memory && !existsOutside(t, kind, q.Name) {
				t.Fatalf("%s %q does not exist after Queue", kind, q.Name)
			}
			err := q.RunUntil(ctx, consumer.HandlerFunc(func(ctx context.Context, _ *consumer.Message) error {
				group.Store(consumer.Name(ctx))
				return nil
			}), func() bool { return group.Load() != nil })
			if err != nil {
				t.Fatal(err)
			}
			if (kind == ferrytest.Kafka || kind == ferrytest.KafkaShare) && !groupExists(t, group.Load().(string)) {
				t.Fatalf("the consumer group %v of RunUntil is not there while the test runs", group.Load())
			}
		})
		if t.Failed() || b == nil || q == nil {
			t.SkipNow() // the subtest skipped (no broker) or failed
		}
		if kind == ferrytest.Memory {
			err := b.Publish(context.Background(), q.Destination, consumer.Message{Body: []byte("x")})
			if !errors.Is(err, memory.ErrClosed) {
				t.Fatalf("publish after the test ended: %v, want memory.ErrClosed", err)
			}
			if ok, err := q.Exists(context.Background()); ok || err != nil {
				t.Fatalf("Exists after the test ended: %t, %v", ok, err)
			}
			return
		}
		goneSoon(t, kind, q.Name)
		if (kind == ferrytest.Kafka || kind == ferrytest.KafkaShare) && groupExists(t, group.Load().(string)) {
			t.Errorf("the consumer group %v of RunUntil is still there after the test ended", group.Load())
		}

		// Close removes what NewQueue made.
		ctx := testenv.Context(t, 30*time.Second)
		b2, err := ferrytest.Connect(ctx, kind)
		if err != nil {
			t.Fatal(err)
		}
		q2, err := b2.NewQueue(ctx, "close")
		if err != nil {
			b2.Close()
			t.Fatal(err)
		}
		if ok, err := q2.Exists(ctx); !ok || err != nil {
			t.Errorf("Exists after NewQueue: %t, %v", ok, err)
		}
		if err := b2.Close(); err != nil {
			t.Fatal(err)
		}
		goneSoon(t, kind, q2.Name)
	})
}

// The Standard stack dead-letters a poison message; DeadLetters returns it
// with its story, and leaves it in the queue: it reads the same twice, and
// a consumer of the dead-letter queue still gets it.
func TestDeadLettersTellTheStoryAndKeepTheMessage(t *testing.T) {
	eachKind(t, func(t *testing.T, kind ferrytest.Kind) {
		ctx := testenv.Context(t, 60*time.Second)
		b := ferrytest.Open(t, kind)
		orders := b.Queue(t, "orders")
		dlq := b.Queue(t, "orders-dlq")
		stack, err := consumer.Standard(b, dlq.Name) // the README's shape: the queue's name, on every broker
		if err != nil {
			t.Fatal(err)
		}
		err = orders.Publish(ctx, consumer.Message{ID: "poison-1", Key: "o-9", Body: []byte("not json"), Headers: map[string]string{"tenant": "acme"}})
		if err != nil {
			t.Fatal(err)
		}
		h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
			return consumer.Permanent(errors.New("undecodable order"))
		})
		err = orders.RunUntil(ctx, stack.Wrap(h), func() bool { return stack.DeadLetter.Count() == 1 },
			consumer.WithName("billing-"+string(kind)))
		if err != nil {
			t.Fatal(err)
		}
		for read := 1; read <= 2; read++ {
			dead, err := dlq.DeadLetters(ctx)
			if err != nil {
				t.Fatalf("read %d: %v", read, err)
			}
			if len(dead) != 1 {
				t.Fatalf("read %d: %d dead letters, want 1", read, len(dead))
			}
			d := dead[0]
			if d.Reason != consumer.DLQReasonPermanent || d.Error != "permanent: undecodable order" || d.ErrorKind != "permanent" {
				t.Errorf("read %d: reason %q, error %q (%s)", read, d.Reason, d.Error, d.ErrorKind)
			}
			if d.Source != orders.Name || d.Key != "o-9" || d.Attempts != 1 || d.Consumer != "billing-"+string(kind) {
				t.Errorf("read %d: source %q key %q attempts %d consumer %q", read, d.Source, d.Key, d.Attempts, d.Consumer)
			}
			if d.LastFailure.IsZero() || d.FirstFailure.After(d.LastFailure) {
				t.Errorf("read %d: failures from %v to %v", read, d.FirstFailure, d.LastFailure)
			}
			if string(d.Message.Body) != "not json" || d.Message.Key != "o-9" || d.Message.Header("tenant") != "acme" {
				t.Errorf("read %d: message %q key %q headers %v", read, d.Message.Body, d.Message.Key, d.Message.Headers)
			}
		}
		var got atomic.Int32
		err = dlq.RunUntil(ctx, consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
			if m.Header(consumer.HeaderDLQReason) == consumer.DLQReasonPermanent {
				got.Add(1)
			}
			return nil
		}), func() bool { return got.Load() == 1 })
		if err != nil {
			t.Fatalf("the dead letter is no longer in its queue after reading it: %v", err)
		}
	})
}

// RunUntil gives up when the condition does not hold in time, and says so.
func TestRunUntilGivesUpAtTheDeadline(t *testing.T) {
	b := ferrytest.Open(t, ferrytest.Memory)
	q := b.Queue(t, "slow")
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := q.RunUntil(ctx, consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }),
		func() bool { return false })
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("RunUntil = %v, want an error wrapping context.DeadlineExceeded", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("RunUntil took %v past a 300ms deadline", d)
	}
}

// DeadLetters refuses a message that carries no story rather than hiding it.
func TestDeadLettersRefuseAMessageWithoutAStory(t *testing.T) {
	b := ferrytest.Open(t, ferrytest.Memory)
	q := b.Queue(t, "plain")
	ctx := testenv.Context(t, 10*time.Second)
	if err := q.Publish(ctx, consumer.Message{ID: "m-1", Body: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	if _, err := q.DeadLetters(ctx); !errors.Is(err, ferrytest.ErrNotDeadLetter) {
		t.Fatalf("DeadLetters = %v, want ErrNotDeadLetter", err)
	}
	_, err := ferrytest.ParseDeadLetter(consumer.Message{Headers: map[string]string{
		consumer.HeaderDLQReason: "permanent", consumer.HeaderDLQAttempts: "three",
	}})
	if err == nil || !strings.Contains(err.Error(), consumer.HeaderDLQAttempts) {
		t.Fatalf("ParseDeadLetter of a bad count = %v, want an error naming %s", err, consumer.HeaderDLQAttempts)
	}
}

// Peek reads Kafka topics of several partitions whole, and leaves queues as
// they were: the same messages read twice.
func TestPeekReadsEverythingAndTakesNothing(t *testing.T) {
	eachKind(t, func(t *testing.T, kind ferrytest.Kind) {
		ctx := testenv.Context(t, 60*time.Second)
		b := ferrytest.Open(t, kind)
		q := b.Queue(t, "peek", ferrytest.Partitions(3))
		var msgs []consumer.Message
		for _, k := range []string{"a", "b", "c", "d", "e", "f", "g"} {
			msgs = append(msgs, consumer.Message{Key: k, Body: []byte("body-" + k)})
		}
		if err := q.Publish(ctx, msgs...); err != nil {
			t.Fatal(err)
		}
		for read := 1; read <= 2; read++ {
			got, err := q.Peek(ctx)
			if err != nil {
				t.Fatal(err)
			}
			seen := map[string]bool{}
			for _, m := range got {
				seen[m.Key+"="+string(m.Body)] = true
			}
			if len(got) != len(msgs) || len(seen) != len(msgs) {
				t.Fatalf("read %d: %d messages (%v), want the %d published", read, len(got), seen, len(msgs))
			}
		}
	})
}

// Peek reads a queue deeper than a RabbitMQ driver's default prefetch
// (64): it got 64 of 118 dead letters, then waited for its deadline (found
// by the chaos run). And deeper than a Kafka driver's partition buffer
// (250 records not yet settled): it got 250 of 1,046 dead letters of a
// one-partition topic (found by the 100k chaos run).
func TestPeekReadsMoreThanAPrefetch(t *testing.T) {
	eachKind(t, func(t *testing.T, kind ferrytest.Kind) {
		ctx := testenv.Context(t, 60*time.Second)
		b := ferrytest.Open(t, kind)
		q := b.Queue(t, "peek-deep")
		const n = 600
		msgs := make([]consumer.Message, n)
		for i := range msgs {
			msgs[i] = consumer.Message{Key: fmt.Sprint(i), Body: []byte(fmt.Sprint("body-", i))}
		}
		if err := q.Publish(ctx, msgs...); err != nil {
			t.Fatal(err)
		}
		got, err := q.Peek(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != n {
			t.Fatalf("%d messages, want %d", len(got), n)
		}
	})
}

// With no broker at the configured addresses, Open skips the test with a
// message naming the command that starts the brokers, or fails it under
// FERRY_REQUIRE_BROKERS=1. The test binary runs itself with addresses where
// nothing listens.
func TestOpenSkipsOrFailsNamingTheStartCommand(t *testing.T) {
	if os.Getenv("FERRYTEST_CHILD") != "" {
		t.Skip("the child of this test")
	}
	for _, require := range []string{"", "1"} {
		cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^TestChildOpensUnreachableBrokers$", "-test.v", "-test.count=1")
		cmd.Env = append(os.Environ(),
			"FERRYTEST_CHILD=1",
			"FERRY_REQUIRE_BROKERS="+require,
			"FERRY_KAFKA_BROKERS=127.0.0.1:1",
			"FERRY_SQS_ENDPOINT=http://127.0.0.1:1",
			"FERRY_AMQP_URL=amqp://guest:guest@127.0.0.1:1/",
		)
		out, err := cmd.CombinedOutput()
		for _, kind := range []string{"kafka", "sqs", "rabbitmq"} {
			want := "--- SKIP: TestChildOpensUnreachableBrokers/" + kind
			if require == "1" {
				want = "--- FAIL: TestChildOpensUnreachableBrokers/" + kind
			}
			if !strings.Contains(string(out), want) {
				t.Errorf("FERRY_REQUIRE_BROKERS=%q: no %q in\n%s", require, want, out)
			}
		}
		for _, cmd := range []string{"make brokers", "docker compose up --wait"} {
			if n := strings.Count(string(out), cmd); n < 3 {
				t.Errorf("FERRY_REQUIRE_BROKERS=%q: %q named %d times, want once per broker, in\n%s", require, cmd, n, out)
			}
		}
		if strings.Contains(string(out), "reached-past-open") {
			t.Errorf("FERRY_REQUIRE_BROKERS=%q: a test went on past Open without its broker:\n%s", require, out)
		}
		if (err == nil) != (require == "") {
			t.Errorf("FERRY_REQUIRE_BROKERS=%q: the child's go test ended with %v", require, err)
		}
	}
}

// TestChildOpensUnreachableBrokers is run by
// TestOpenSkipsOrFailsNamingTheStartCommand.
func TestChildOpensUnreachableBrokers(t *testing.T) {
	if os.Getenv("FERRYTEST_CHILD") == "" {
		t.Skip("run by TestOpenSkipsOrFailsNamingTheStartCommand")
	}
	for _, kind := range []ferrytest.Kind{ferrytest.Kafka, ferrytest.SQS, ferrytest.RabbitMQ} {
		t.Run(string(kind), func(t *testing.T) {
			ferrytest.Open(t, kind)
			t.Log("reached-past-open")
		})
	}
}

// The URLs come from the same variables, with the same defaults, as Ferry's
// own integration tests, and ferry.Open takes them.
func TestURLFollowsTheEnvironment(t *testing.T) {
	t.Setenv(ferrytest.EnvKafkaBrokers, "10.1.2.3:9092, 10.1.2.4:9092")
	t.Setenv(ferrytest.EnvSQSEndpoint, "http://sqs.test:4566")
	t.Setenv(ferrytest.EnvSQSRegion, "eu-west-3")
	t.Setenv(ferrytest.EnvAMQPURL, "amqp://u:p@rabbit.test:5673/vh")
	if got, want := ferrytest.URL(ferrytest.Kafka), "kafka://10.1.2.3:9092,10.1.2.4:9092"; got != want {
		t.Errorf("URL(Kafka) = %q, want %q", got, want)
	}
	u, err := url.Parse(ferrytest.URL(ferrytest.SQS))
	if err != nil {
		t.Fatal(err)
	}
	if pw, _ := u.User.Password(); u.Scheme != "sqs" || u.Host != "sqs.test:4566" || u.Query().Get("region") != "eu-west-3" ||
		u.Query().Get("tls") != "false" || u.User.Username() != testenv.SQSAccessKey || pw != testenv.SQSSecretKey {
		t.Errorf("URL(SQS) = %q", u)
	}
	if got := ferrytest.URL(ferrytest.RabbitMQ); got != "amqp://u:p@rabbit.test:5673/vh" {
		t.Errorf("URL(RabbitMQ) = %q", got)
	}
	// ferry.Open takes them (RabbitMQ's dials at once, so it is left out:
	// its URL is the variable's own value).
	for _, kind := range []ferrytest.Kind{ferrytest.Memory, ferrytest.Kafka, ferrytest.SQS} {
		b, err := ferry.Open(t.Context(), ferrytest.URL(kind))
		if err != nil {
			t.Errorf("ferry.Open(URL(%s)): %v", kind, err)
			continue
		}
		b.Close()
	}
	t.Setenv(ferrytest.EnvBroker, "kafka")
	if k, err := ferrytest.KindFromEnv(); k != ferrytest.Kafka || err != nil {
		t.Errorf("KindFromEnv = %q, %v", k, err)
	}
	t.Setenv(ferrytest.EnvBroker, "nats")
	const kinds = "one of memory, kafka, sqs, rabbitmq, kafka-share"
	if _, err := ferrytest.KindFromEnv(); err == nil || !strings.Contains(err.Error(), kinds) {
		t.Errorf("KindFromEnv of nats = %v, want an error naming %q", err, kinds)
	}
	if _, err := ferrytest.Connect(t.Context(), "nats"); err == nil || !strings.Contains(err.Error(), kinds) {
		t.Errorf("Connect(nats) = %v, want an error naming %q", err, kinds)
	}
}

// The package's Example passes on every broker, not only on the memory one
// it runs on by default: the test binary runs it again with
// FERRY_TEST_BROKER set.
func TestExampleRunsOnEveryBroker(t *testing.T) {
	if os.Getenv("FERRYTEST_CHILD") != "" {
		t.Skip("the child of this test")
	}
	for _, kind := range []ferrytest.Kind{ferrytest.Kafka, ferrytest.SQS, ferrytest.RabbitMQ} {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			ferrytest.Open(t, kind) // skip or fail as every test does when it is not there
			cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^Example$", "-test.count=1", "-test.v")
			cmd.Env = append(os.Environ(), "FERRYTEST_CHILD=1", ferrytest.EnvBroker+"="+string(kind))
			out, err := cmd.CombinedOutput()
			if err != nil || !strings.Contains(string(out), "--- PASS: Example ") {
				t.Fatalf("Example on %s: %v\n%s", kind, err, out)
			}
		})
	}
}

// On RabbitMQ a retry after a delay goes through a delay queue the driver
// declares beside the queue; it is removed with the queue.
func TestRabbitMQDelayQueuesGoWithTheirQueue(t *testing.T) {
	var delayQueue string
	t.Run("test", func(t *testing.T) {
		b := ferrytest.Open(t, ferrytest.RabbitMQ)
		q := b.Queue(t, "delayed")
		ctx := testenv.Context(t, 30*time.Second)
		if err := q.Publish(ctx, consumer.Message{Key: "k", Body: []byte("x")}); err != nil {
			t.Fatal(err)
		}
		var runs atomic.Int32
		err := q.RunUntil(ctx, consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
			if runs.Add(1) == 1 {
				return errors.New("not yet") // back through the 1 s delay queue
			}
			return nil
		}), func() bool { return runs.Load() == 2 })
		if err != nil {
			t.Fatal(err)
		}
		delayQueue = q.Name + ".ferry-delay.1000ms"
		if !existsOutside(t, ferrytest.RabbitMQ, delayQueue) {
			t.Fatalf("no delay queue %q: the retry went another way", delayQueue)
		}
	})
	if delayQueue == "" {
		t.SkipNow()
	}
	if existsOutside(t, ferrytest.RabbitMQ, delayQueue) {
		t.Fatalf("the delay queue %q is still there after the test ended", delayQueue)
	}
}
