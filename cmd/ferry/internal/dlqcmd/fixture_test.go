package dlqcmd

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
	"github.com/ferrymq/ferry/memory"
	"github.com/ferrymq/ferry/rabbit"
)

// envChild makes the test binary run ferry dlq with the JSON array of
// arguments it holds, as the command would (a child process the tests can
// kill).
const envChild = "FERRY_DLQCMD_CHILD"

func TestMain(m *testing.M) {
	if a := os.Getenv(envChild); a != "" {
		var args []string
		if err := json.Unmarshal([]byte(a), &args); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(3)
		}
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
		code := Run(ctx, args, os.Stdout, os.Stderr)
		stop()
		os.Exit(code)
	}
	os.Exit(m.Run())
}

// child starts ferry dlq args in a child process.
func child(t *testing.T, args ...string) (*exec.Cmd, *bytes.Buffer) {
	t.Helper()
	a, _ := json.Marshal(args)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envChild+"="+string(a))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	return cmd, &out
}

// fixture is a dead-letter destination and its source on one broker.
type fixture struct {
	url      string // --broker
	dlq, to  string // DESTINATION and --to
	pub      ferry.Broker
	depth    func(t *testing.T) int            // messages at the source, read without taking them
	drain    func(t *testing.T) map[string]int // the source's messages by body, taken
	left     func(t *testing.T) int            // messages still to redrive in the DLQ
	inDLQ    func(t *testing.T) int            // messages the DLQ holds, read without taking them
	kafka    bool
	client   *awssqs.Client // sqs
	settleIn time.Duration  // how long a killed run's messages stay hidden
}

// seed publishes n dead-lettered messages to the DLQ, bodies m-000...,
// every other one a permanent failure, the others out of attempts.
func (f *fixture) seed(t *testing.T, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	first := time.Date(2026, 11, 30, 10, 0, 0, 0, time.UTC)
	var msgs []consumer.Message
	for i := range n {
		id := fmt.Sprintf("m-%03d", i)
		reason, kind, errText := "max-attempts", "error", "payments API: 503 Service Unavailable"
		if i%2 == 0 {
			reason, kind, errText = "permanent", "permanent", "order "+id+": invalid JSON"
		}
		msgs = append(msgs, consumer.Message{
			ID: "dl-" + id, Key: "k-" + id, Body: []byte(id),
			Headers: map[string]string{
				"x-tenant":                         "acme",
				"x-delivery-count":                 "3", // as RabbitMQ sets it
				"x-last-death-reason":              "rejected",
				consumer.HeaderDLQSource:           "orders",
				consumer.HeaderDLQMessageID:        id,
				consumer.HeaderDLQKey:              "k-" + id,
				consumer.HeaderDLQReason:           reason,
				consumer.HeaderDLQErrorKind:        kind,
				consumer.HeaderDLQError:            errText,
				consumer.HeaderDLQAttempts:         "10",
				consumer.HeaderDLQDeliveries:       "11",
				consumer.HeaderDLQFirstFailure:     first.Format(time.RFC3339Nano),
				consumer.HeaderDLQLastFailure:      first.Add(time.Minute).Format(time.RFC3339Nano),
				consumer.HeaderDLQConsumer:         "billing",
				consumer.HeaderDLQHost:             "host-1",
				consumer.HeaderDLQPublishedAt:      first.Add(-time.Second).Format(time.RFC3339Nano),
				consumer.HeaderDLQErrorType:        "*errors.errorString",
				consumer.HeaderDLQUnseenDeliveries: "1",
				"traceparent":                      "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
				consumer.HeaderDLQLane:             "3",
				consumer.HeaderDLQOffset:           strconv.Itoa(100 + i),
			},
		})
	}
	dest := f.dlq
	if !f.kafka && strings.HasPrefix(f.url, "amqp") {
		dest = rabbit.ToQueue(f.dlq)
	}
	if err := f.pub.Publish(ctx, dest, msgs...); err != nil {
		t.Fatal(err)
	}
}

// memoryFixture is a named memory broker shared in this process.
func memoryFixture(t *testing.T) *fixture {
	name := testenv.UniqueName(t, "")
	f := &fixture{url: "mem://" + name, dlq: "orders-dlq", to: "orders"}
	b, err := ferry.Open(context.Background(), f.url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	f.pub = b
	mb, _ := ferry.Memory(b)
	f.depth = func(*testing.T) int { return len(mb.Messages(f.to)) }
	f.drain = func(*testing.T) map[string]int {
		out := map[string]int{}
		for _, m := range mb.Messages(f.to) {
			out[string(m.Body)]++
		}
		return out
	}
	f.left = func(*testing.T) int { return len(mb.Messages(f.dlq)) }
	f.inDLQ = f.left
	return f
}

func kafkaFixture(t *testing.T) *fixture {
	seeds := testenv.RequireKafka(t)
	kb, err := kafka.New(seeds)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { kb.Close() })
	f := &fixture{url: "kafka://" + strings.Join(seeds, ","), kafka: true,
		dlq: testenv.UniqueName(t, "dlq"), to: testenv.UniqueName(t, "src")}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, topic := range []string{f.dlq, f.to} {
		if err := kb.CreateTopic(ctx, topic, kafka.TopicConfig{Partitions: 2}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = kb.DeleteTopic(context.Background(), topic) })
	}
	b, err := ferry.Open(ctx, f.url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	f.pub = b
	ends := func(topic string) int {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		o, err := kb.Admin().ListEndOffsets(ctx, topic)
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		o.Each(func(l kadm.ListedOffset) { n += int(l.Offset) })
		return n
	}
	f.depth = func(*testing.T) int { return ends(f.to) }
	f.drain = func(t *testing.T) map[string]int {
		msgs, err := kb.Peek(context.Background(), f.to, "", 0)
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]int{}
		for _, m := range msgs {
			out[string(m.Body)]++
		}
		return out
	}
	f.left = func(t *testing.T) int {
		msgs, err := kb.Peek(context.Background(), f.dlq, DefaultGroup, 0)
		if err != nil {
			t.Fatal(err)
		}
		return len(msgs)
	}
	f.inDLQ = func(*testing.T) int { return ends(f.dlq) }
	return f
}

