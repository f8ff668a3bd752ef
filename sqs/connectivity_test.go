package sqs_test

import (
	"context"
	"errors"
	"log/slog"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
	ferrysqs "github.com/ferrymq/ferry/sqs"
)

// What an operator sees when a consumer cannot consume (issue 25): the
// consumer's Health (state and error), a WARN line within 10 s naming the
// queue and the endpoint, and Stats.FetchErrors. ElasticMQ is shared and
// never restarted here: an endpoint that is down is a port nobody listens
// on, and a connection lost mid-run is a TCP proxy between the client and
// ElasticMQ that the test cuts and restores.

// testSecret is the secret key of the clients these tests build: ElasticMQ
// checks none, and the tests check that it shows nowhere.
const testSecret = "ferry-test-secret-never-logged-7Hq2"

// clientAt returns a client of the SQS endpoint at addr (host:port),
// signing with testSecret.
func clientAt(t testing.TB, addr string) *awssqs.Client {
	t.Helper()
	return newClient(t, nil, func(o *awssqs.Options) {
		o.BaseEndpoint = aws.String("http://" + addr)
		o.Credentials = credentials.NewStaticCredentialsProvider(testenv.SQSAccessKey, testSecret, "")
	})
}

// sqsAddr is ElasticMQ's host:port.
func sqsAddr(t testing.TB) string {
	t.Helper()
	u, err := url.Parse(testenv.RequireSQS(t))
	if err != nil {
		t.Fatal(err)
	}
	return u.Host
}

// watched is a consumer under test, with what its operator would see.
type watched struct {
	l       *consumer.Loop
	logs    *records
	handled atomic.Int64
}

// watch builds a consumer of queue on b that logs to a records handler,
// samples its health every 100 ms and retries fetches within a second, and
// runs it with a handler that counts its messages.
func watch(t *testing.T, b *ferrysqs.Broker, queue string) *watched {
	t.Helper()
	w := &watched{logs: &records{}}
	l, err := b.NewConsumer(context.Background(), queue, consumer.WithLogger(w.logs.logger()),
		consumer.WithHealthWindow(100*time.Millisecond, 5), consumer.WithFetchBackoff(time.Second))
	if err != nil {
		t.Fatalf("NewConsumer of %q = %v, want a consumer: the constructor makes no call to SQS", queue, err)
	}
	w.l = l
	start(t, l, consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		w.handled.Add(1)
		return nil
	}))
	return w
}

