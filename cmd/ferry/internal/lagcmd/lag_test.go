package lagcmd

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kadm"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/cmd/ferry/internal/cli"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
)

// ferryLag runs ferry lag in process, where it may open the in-process
// mem:// brokers the tests share (the command itself refuses mem://).
func ferryLag(t *testing.T, ctx context.Context, args ...string) (int, string, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := run(ctx, args, &out, &errOut, func(ctx context.Context, url string) (ferry.Broker, error) {
		if strings.HasPrefix(url, "mem://") {
			return ferry.Open(ctx, url)
		}
		return cli.Open(ctx, url)
	})
	return code, out.String(), errOut.String()
}

func reports(t *testing.T, out string) []Report {
	t.Helper()
	var rs []Report
	dec := json.NewDecoder(strings.NewReader(out))
	for dec.More() {
		var r Report
		if err := dec.Decode(&r); err != nil {
			t.Fatalf("output is not JSON reports: %v\n%s", err, out)
		}
		rs = append(rs, r)
	}
	return rs
}

func publish(t *testing.T, url, dest string, n int) {
	t.Helper()
	b, err := ferry.Open(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	var ms []consumer.Message
	for i := range n {
		ms = append(ms, consumer.Message{Key: fmt.Sprintf("k-%d", i), Body: []byte("x")})
	}
	if err := b.Publish(context.Background(), dest, ms...); err != nil {
		t.Fatal(err)
	}
}

// On Kafka, lag is per partition against the group's committed offsets,
// the backlog's age is that of the first record past them, and a group
// that does not move with records waiting is STOP (exit 1); nothing joins
// the group or moves its offsets. Once the group commits to the end, every
// lane is OK (exit 0).
func TestLagOnKafkaPerPartitionWithoutJoining(t *testing.T) {
	seeds := testenv.RequireKafka(t)
	kb, err := kafka.New(seeds)
	if err != nil {
		t.Fatal(err)
	}
	defer kb.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	topic, group := testenv.UniqueName(t, "lag"), testenv.UniqueName(t, "billing")
	if err := kb.CreateTopic(ctx, topic, kafka.TopicConfig{Partitions: 2}); err != nil {
		t.Fatal(err)
	}
	defer kb.DeleteTopic(context.Background(), topic)
	url := "kafka://" + strings.Join(seeds, ",")
	var ms []consumer.Message
	for i := range 10 {
		ms = append(ms, consumer.Message{Key: fmt.Sprintf("k-%d", i), Body: []byte("x")})
	}
	if err := kb.Publish(ctx, topic, ms...); err != nil {
		t.Fatal(err)
	}
	ends, err := kb.Admin().ListEndOffsets(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	end0, _ := ends.Lookup(topic, 0)
	end1, _ := ends.Lookup(topic, 1)
	if end0.Offset < 2 {
		t.Fatalf("partition 0 got %d records; the test needs 2", end0.Offset)
	}
	var o kadm.Offsets
	o.AddOffset(topic, 0, 1, -1)
	if _, err := kb.Admin().CommitOffsets(ctx, group, o); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1100 * time.Millisecond) // the first record past the commit is at least a second old

	code, out, errOut := ferryLag(t, ctx, topic, "--group", group, "--broker", url, "--samples", "2", "--interval", "100ms", "--json")
	if code != 1 {
		t.Fatalf("exit %d, want 1 (STOP): %s%s", code, out, errOut)
	}
	rs := reports(t, out)
	if len(rs) != 1 {
		t.Fatalf("want one report, got %d", len(rs))
	}
	r := rs[0]
	if r.Verdict != "STOP" || r.Lag != end0.Offset-1+end1.Offset || len(r.Lanes) != 2 {
		t.Errorf("report: %+v", r)
	}
	if r.Lanes[0].Lane != "0" || r.Lanes[0].Lag != end0.Offset-1 || r.Lanes[0].Position != 1 || r.Lanes[1].Lag != end1.Offset {
		t.Errorf("lanes: %+v", r.Lanes)
	}
	if r.OldestAge == nil || *r.OldestAge < 1 || *r.OldestAge > 60 {
		t.Errorf("backlog age %v, want the first waiting record's (over a second)", r.OldestAge)
	}
	g, err := kb.Admin().DescribeGroups(ctx, group)
	if err != nil {
		t.Fatal(err)
	}
	if len(g[group].Members) > 0 {
		t.Errorf("ferry lag joined the group: %v", g[group].Members)
	}

	o = kadm.Offsets{}
	o.AddOffset(topic, 0, end0.Offset, -1)
	o.AddOffset(topic, 1, end1.Offset, -1)
	if _, err := kb.Admin().CommitOffsets(ctx, group, o); err != nil {
		t.Fatal(err)
	}
	code, out, errOut = ferryLag(t, ctx, topic, "--group", group, "--broker", url, "--samples", "2", "--interval", "100ms")
	if code != 0 || !strings.Contains(out, "verdict OK") || !strings.Contains(out, "lag 0") {
		t.Errorf("caught up: exit %d\n%s%s", code, out, errOut)
	}
}

// On a partially consumed Kafka topic (10 of 20 records done and
// committed, the other 10 fetched by a running consumer and unfinished),
// ferry lag and the consumer's own Health say the same lag: the records
// taken and not done are counted once.
func TestLagOnKafkaAgreesWithTheConsumersHealth(t *testing.T) {
	seeds := testenv.RequireKafka(t)
	kb, err := kafka.New(seeds)
	if err != nil {
		t.Fatal(err)
	}
	defer kb.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	topic, group := testenv.UniqueName(t, "lag-health"), testenv.UniqueName(t, "billing")
	if err := kb.CreateTopic(ctx, topic, kafka.TopicConfig{Partitions: 1}); err != nil {
		t.Fatal(err)
	}
	defer kb.DeleteTopic(context.Background(), topic)
	var ms []consumer.Message
	for i := range 20 {
		ms = append(ms, consumer.Message{Key: "k", Body: fmt.Appendf(nil, "%d", i)})
	}
	if err := kb.Publish(ctx, topic, ms...); err != nil {
		t.Fatal(err)
	}
	l, err := kb.NewConsumer(ctx, topic, consumer.WithName(group), consumer.WithHealthWindow(200*time.Millisecond, 3),
		consumer.WithShutdownGrace(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- l.Run(runCtx, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			if m.Offset < 10 {
				return nil
			}
			<-ctx.Done() // the rest stay in flight
			return ctx.Err()
		}))
	}()
	defer func() { stop(); <-done }()
	for {
		os, err := kb.Admin().FetchOffsets(ctx, group)
		if err != nil {
			t.Fatal(err)
		}
		if o, ok := os.Lookup(topic, 0); ok && o.At == 10 && l.Stats().Fetched == 20 {
			break
		}
		if ctx.Err() != nil {
			t.Fatal("offset 10 was not committed with every record fetched")
		}
		time.Sleep(50 * time.Millisecond)
	}
	url := "kafka://" + strings.Join(seeds, ",")
	code, out, errOut := ferryLag(t, ctx, topic, "--group", group, "--broker", url, "--samples", "2", "--interval", "100ms", "--json")
	if code != 0 && code != 1 {
		t.Fatalf("exit %d: %s%s", code, out, errOut)
	}
	rs := reports(t, out)
	if len(rs) != 1 || rs[0].Lag != 10 {
		t.Fatalf("ferry lag: %s, want a lag of 10", out)
	}
	deadline := time.Now().Add(10 * time.Second)
	for l.Health().Lag != rs[0].Lag {
		if time.Now().After(deadline) {
			t.Fatalf("the consumer's Health says a lag of %d, ferry lag %d", l.Health().Lag, rs[0].Lag)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// On a share group (group_protocol=share), ferry lag says what the group's
// coordinator counts (the records not yet acknowledged) and what the
// members' Health says: with five of 30 records done and five held by a
// running member, 25, with the position at the end less the lag; it gives
// no backlog age (the broker tells none), and it joins nothing.
func TestLagOnAKafkaShareGroup(t *testing.T) {
	seeds := testenv.RequireKafka(t)
	url := "kafka://" + strings.Join(seeds, ",") + "?group_protocol=share"
	b, err := cli.Open(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	kb := b.(*kafka.Broker)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	topic, group := testenv.UniqueName(t, "lag-share"), testenv.UniqueName(t, "billing")
	if err := kb.CreateTopic(ctx, topic, kafka.TopicConfig{Partitions: 1}); err != nil {
		t.Fatal(err)
	}
	defer kb.DeleteTopic(context.Background(), topic)
	var ms []consumer.Message
	for range 30 {
		ms = append(ms, consumer.Message{Body: []byte("x")})
	}
	if err := kb.Publish(ctx, topic, ms...); err != nil {
		t.Fatal(err)
	}
	l, err := kb.NewConsumer(ctx, topic, consumer.WithName(group), consumer.WithMaxInFlight(10), consumer.WithConcurrency(10),
		consumer.WithHealthWindow(200*time.Millisecond, 3), consumer.WithShutdownGrace(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	var held atomic.Int32
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- l.Run(runCtx, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			if m.Offset < 5 {
				return nil
			}
			held.Add(1)
			<-ctx.Done() // the rest of the poll stays held
			return ctx.Err()
		}))
	}()
	defer func() { stop(); <-done }()
	for held.Load() < 5 || l.Health().Lag != 25 {
		if ctx.Err() != nil {
			t.Fatalf("the consumer holds %d records and its Health says a lag of %d; want 5 and 25", held.Load(), l.Health().Lag)
		}
		time.Sleep(50 * time.Millisecond)
	}
	code, out, errOut := ferryLag(t, ctx, topic, "--group", group, "--broker", url, "--samples", "2", "--interval", "100ms", "--json")
	if code != 0 && code != 1 {
		t.Fatalf("exit %d: %s%s", code, out, errOut)
	}
	rs := reports(t, out)
	if len(rs) != 1 || rs[0].Lag != 25 || len(rs[0].Lanes) != 1 {
		t.Fatalf("ferry lag: %s, want a lag of 25 on one lane", out)
	}
	if r := rs[0]; r.OldestAge != nil {
		t.Errorf("backlog age %v s; the broker tells none for a share group (the log's first record is not the oldest waiting)", *r.OldestAge)
	}
	if r := rs[0]; r.Lanes[0].Position != 5 {
		t.Errorf("position %d, want 5: the end offset less the lag", r.Lanes[0].Position)
	}
	sg, err := kb.Admin().DescribeShareGroups(ctx, group)
	if err != nil {
		t.Fatal(err)
	}
	// One consumer is one to four members (its sessions: a second joins
	// while the first holds records); ferry lag joins as none.
	if n := len(sg[group].Members); n < 1 || n > 4 {
		t.Errorf("the share group has %d members during ferry lag, want the one consumer's 1 to 4", n)
	}
}

// A queue's lag is its depth, one lane; nobody taking messages while the
// depth holds is STOP. On SQS and RabbitMQ, nothing is received.
func TestLagOnQueues(t *testing.T) {
	for _, tc := range []struct {
		name string
		make func(t *testing.T) (url, queue string)
	}{
		{"memory", func(t *testing.T) (string, string) { return "mem://" + testenv.UniqueName(t, ""), "orders" }},
		{"sqs", sqsQueue},
		{"rabbitmq", rabbitQueue},
	} {
		t.Run(tc.name, func(t *testing.T) {
			url, queue := tc.make(t)
			keep, err := ferry.Open(context.Background(), url) // keeps a mem:// broker alive
			if err != nil {
				t.Fatal(err)
			}
			defer keep.Close()
			publish(t, url, queue, 4)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			code, out, errOut := ferryLag(t, ctx, queue, "--broker", url, "--samples", "3", "--interval", "100ms", "--json")
			if code != 1 {
				t.Fatalf("exit %d, want 1: %s%s", code, out, errOut)
			}
			r := reports(t, out)[0]
			if r.Lag != 4 || r.Verdict != "STOP" || len(r.Lanes) != 1 || r.Samples != 3 {
				t.Errorf("report: %+v", r)
			}
			if tc.name == "memory" && (r.OldestAge == nil || *r.OldestAge <= 0) {
				t.Errorf("the memory broker tells the oldest message's age: %v", r.OldestAge)
			}
			if tc.name == "rabbitmq" && r.InFlight != -1 {
				t.Errorf("in flight %d, want unknown", r.InFlight)
			}
		})
	}
}

func sqsQueue(t *testing.T) (string, string) {
	endpoint := testenv.RequireSQS(t)
	u, _ := url.Parse(endpoint)
	c := awssqs.New(awssqs.Options{Region: testenv.SQSRegion(), BaseEndpoint: aws.String(endpoint),
		Credentials: credentials.NewStaticCredentialsProvider(testenv.SQSAccessKey, testenv.SQSSecretKey, "")})
	q := testenv.UniqueName(t, "lag")
	out, err := c.CreateQueue(context.Background(), &awssqs.CreateQueueInput{QueueName: aws.String(q)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.DeleteQueue(context.Background(), &awssqs.DeleteQueueInput{QueueUrl: out.QueueUrl}) })
	return fmt.Sprintf("sqs://%s:%s@%s?region=%s&tls=false", testenv.SQSAccessKey, testenv.SQSSecretKey, u.Host, testenv.SQSRegion()), q
}

func rabbitQueue(t *testing.T) (string, string) {
	amqpURL := testenv.RequireRabbitMQ(t)
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	q := testenv.UniqueName(t, "lag")
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(q, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ch.QueueDelete(q, false, false, false)
		conn.Close()
	})
	return amqpURL, q
}

// --watch prints a report after every sample until interrupted, judging
// the samples of its window, and then exits 0; a queue drained meanwhile
// is OK.
func TestLagWatch(t *testing.T) {
	url := "mem://" + testenv.UniqueName(t, "")
	b, err := ferry.Open(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	publish(t, url, "orders", 3)
	mb, _ := ferry.Memory(b)
	ctx, cancel := context.WithCancel(context.Background())
	l, err := mb.NewConsumer(ctx, "orders")
	if err != nil {
		t.Fatal(err)
	}
	time.AfterFunc(250*time.Millisecond, func() {
		go l.Run(ctx, consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }))
	})
	time.AfterFunc(1200*time.Millisecond, cancel)
	code, out, errOut := ferryLag(t, ctx, "orders", "--broker", url, "--watch", "--interval", "100ms", "--samples", "3", "--json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	rs := reports(t, out)
	if len(rs) < 5 {
		t.Fatalf("want a report per sample, got %d", len(rs))
	}
	if rs[0].Samples != 1 || rs[len(rs)-1].Samples != 3 {
		t.Errorf("window sizes %d .. %d, want 1 .. 3", rs[0].Samples, rs[len(rs)-1].Samples)
	}
	if last := rs[len(rs)-1]; last.Lag != 0 || last.Verdict != "OK" {
		t.Errorf("after the drain: %+v", last)
	}
}

// The report's verdict is the worst lane's.
func TestJudgeTakesTheWorstLane(t *testing.T) {
	at := time.Now()
	s := func(d time.Duration, lag0, pos0, lag1, pos1 int64) Sample {
		return Sample{At: at.Add(d), Lanes: map[string]int64{"0": lag0, "1": lag1}, Positions: map[string]int64{"0": pos0, "1": pos1}}
	}
	r := Judge("t", "g", "kafka", []Sample{s(0, 5, 10, 5, 10), s(time.Second, 3, 12, 7, 11), s(2*time.Second, 2, 13, 9, 12)})
	if r.Verdict != "WARN" || r.Lanes[0].Verdict != "OK" || r.Lanes[1].Verdict != "WARN" || r.Lag != 11 || r.Bad() {
		t.Errorf("%+v", r)
	}
	r = Judge("t", "g", "kafka", []Sample{s(0, 5, 10, 5, 10), s(time.Second, 5, 10, 7, 8)})
	if r.Verdict != "STOP" || r.Lanes[1].Verdict != "REWIND" || !r.Bad() {
		t.Errorf("%+v", r)
	}
}

// A usage error prints the error and one line naming ferry help lag, not
// the whole help.
func TestLagBadUsageExitsTwo(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "want one SOURCE"},
		{[]string{"orders"}, "--broker URL is required"},
		{[]string{"orders", "--broker", "kafka://127.0.0.1:9092", "--samples", "1"}, "--samples"},
		{[]string{"orders", "--broker", "kafka://127.0.0.1:9092"}, "--group NAME is required"},
		{[]string{"orders", "--broker", "kafka://127.0.0.1:9092", "--bogus"}, "flag provided but not defined: -bogus"},
		// A new process's in-process broker is empty: no lag to read.
		{[]string{"orders", "--broker", "mem://x"}, "mem:// is the in-process broker: a new ferry process has its own, empty one"},
	} {
		var out, errOut bytes.Buffer
		code := Run(context.Background(), tc.args, &out, &errOut)
		lines := strings.Split(strings.TrimSpace(errOut.String()), "\n")
		if code != 2 || !strings.Contains(lines[0], tc.want) || len(lines) != 2 || lines[1] != "run 'ferry help lag' for its usage and flags" {
			t.Errorf("%v: exit %d, stderr %q; want 2, %q and the line naming the help", tc.args, code, errOut.String(), tc.want)
		}
	}
	if code, _, errOut := ferryLag(t, context.Background(), "--help"); code != 0 || !strings.Contains(errOut, "Burrow") || !strings.Contains(errOut, "-broker") {
		t.Errorf("--help: exit %d, %q", code, errOut)
	}
}