func sqsFixture(t *testing.T) *fixture {
	endpoint := testenv.RequireSQS(t)
	u, err := url.Parse(endpoint)
	if err != nil {
		t.Fatal(err)
	}
	c := awssqs.New(awssqs.Options{
		Region: testenv.SQSRegion(), BaseEndpoint: aws.String(endpoint),
		Credentials: credentials.NewStaticCredentialsProvider(testenv.SQSAccessKey, testenv.SQSSecretKey, ""),
	})
	f := &fixture{
		url: fmt.Sprintf("sqs://%s:%s@%s?region=%s&tls=%t", testenv.SQSAccessKey, testenv.SQSSecretKey, u.Host, testenv.SQSRegion(), u.Scheme == "https"),
		dlq: testenv.UniqueName(t, "dlq"), to: testenv.UniqueName(t, "src"), settleIn: 3 * time.Second, client: c,
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	urls := map[string]string{}
	for _, q := range []string{f.dlq, f.to} {
		out, err := c.CreateQueue(ctx, &awssqs.CreateQueueInput{QueueName: aws.String(q),
			Attributes: map[string]string{"VisibilityTimeout": "2"}})
		if err != nil {
			t.Fatal(err)
		}
		urls[q] = aws.ToString(out.QueueUrl)
		t.Cleanup(func() { c.DeleteQueue(context.Background(), &awssqs.DeleteQueueInput{QueueUrl: out.QueueUrl}) })
	}
	b, err := ferry.Open(ctx, f.url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	f.pub = b
	count := func(q string, hidden bool) int {
		out, err := c.GetQueueAttributes(context.Background(), &awssqs.GetQueueAttributesInput{QueueUrl: aws.String(urls[q]),
			AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameApproximateNumberOfMessages, types.QueueAttributeNameApproximateNumberOfMessagesNotVisible}})
		if err != nil {
			t.Fatal(err)
		}
		n, _ := strconv.Atoi(out.Attributes[string(types.QueueAttributeNameApproximateNumberOfMessages)])
		if hidden {
			h, _ := strconv.Atoi(out.Attributes[string(types.QueueAttributeNameApproximateNumberOfMessagesNotVisible)])
			n += h
		}
		return n
	}
	f.depth = func(*testing.T) int { return count(f.to, true) }
	f.left = func(*testing.T) int { return count(f.dlq, true) }
	f.inDLQ = func(*testing.T) int { return count(f.dlq, false) }
	f.drain = func(t *testing.T) map[string]int {
		out := map[string]int{}
		for {
			r, err := c.ReceiveMessage(context.Background(), &awssqs.ReceiveMessageInput{QueueUrl: aws.String(urls[f.to]),
				MaxNumberOfMessages: 10, VisibilityTimeout: 120, WaitTimeSeconds: 1})
			if err != nil {
				t.Fatal(err)
			}
			if len(r.Messages) == 0 {
				return out
			}
			for _, m := range r.Messages {
				out[aws.ToString(m.Body)]++
			}
		}
	}
	return f
}

func rabbitFixture(t *testing.T) *fixture {
	amqpURL := testenv.RequireRabbitMQ(t)
	f := &fixture{url: amqpURL, dlq: testenv.UniqueName(t, "dlq"), to: testenv.UniqueName(t, "src")}
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ch, err := conn.Channel()
		if err == nil {
			ch.QueueDelete(f.dlq, false, false, false)
			ch.QueueDelete(f.to, false, false, false)
		}
		conn.Close()
	})
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{f.dlq, f.to} {
		if _, err := ch.QueueDeclare(q, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
			t.Fatal(err)
		}
	}
	pb, err := ferry.Open(context.Background(), amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pb.Close() })
	f.pub = pb
	f.to = rabbit.ToQueue(f.to)
	src := strings.TrimPrefix(f.to, rabbit.QueuePrefix)
	depth := func(q string) int {
		ch, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		defer ch.Close()
		qi, err := ch.QueueDeclarePassive(q, true, false, false, false, amqp.Table{"x-queue-type": "quorum"})
		if err != nil {
			t.Fatal(err)
		}
		return qi.Messages
	}
	f.depth = func(*testing.T) int { return depth(src) }
	f.left = func(*testing.T) int { return depth(f.dlq) }
	f.inDLQ = f.left
	f.drain = func(t *testing.T) map[string]int {
		out := map[string]int{}
		for {
			m, ok, err := ch.Get(src, true)
			if err != nil {
				t.Fatal(err)
			}
			if !ok {
				return out
			}
			out[string(m.Body)]++
		}
	}
	return f
}

// brokers are the fixtures of every broker.
var brokers = []struct {
	name string
	make func(t *testing.T) *fixture
}{
	{"memory", memoryFixture},
	{"kafka", kafkaFixture},
	{"sqs", sqsFixture},
	{"rabbitmq", rabbitFixture},
}

// ferryDLQ runs ferry dlq in process.
func ferryDLQ(t *testing.T, ctx context.Context, args ...string) (int, string, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := Run(ctx, args, &out, &errOut)
	return code, out.String(), errOut.String()
}

func waitUntil(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// memoryBroker is the memory broker of a memory fixture.
func memoryBroker(f *fixture) (*memory.Broker, bool) { return ferry.Memory(f.pub) }
