package ferry_test

import (
	"context"
	"errors"
	"net"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/ferrytest"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/memory"
)

// roundTrip publishes one message to source through b and consumes it
// through a consumer of b, and fails the test unless it arrives whole.
func roundTrip(t *testing.T, b ferry.Broker, source, destination string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	l, err := b.NewConsumer(ctx, source, consumer.WithName(testenv.UniqueName(t, "open")))
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan consumer.Message, 1)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- l.Run(runCtx, consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
			select {
			case got <- *m:
			default:
			}
			return nil
		}))
	}()
	// The consumer declares its queue as it starts (RabbitMQ): publish
	// until the destination takes the message.
	for {
		err := b.Publish(ctx, destination, consumer.Message{ID: "m-1", Key: "k", Body: []byte("hello"), Headers: map[string]string{"h": "v"}})
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	select {
	case m := <-got:
		if string(m.Body) != "hello" || m.Headers["h"] != "v" {
			t.Errorf("got %q with headers %v", m.Body, m.Headers)
		}
	case <-ctx.Done():
		t.Fatal("the message never arrived")
	}
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

func TestOpenMemory(t *testing.T) {
	b, err := ferry.Open(context.Background(), "mem://")
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	roundTrip(t, b, "orders", "orders")
}

// Two Opens of mem://NAME share one broker: what one publishes the other
// consumes; it closes with the last of them.
func TestOpenMemoryByNameIsShared(t *testing.T) {
	ctx := context.Background()
	pub, err := ferry.Open(ctx, "mem://shared-test?autocreate=false")
	if err != nil {
		t.Fatal(err)
	}
	sub, err := ferry.Open(ctx, "mem://shared-test")
	if err != nil {
		t.Fatal(err)
	}
	mb, ok := ferry.Memory(pub)
	if !ok {
		t.Fatal("Memory(mem://) = false")
	}
	if err := mb.CreateQueue("q", memoryQueue()); err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish(ctx, "q", consumer.Message{Body: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	if sb, _ := ferry.Memory(sub); sb.Stats("q").Visible != 1 {
		t.Fatalf("the second Open does not see the first's message: %+v", sb.Stats("q"))
	}
	pub.Close()
	if err := sub.Publish(ctx, "q", consumer.Message{Body: []byte("y")}); err != nil {
		t.Fatalf("closing one Open closed the shared broker: %v", err)
	}
	sub.Close()
	if err := sub.Publish(ctx, "q", consumer.Message{Body: []byte("z")}); err == nil {
		t.Fatal("the shared broker still publishes after its last Open closed")
	}
}

func TestOpenKafka(t *testing.T) {
	seeds := testenv.RequireKafka(t)
	b, err := ferry.Open(context.Background(), "kafka://"+strings.Join(seeds, ",")+"?client_id=ferry-open-test")
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	topic := ferrytest.Open(t, ferrytest.Kafka).Queue(t, "open", ferrytest.Partitions(2)).Name
	roundTrip(t, b, topic, topic)
}

// SASL through the URL: the right password connects; a wrong one fails
// with an error that does not show it.
func TestOpenKafkaSASL(t *testing.T) {
	seeds, ca := testenv.RequireKafkaSASL(t)
	ctx := context.Background()
	base := "kafka://" + url.UserPassword(testenv.KafkaSCRAMUser, testenv.KafkaSCRAMPassword).String() + "@" + strings.Join(seeds, ",") + "?sasl=SCRAM-SHA-512&ca_file=" + url.QueryEscape(ca)
	b, err := ferry.Open(ctx, base)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	topic := ferrytest.Open(t, ferrytest.Kafka).Queue(t, "open-sasl").Name
	roundTrip(t, b, topic, topic)

	bad := strings.Replace(base, url.QueryEscape(testenv.KafkaSCRAMPassword), "wrong-secret-123", 1)
	bad = strings.Replace(bad, testenv.KafkaSCRAMPassword, "wrong-secret-123", 1)
	wb, err := ferry.Open(ctx, bad)
	if err == nil {
		pctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		err = wb.Publish(pctx, topic, consumer.Message{Body: []byte("x")})
		cancel()
		wb.Close()
	}
	if err == nil {
		t.Fatal("a wrong password published")
	}
	if strings.Contains(err.Error(), "wrong-secret-123") {
		t.Fatalf("the password shows in the error: %v", err)
	}
}

func TestOpenSQS(t *testing.T) {
	endpoint := testenv.RequireSQS(t)
	u, err := url.Parse(endpoint)
	if err != nil {
		t.Fatal(err)
	}
	raw := "sqs://" + url.UserPassword(testenv.SQSAccessKey, testenv.SQSSecretKey).String() + "@" + u.Host + "?tls=false&region=" + testenv.SQSRegion()
	b, err := ferry.Open(context.Background(), raw)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	queue := ferrytest.Open(t, ferrytest.SQS).Queue(t, "open").Name
	roundTrip(t, b, queue, queue)
}

func TestOpenRabbitMQ(t *testing.T) {
	amqpURL := testenv.RequireRabbitMQ(t)
	b, err := ferry.Open(context.Background(), amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	// A URL carries no topology: the queue is declared first, as a
	// service's own set-up would.
	q := ferrytest.Open(t, ferrytest.RabbitMQ).Queue(t, "open")
	roundTrip(t, b, q.Name, q.Name)
}

// TestOpenRabbitMQNodeList: a URL naming several nodes opens a Broker that
// reaches the first node that answers (here the first is a closed port).
func TestOpenRabbitMQNodeList(t *testing.T) {
	u, err := url.Parse(testenv.RequireRabbitMQ(t))
	if err != nil {
		t.Fatal(err)
	}
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := closed.Addr().String()
	closed.Close()
	u.Host = dead + "," + u.Host
	b, err := ferry.Open(context.Background(), u.String())
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	q := ferrytest.Open(t, ferrytest.RabbitMQ).Queue(t, "open-nodes")
	roundTrip(t, b, q.Name, q.Name)
}

// A URL that is wrong gets a *URLError naming the part that is wrong, and
// never shows its password.
func TestOpenRefusesBadURLsNamingThePart(t *testing.T) {
	cases := []struct{ url, part string }{
		{"", "URL"},
		{"nats://127.0.0.1:4222", "scheme"},
		{"kafka://", "host"},
		{"kafka://127.0.0.1", "host"},
		{"kafka://127.0.0.1:9092?acks=1", "query parameter acks"},
		{"kafka://127.0.0.1:9092?group_protocol=eager", "query parameter group_protocol"},
		{"kafka://127.0.0.1:9092?instance_id=pod%200", "query parameter instance_id"},
		{"kafka://127.0.0.1:9092?instance_id=", "query parameter instance_id"},
		{"kafka://127.0.0.1:9092?instance_id=pod-0&group_protocol=share", "URL"},
		{"kafka://u:s3cret@127.0.0.1:9092?sasl=GSSAPI", "query parameter sasl"},
		{"kafka://u:s3cret@127.0.0.1:9092", "user"},
		{"kafka://127.0.0.1:9092?ca_file=/nonexistent/ca.pem", "query parameter ca_file"},
		{"mem://?dedup_window=soon", "query parameter dedup_window"},
		{"mem://?dedup_window=-1s", "query"},
		{"mem://?autocreate=maybe", "query parameter autocreate"},
		{"mem://x/y", "path"},
		{"sqs://k:s3cret@127.0.0.1:9324?tls=maybe", "query parameter tls"},
		{"sqs://127.0.0.1:9324/q", "path"},
		{"amqp://guest:guest@127.0.0.1:5672/?ca_file=x.pem", "query parameter ca_file"},
		{"amqp://u:s3cret/with/slash@127.0.0.1:5672/", "user and password"},
		{"amqp://u:s3cret with space@127.0.0.1:5672/", "user and password"},
		{"127.0.0.1:9092", "scheme"},
		{"u:s3cret@127.0.0.1:9092", "scheme"},
		{"amqp://u:s3cret@127.0.0.1:notaport/", "URL"},
		{"kafka://127.0.0.1:9092?client_id=%zz", "query"},
		{"https://sqs.us-east-1.amazonaws.com/123456789012/q?region=eu-west-1", "query parameter region"},
	}
	for _, c := range cases {
		b, err := ferry.Open(context.Background(), c.url)
		if err == nil {
			b.Close()
			t.Errorf("Open(%q) succeeded", c.url)
			continue
		}
		var ue *ferry.URLError
		if !errors.As(err, &ue) || !errors.Is(err, ferry.ErrBadURL) || ue.Part != c.part {
			t.Errorf("Open(%q) = %v, want a URLError naming %q", c.url, err, c.part)
		}
		if strings.Contains(err.Error(), "s3cret") {
			t.Errorf("Open(%q): the password shows in %q", c.url, err)
		}
	}
}

// A URL without its scheme (a Kafka seed given as is) is told so, with
// the schemes Ferry opens, not that it "does not parse".
func TestOpenWithoutASchemeNamesTheSchemes(t *testing.T) {
	_, err := ferry.Open(context.Background(), "127.0.0.1:9092")
	var ue *ferry.URLError
	if !errors.As(err, &ue) || ue.Part != "scheme" || !strings.Contains(ue.Reason, "missing") {
		t.Fatalf("Open(127.0.0.1:9092) = %v, want a URLError saying the scheme is missing", err)
	}
	for _, s := range []string{"kafka://", "sqs://", "amqp://", "amqps://", "mem://", "https://sqs.REGION.amazonaws.com/ACCOUNT/QUEUE"} {
		if !strings.Contains(ue.Reason, s) {
			t.Errorf("%q does not name %s", ue.Reason, s)
		}
	}
	if strings.Contains(err.Error(), "parse") || strings.Contains(err.Error(), "escape") {
		t.Errorf("the error still speaks of parsing or escaping: %v", err)
	}
}

func TestRedactHidesPasswordsOfAnyShape(t *testing.T) {
	for _, s := range []string{
		"amqp://u:s3cret@host:5672/v",
		"amqps://u:s3/cr?et@host/v",
		"dial amqp://u:s3cret@host: refused",
		"kafka://u:s3cret@a:1,b:2?sasl=PLAIN",
	} {
		if got := ferry.Redact(s); strings.Contains(got, "s3") {
			t.Errorf("Redact(%q) = %q", s, got)
		}
	}
}

func memoryQueue() memory.QueueConfig { return memory.QueueConfig{} }
