package rabbit_test

import (
	"context"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/rabbit"
)

// dropWarning starts the warning a Broker logs for a consumed quorum queue
// that drops what passes its delivery limit.
const dropWarning = "rabbit: quorum queue has no dead-letter exchange"

// recorder is a slog.Handler that keeps every record with the attributes
// of its logger (With) and its own, and writes it to the test's output.
type recorder struct {
	mu    *sync.Mutex
	recs  *[]recorded
	attrs []slog.Attr
	out   slog.Handler
}

type recorded struct {
	msg   string
	attrs []slog.Attr
}

func newRecorder(t *testing.T) *recorder {
	return &recorder{mu: new(sync.Mutex), recs: new([]recorded),
		out: slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug})}
}

func (r *recorder) Enabled(context.Context, slog.Level) bool { return true }

func (r *recorder) Handle(ctx context.Context, rec slog.Record) error {
	attrs := append([]slog.Attr(nil), r.attrs...)
	rec.Attrs(func(a slog.Attr) bool { attrs = append(attrs, a); return true })
	r.mu.Lock()
	*r.recs = append(*r.recs, recorded{msg: rec.Message, attrs: attrs})
	r.mu.Unlock()
	return r.out.Handle(ctx, rec)
}

func (r *recorder) WithAttrs(as []slog.Attr) slog.Handler {
	c := *r
	c.attrs = append(append([]slog.Attr(nil), r.attrs...), as...)
	c.out = r.out.WithAttrs(as)
	return &c
}

func (r *recorder) WithGroup(name string) slog.Handler {
	c := *r
	c.out = r.out.WithGroup(name)
	return &c
}

// matching returns the records whose message starts with prefix.
func (r *recorder) matching(prefix string) []recorded {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []recorded
	for _, rec := range *r.recs {
		if strings.HasPrefix(rec.msg, prefix) {
			out = append(out, rec)
		}
	}
	return out
}

// values returns the values of every attribute named key.
func (rec recorded) values(key string) []string {
	var vs []string
	for _, a := range rec.attrs {
		if a.Key == key {
			vs = append(vs, a.Value.String())
		}
	}
	return vs
}