// On SQS, the lag the consumer's /healthz shows, its ferry.consumer.lag
// metric and ferry lag are one number, on a queue with messages both
// waiting and in flight: the messages not yet done (visible, delayed and
// in flight), those in flight also told apart (ferry lag's in flight).
func TestLagIsOneNumberOnSQS(t *testing.T) {
	url, queue := sqsQueue(t)
	publish(t, url, queue, 10)
	b, err := ferry.Open(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	const held = 3
	l, err := b.NewConsumer(context.Background(), queue, consumer.WithName("billing"), consumer.WithConcurrency(held),
		consumer.WithMaxInFlight(held), consumer.WithHealthWindow(100*time.Millisecond, 3), consumer.WithMeterProvider(mp))
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	var running atomic.Int32
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- l.Run(ctx, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			running.Add(1)
			select {
			case <-release:
			case <-ctx.Done():
			}
			return nil
		}))
	}()
	defer func() {
		close(release)
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run = %v", err)
		}
	}()
	deadline := time.Now().Add(30 * time.Second)
	for running.Load() < held || l.Health().Samples < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("%d handlers running, health %+v; want %d holding their messages", running.Load(), l.Health(), held)
		}
		time.Sleep(20 * time.Millisecond)
	}

	rec := httptest.NewRecorder()
	consumer.ReadinessHandler(l).ServeHTTP(rec, httptest.NewRequest("GET", "/healthz", nil))
	var healthz struct {
		Consumers []consumer.Health `json:"consumers"`
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &healthz); err != nil || len(healthz.Consumers) != 1 {
		t.Fatalf("/healthz %s: %v", rec.Body, err)
	}

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	metricLag := int64(-1)
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if g, ok := m.Data.(metricdata.Gauge[int64]); ok && m.Name == consumer.MetricLag {
				metricLag = g.DataPoints[0].Value
			}
		}
	}

	lctx, lcancel := context.WithTimeout(context.Background(), time.Minute)
	defer lcancel()
	code, out, errOut := ferryLag(t, lctx, queue, "--broker", url, "--samples", "2", "--interval", "100ms", "--json")
	if code != 0 && code != 1 {
		t.Fatalf("ferry lag exit %d: %s%s", code, out, errOut)
	}
	r := reports(t, out)[0]

	const want = 10
	if got := healthz.Consumers[0].Lag; got != want || metricLag != want || r.Lag != want {
		t.Errorf("lag: /healthz %d, %s %d, ferry lag %d; want all %d (the messages not yet done: %d waiting, %d in flight)",
			got, consumer.MetricLag, metricLag, r.Lag, want, 10-held, held)
	}
	if r.InFlight != held {
		t.Errorf("ferry lag: in flight %d, want the %d held by the consumer", r.InFlight, held)
	}
}