// disconnected waits up to within for the consumer's health to be
// disconnected with an error holding each of want, and returns it.
func (w *watched) disconnected(t *testing.T, within time.Duration, want ...string) consumer.Health {
	t.Helper()
	var h consumer.Health
	deadline := time.Now().Add(within)
	for {
		h = w.l.Health()
		ok := h.State == consumer.HealthDisconnected
		for _, s := range want {
			ok = ok && strings.Contains(h.Error, s)
		}
		if ok {
			return h
		}
		if time.Now().After(deadline) {
			t.Fatalf("health after %s: %s (%s), error %q; want disconnected with an error naming %q", within, h.State, h.Reason, h.Error, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// warned waits up to within for the WARN line of a consumer that cannot
// consume, naming the queue as its source and, in its error, each of want.
func (w *watched) warned(t *testing.T, within time.Duration, queue string, want ...string) record {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		for _, r := range w.logs.find(slog.LevelWarn, "cannot consume") {
			ok := r.attrs["source"] == queue
			for _, s := range want {
				ok = ok && strings.Contains(r.attrs["err"], s)
			}
			if ok {
				return r
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no WARN naming %s and %q within %s; WARN lines: %v", queue, want, within, w.logs.find(slog.LevelWarn, ""))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// consumes publishes a message to url through c and waits for the
// consumer to handle it and to be connected; again says that it was
// disconnected before, and must have said that it consumes again.
func (w *watched) consumes(t *testing.T, c *awssqs.Client, url string, within time.Duration, again bool) {
	t.Helper()
	before := w.handled.Load()
	if _, err := c.SendMessage(context.Background(), &awssqs.SendMessageInput{QueueUrl: aws.String(url), MessageBody: aws.String("m")}); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, within, "the message to be handled", func() bool { return w.handled.Load() > before })
	testenv.WaitFor(t, 5*time.Second, "health to leave disconnected", func() bool {
		h := w.l.Health()
		return h.State != consumer.HealthDisconnected && h.State != consumer.HealthStarting && h.Error == ""
	})
	if again && len(w.logs.find(slog.LevelInfo, "consuming again")) == 0 {
		t.Errorf("no INFO line saying the consumer consumes again")
	}
}

// noSecret fails the test when testSecret shows in a log line or in the
// health.
func (w *watched) noSecret(t *testing.T) {
	t.Helper()
	if w.logs.contains(testSecret) || strings.Contains(w.l.Health().Error, testSecret) {
		t.Error("the client's secret key shows in a log line or in the health")
	}
}

// TestConsumerOfAMissingQueueWaitsForIt: a consumer of a queue that does
// not exist yet is built without a call to SQS; Run says that the source
// does not exist (health disconnected with an error wrapping
// consumer.ErrSourceNotFound, a WARN naming the queue and the endpoint,
// fetch errors counted) and retries, and once the queue is created it
// consumes by itself.
func TestConsumerOfAMissingQueueWaitsForIt(t *testing.T) {
	addr := sqsAddr(t)
	c := clientAt(t, addr)
	b := newBroker(t, c)
	name := testenv.UniqueName(t, "later")

	// The driver's error: not fatal, the queue and the endpoint named,
	// SQS's typed error inside.
	d, err := b.Driver(context.Background(), name, driver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	err = d.(driver.Connector).Connect(context.Background())
	var noQueue *types.QueueDoesNotExist
	if !errors.Is(err, consumer.ErrSourceNotFound) || driver.IsFatal(err) || !errors.As(err, &noQueue) ||
		!strings.Contains(err.Error(), name) || !strings.Contains(err.Error(), addr) {
		t.Errorf("Connect to a missing queue = %v; want a retried error wrapping consumer.ErrSourceNotFound and *types.QueueDoesNotExist, naming %s and %s", err, name, addr)
	}
	d.Close()

	w := watch(t, b, name)
	began := time.Now()
	h := w.disconnected(t, 10*time.Second, name, consumer.ErrSourceNotFound.Error())
	if h.Source != name || !h.Live || h.Ready {
		t.Errorf("health %+v: want the queue as source, not ready and still live", h)
	}
	w.warned(t, 10*time.Second-time.Since(began), name, addr, consumer.ErrSourceNotFound.Error())
	testenv.WaitFor(t, 10*time.Second, "a retried fetch", func() bool { return w.l.Stats().FetchErrors >= 2 })

	_, url := createNamedQueue(t, newClient(t, nil), name, queueConfig{})
	w.consumes(t, c, url, 20*time.Second, true)
	w.noSecret(t)
}

// TestConsumerBuiltWhileSQSIsDownConsumesOnceItIsUp: with nothing
// listening at the endpoint, the constructor succeeds, Connect fails
// within driver.ReportWithin with an error wrapping consumer.ErrUnreachable
// that names the address, Run says so and retries, and once the endpoint
// answers (here: a proxy to ElasticMQ starts listening there) the consumer
// consumes by itself.
func TestConsumerBuiltWhileSQSIsDownConsumesOnceItIsUp(t *testing.T) {
	admin := newClient(t, nil)
	name, url := createQueue(t, admin, "down", queueConfig{})
	addr := freeAddr(t)
	c := clientAt(t, addr)
	b := newBroker(t, c)

	d, err := b.Driver(context.Background(), name, driver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	err = d.(driver.Connector).Connect(context.Background())
	took := time.Since(began)
	if !errors.Is(err, consumer.ErrUnreachable) || driver.IsFatal(err) || !strings.Contains(err.Error(), addr) || !strings.Contains(err.Error(), name) {
		t.Errorf("Connect to an endpoint that is down = %v; want a retried error wrapping consumer.ErrUnreachable naming %s and %s", err, name, addr)
	}
	if took > driver.ReportWithin+time.Second {
		t.Errorf("Connect took %s to fail, want within driver.ReportWithin (%s)", took, driver.ReportWithin)
	}
	d.Close()

	w := watch(t, b, name)
	began = time.Now()
	w.disconnected(t, 10*time.Second, addr, consumer.ErrUnreachable.Error())
	w.warned(t, 10*time.Second-time.Since(began), name, addr, consumer.ErrUnreachable.Error())
	testenv.WaitFor(t, 15*time.Second, "a retried fetch", func() bool { return w.l.Stats().FetchErrors >= 2 })

	newTCPProxy(t, addr, sqsAddr(t))
	w.consumes(t, admin, url, 20*time.Second, true)
	w.noSecret(t)
}

// TestConnectionLostMidRunIsReportedAndHealed: a consuming consumer whose
// connection to SQS is lost says so within driver.ReportWithin (health
// disconnected with an error wrapping consumer.ErrUnreachable, a WARN
// naming the queue and the endpoint, fetch errors counted) and consumes
// again by itself once the network is back; both when connections are
// refused and when they go silent (no answer at all, where only the
// receive's own deadline can tell).
func TestConnectionLostMidRunIsReportedAndHealed(t *testing.T) {
	for _, tc := range []struct {
		name string
		cut  func(*tcpProxy)
	}{
		{"refused", (*tcpProxy).refuse},
		{"silent", (*tcpProxy).silence},
	} {
		t.Run(tc.name, func(t *testing.T) {
			admin := newClient(t, nil)
			name, url := createQueue(t, admin, "lost-"+tc.name, queueConfig{})
			p := newTCPProxy(t, "", sqsAddr(t))
			b := newBroker(t, clientAt(t, p.addr))
			w := watch(t, b, name)
			w.consumes(t, admin, url, 20*time.Second, false)
			time.Sleep(500 * time.Millisecond) // a long poll is open now

			tc.cut(p)
			cut := time.Now()
			w.disconnected(t, driver.ReportWithin+time.Second, p.addr, consumer.ErrUnreachable.Error())
			t.Logf("disconnected %s after the cut", time.Since(cut).Round(time.Millisecond))
			w.warned(t, 10*time.Second-time.Since(cut), name, p.addr, consumer.ErrUnreachable.Error())
			if n := w.l.Stats().FetchErrors; n < 1 {
				t.Errorf("FetchErrors = %d after the cut", n)
			}

			p.restore()
			w.consumes(t, admin, url, 20*time.Second, true)
			w.noSecret(t)
		})
	}
}

// TestMissingDeadLetterQueueShowsInHealth: with the Standard stack
// dead-lettering to a queue that does not exist, a poison message cannot
// be dead-lettered: the consumer's health says "dead-letter failing", the
// DeadLetter middleware logs the failed publish naming the destination,
// and the message stays in its queue (nothing is acked).
func TestMissingDeadLetterQueueShowsInHealth(t *testing.T) {
	c := newClient(t, nil)
	b := newBroker(t, c)
	name, url := createQueue(t, c, "dlq-missing", queueConfig{visibility: 30 * time.Second})
	dlq := testenv.UniqueName(t, "no-such-dlq")
	dlLogs := &records{}
	stack, err := consumer.Standard(b, dlq, consumer.StandardDeadLetter(consumer.DeadLetterLogger(dlLogs.logger())))
	if err != nil {
		t.Fatal(err)
	}
	l, err := b.NewConsumer(context.Background(), name, consumer.WithHealthWindow(100*time.Millisecond, 5),
		consumer.WithRedeliveryBackoff(time.Second, time.Second), consumer.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Publish(context.Background(), name, consumer.Message{Body: []byte("poison")}); err != nil {
		t.Fatal(err)
	}
	start(t, l, stack.Wrap(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		return consumer.Permanent(errors.New("cannot be parsed"))
	})))
	var h consumer.Health
	testenv.WaitFor(t, 20*time.Second, "health dead-letter failing", func() bool {
		h = l.Health()
		return h.State == consumer.HealthDeadLetterFailing
	})
	if h.Ready || !h.Live {
		t.Errorf("health %+v: want not ready, still live", h)
	}
	failed := dlLogs.find(slog.LevelError, "dead-letter publish failed")
	if len(failed) == 0 {
		t.Fatalf("no log line of the failed dead-letter publish; lines: %v", dlLogs.find(slog.LevelWarn, ""))
	}
	if r := failed[0]; r.attrs["destination"] != dlq || !strings.Contains(r.attrs["error"], dlq) {
		t.Errorf("the failed publish's line %v does not name the destination %s", r, dlq)
	}
	if visible, inflight, _ := depth(t, c, url); visible+inflight != 1 {
		t.Errorf("the queue holds %d visible and %d in flight, want the poison message still there", visible, inflight)
	}
}