// serverVersion is the version the broker announces.
func serverVersion(t *testing.T) string {
	t.Helper()
	conn, err := amqp.DialConfig(amqpURL(t), amqp.Config{Dial: amqp.DefaultDial(5 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.CloseDeadline(time.Now().Add(time.Second))
	v, _ := conn.Properties["version"].(string)
	return v
}

// TestDropWarningOncePerConsumedQueueWithALimit: the Broker warns that a
// quorum queue drops messages once per queue, with the queue named once,
// and only for a queue it consumes that has a delivery limit and no
// dead-letter exchange: not again for a second consumer of it or after the
// queue was declared again under them, not for a queue with a dead-letter
// exchange, not for a queue it only publishes to (a dead-letter queue), and
// for a queue without a limit only where the broker sets one by default
// (RabbitMQ 4).
func TestDropWarningOncePerConsumedQueueWithALimit(t *testing.T) {
	version := serverVersion(t)
	limited := testenv.UniqueName(t, "warn-limited")
	withDLX := testenv.UniqueName(t, "warn-dlx")
	plain := testenv.UniqueName(t, "warn-plain")
	dlq := testenv.UniqueName(t, "warn-dlq")
	deleteLater(t, []string{limited, withDLX, plain, dlq}, nil)
	rec := newRecorder(t)
	b := dial(t, rabbit.WithLogger(slog.New(rec)), rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{
		{Name: limited, DeliveryLimit: 5},
		{Name: withDLX, DeliveryLimit: 5, DeadLetterRoutingKey: dlq}, // through the default exchange
		{Name: plain},
		{Name: dlq, DeliveryLimit: 5},
	}}))

	var got seen
	handler := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		got.add(string(m.Body))
		return nil
	})
	var stops []func() error
	for _, q := range []string{limited, limited, withDLX, plain} {
		c, err := b.NewConsumer(t.Context(), q, consumer.WithFetchBackoff(200*time.Millisecond))
		must(t, err)
		stops = append(stops, runLoop(t, c, handler))
	}
	publish := func(queue, body string) {
		t.Helper()
		must(t, b.Publish(testenv.Context(t, 10*time.Second), queue, consumer.Message{Body: []byte(body)}))
	}
	for _, q := range []string{limited, withDLX, plain} {
		publish(q, q+"/1")
	}
	publish(dlq, "dead")
	for _, q := range []string{limited, withDLX, plain} {
		testenv.WaitFor(t, 20*time.Second, "a message of "+q, func() bool { return got.has(q + "/1") })
	}

	// Deleted under its consumers, the queue is declared again when they
	// open their channels again: no second warning.
	ch := rawChannel(t)
	_, err := ch.QueueDelete(limited, false, false, false)
	must(t, err)
	testenv.WaitFor(t, 30*time.Second, "the consumers to declare "+limited+" again", func() bool {
		conn, err := amqp.DialConfig(amqpURL(t), amqp.Config{Dial: amqp.DefaultDial(5 * time.Second)})
		if err != nil {
			return false
		}
		defer conn.CloseDeadline(time.Now().Add(time.Second))
		pch, err := conn.Channel()
		if err != nil {
			return false
		}
		_, err = pch.QueueDeclarePassive(limited, true, false, false, false, amqp.Table{"x-queue-type": "quorum", "x-delivery-limit": int64(5)})
		return err == nil
	})
	// A quorum queue just declared again can nack a first publish while
	// it elects its leader: publish until the broker takes it.
	testenv.WaitFor(t, 30*time.Second, "the broker to take a publish to "+limited+" again", func() bool {
		return b.Publish(testenv.Context(t, 10*time.Second), limited, consumer.Message{Body: []byte(limited + "/2")}) == nil
	})
	testenv.WaitFor(t, 30*time.Second, "a message of "+limited+" after it came back", func() bool { return got.has(limited + "/2") })
	for _, stop := range stops {
		must(t, stop())
	}

	warnings := rec.matching(dropWarning)
	count := map[string]int{}
	for _, w := range warnings {
		qs := w.values("queue")
		if len(qs) != 1 {
			t.Errorf("a warning names %d queues (%v), want one queue attribute", len(qs), qs)
			continue
		}
		count[qs[0]]++
	}
	wantPlain := 0
	if major, _, _ := strings.Cut(version, "."); major >= "4" && len(major) == 1 {
		wantPlain = 1 // RabbitMQ 4 limits deliveries to 20 by default
	}
	for q, want := range map[string]int{limited: 1, withDLX: 0, plain: wantPlain, dlq: 0} {
		if count[q] != want {
			t.Errorf("RabbitMQ %s: %d warnings for %s, want %d", version, count[q], q, want)
		}
	}
	if len(warnings) != 1+wantPlain {
		t.Errorf("%d drop warnings in all, want %d", len(warnings), 1+wantPlain)
	}
}

// TestSuiteRunsOnTheVersionItWants: with FERRY_RABBITMQ_VERSION set (make
// test-rabbit4 sets 4.0), the broker under test announces that version, so
// a run meant for RabbitMQ 4.0 cannot pass against the 3.10 node because an
// address was lost on the way.
func TestSuiteRunsOnTheVersionItWants(t *testing.T) {
	want := os.Getenv("FERRY_RABBITMQ_VERSION")
	if want == "" {
		t.Skip("FERRY_RABBITMQ_VERSION is not set: any version will do")
	}
	if got := serverVersion(t); got != want && !strings.HasPrefix(got, want+".") {
		t.Fatalf("the broker at %s is RabbitMQ %s, want %s", rabbit.Redact(amqpURL(t)), got, want)
	}
}
