package dlqcmd

import (
	"bytes"
	"context"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kadm"
	"go.uber.org/goleak"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/cmd/ferry/internal/cli"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
	"github.com/ferrymq/ferry/memory"
)

func TestMain(m *testing.M) {
	code := m.Run()
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	// Every broker, consumer and connection the tests open is closed by
	// the time they end.
	if code == 0 {
		if err := goleak.Find(testenv.LeakOptions()...); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

var (
	buildOnce sync.Once
	binDir    string // holds the built ferry
	binErr    error
)

// ferryBinary builds the ferry command once per test run, and returns its
// path: the tests that signal or kill a redrive run the real program.
func ferryBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		goTool, err := exec.LookPath("go")
		if err != nil {
			binErr = err
			return
		}
		if binDir, binErr = os.MkdirTemp("", "ferry-bin-"); binErr != nil {
			return
		}
		out, err := exec.Command(goTool, "build", "-o", filepath.Join(binDir, "ferry"), "github.com/ferrymq/ferry/cmd/ferry").CombinedOutput()
		if err != nil {
			binErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if binErr != nil {
		t.Fatal(binErr)
	}
	return filepath.Join(binDir, "ferry")
}

// child starts the built ferry dlq args in a child process, its stdout and
// stderr in one buffer.
func child(t *testing.T, args ...string) (*exec.Cmd, *syncBuffer) {
	t.Helper()
	cmd := exec.Command(ferryBinary(t), append([]string{"dlq"}, args...)...)
	out := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	return cmd, out
}

// syncBuffer is a bytes.Buffer that a child's output and the test share.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// fixture is a dead-letter destination and its source on one broker.
type fixture struct {
	url      string // --broker
	dlq, to  string // DESTINATION and --to
	src      string // the source the dead letters name (ferry-dlq-source)
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
// every other one a permanent failure, the others out of attempts, each
// naming f.src as its source.
func (f *fixture) seed(t *testing.T, n int) {
	t.Helper()
	f.publish(t, deadLetters(f.src, 0, n)...)
}

// publish publishes msgs to the DLQ.
func (f *fixture) publish(t *testing.T, msgs ...consumer.Message) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := f.pub.Publish(ctx, f.dlq, msgs...); err != nil {
		t.Fatal(err)
	}
}

// deadLetters are the dead letters m-FROM... to m-(FROM+N-1) of source,
// as consumer.DeadLetter writes them.
func deadLetters(source string, from, n int) []consumer.Message {
	first := time.Date(2026, 11, 30, 10, 0, 0, 0, time.UTC)
	var msgs []consumer.Message
	for i := from; i < from+n; i++ {
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
				consumer.HeaderDLQSource:           source,
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
	return msgs
}

// memoryFixture is a named memory broker shared in this process, which
// only the in-process runs of the command reach (ferryDLQ: the command
// itself refuses mem://).
func memoryFixture(t *testing.T) *fixture {
	name := testenv.UniqueName(t, "")
	f := &fixture{url: "mem://" + name, dlq: "orders-dlq", to: "orders", src: "orders"}
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
	f.src = f.to
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
		msgs, err := kb.PeekGroup(context.Background(), f.to, "", 0)
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
		msgs, err := kb.PeekGroup(context.Background(), f.dlq, DefaultGroup, 0)
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
	f.src = f.to
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
	// --to names the queue bare, as a user does, and as the dead letters
	// name their source.
	f.src = f.to
	src := f.to
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

// ferryDLQ runs ferry dlq in process, where it may open the memory
// fixture's mem:// broker.
func ferryDLQ(t *testing.T, ctx context.Context, args ...string) (int, string, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := run(ctx, args, &out, &errOut, openInProcess)
	return code, out.String(), errOut.String()
}

// openInProcess opens what cli.Open does, and the in-process mem://
// brokers too.
func openInProcess(ctx context.Context, url string) (ferry.Broker, error) {
	if strings.HasPrefix(url, "mem://") {
		return ferry.Open(ctx, url)
	}
	return cli.Open(ctx, url)
}

// memoryBroker is the memory broker of a memory fixture.
func memoryBroker(f *fixture) (*memory.Broker, bool) { return ferry.Memory(f.pub) }
