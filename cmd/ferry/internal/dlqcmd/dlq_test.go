package dlqcmd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/memory"
	"github.com/ferrymq/ferry/rabbit"
)

// peek shows every dead-lettered message with its story, as a table and as
// JSON, and leaves them all where they were: a second peek sees them
// again, and the destination holds as many as before.
func TestPeekShowsTheStoryWithoutConsuming(t *testing.T) {
	for _, bk := range brokers {
		t.Run(bk.name, func(t *testing.T) {
			f := bk.make(t)
			const n = 6
			f.seed(t, n)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			for round := range 2 {
				code, out, errOut := ferryDLQ(t, ctx, "peek", f.dlq, "--json", "--broker", f.url, "--wait", "1s")
				if code != 0 {
					t.Fatalf("peek exited %d: %s", code, errOut)
				}
				var stories []Story
				if err := json.Unmarshal([]byte(out), &stories); err != nil {
					t.Fatalf("peek --json printed %q: %v", out, err)
				}
				if len(stories) != n {
					t.Fatalf("round %d: peek showed %d messages, want %d", round, len(stories), n)
				}
				for _, s := range stories {
					id := string(s.Body)
					if s.Source != f.src || s.MessageID != id || s.Attempts != 10 || s.Deliveries != 11 || s.Unseen != 1 ||
						s.Key != "k-"+id || s.LastFailure == nil || s.FirstFailure == nil || s.Consumer != "billing" || s.Headers["x-tenant"] != "acme" {
						t.Errorf("story of %s is incomplete: %+v", id, s)
					}
					if (s.Reason == "permanent") != strings.Contains(s.Error, "invalid JSON") {
						t.Errorf("story of %s: reason %q with error %q", id, s.Reason, s.Error)
					}
					if _, ok := s.Headers[consumer.HeaderDLQReason]; ok {
						t.Errorf("story of %s repeats the ferry-dlq-* headers in Headers", id)
					}
				}
				// SQS: a long poll cut when the peek ended may hide a
				// message for a few seconds more.
				testenv.WaitFor(t, 10*time.Second, "the peeked messages back in the destination", func() bool { return f.inDLQ(t) == n })
			}
			code, out, errOut := ferryDLQ(t, ctx, "peek", f.dlq, "--broker", f.url, "--wait", "1s", "--limit", "4")
			if code != 0 {
				t.Fatalf("peek exited %d: %s", code, errOut)
			}
			lines := strings.Split(strings.TrimSpace(out), "\n")
			if f.kafka {
				// The first line says where the read began.
				if !strings.HasPrefix(lines[0], "reading "+f.dlq+" from the log start") {
					t.Errorf("peek on Kafka does not say where it reads:\n%s", out)
				}
				lines = lines[1:]
			}
			if len(lines) != 6 || !strings.Contains(lines[0], "LAST ERROR") || !strings.Contains(out, "invalid JSON") || !strings.Contains(out, "max-attempts") {
				t.Errorf("the table of 4 messages is not one:\n%s", out)
			}
			// How many of how many: SQS counts approximately.
			of := "4 of 6 messages in " + f.dlq + " (--limit 4)"
			if bk.name == "sqs" {
				of = "4 of about 6 messages in " + f.dlq + " (--limit 4)"
			}
			if last := lines[len(lines)-1]; last != of {
				t.Errorf("the last line is %q, want %q", last, of)
			}
			testenv.WaitFor(t, 10*time.Second, "the peeked messages back in the destination", func() bool { return f.inDLQ(t) == n })
		})
	}
}

// A message that DeadLetter moved away is shown with the story it wrote:
// peek over the memory broker after a real Standard stack gave up on it.
func TestPeekTellsWhatDeadLetterWrote(t *testing.T) {
	f := memoryFixture(t)
	mb, _ := memoryOf(f)
	if err := mb.Publish(context.Background(), "orders", consumer.Message{ID: "o-1", Key: "c-1", Body: []byte("{")}); err != nil {
		t.Fatal(err)
	}
	stack, err := consumer.Standard(mb, "orders-dlq")
	if err != nil {
		t.Fatal(err)
	}
	l, err := mb.NewConsumer(t.Context(), "orders", consumer.WithName("billing"))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- l.Run(ctx, stack.Wrap(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
			return consumer.Permanent(errors.New("order is not JSON"))
		})))
	}()
	testenv.WaitFor(t, 10*time.Second, "the dead letter", func() bool { return len(mb.Messages("orders-dlq")) == 1 })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	code, out, errOut := ferryDLQ(t, context.Background(), "peek", "orders-dlq", "--broker", f.url, "--json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	var s []Story
	if err := json.Unmarshal([]byte(out), &s); err != nil || len(s) != 1 {
		t.Fatalf("peek printed %q (%v)", out, err)
	}
	if s[0].Source != "orders" || s[0].Reason != "permanent" || s[0].Attempts != 1 || !strings.Contains(s[0].Error, "order is not JSON") ||
		s[0].Key != "c-1" || s[0].Consumer != "billing" || s[0].LastFailure == nil || s[0].Body != "{" {
		t.Errorf("story: %+v", s[0])
	}
}

func memoryOf(f *fixture) (*memory.Broker, bool) { return memoryBroker(f) }

// checkOnce checks that each of n messages is at the source exactly once,
// but for at most dups messages published twice.
func checkOnce(t *testing.T, got map[string]int, n, dups int) {
	t.Helper()
	twice := 0
	for i := range n {
		id := fmt.Sprintf("m-%03d", i)
		switch c := got[id]; {
		case c == 0:
			t.Errorf("%s is not at the source: lost", id)
		case c == 2:
			twice++
		case c > 2:
			t.Errorf("%s is at the source %d times", id, c)
		}
	}
	if len(got) > n {
		t.Errorf("the source holds %d distinct messages, want %d", len(got), n)
	}
	if twice > dups {
		t.Errorf("%d messages are at the source twice, want at most %d", twice, dups)
	}
}

// A redrive killed halfway (SIGKILL, no chance to clean up) and run again
// moves every message exactly once, but for at most the one in flight at
// the kill, and leaves the dead-letter destination empty.
func TestRedriveKilledHalfwayLosesNothing(t *testing.T) {
	for _, bk := range brokers[1:] { // memory lives in one process
		t.Run(bk.name, func(t *testing.T) {
			f := bk.make(t)
			const n = 30
			f.seed(t, n)
			args := []string{"redrive", f.dlq, "--to", f.to, "--broker", f.url, "--rate", "15/s", "--wait", "1s", "--idle", "20s"}
			cmd, out := child(t, args...)
			testenv.WaitFor(t, 60*time.Second, "a third of the messages at the source", func() bool { return f.depth(t) >= n/3 })
			if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			_ = cmd.Wait()
			moved := f.depth(t)
			if moved >= n {
				t.Fatalf("the kill came too late: %d of %d moved\n%s", moved, n, out)
			}
			t.Logf("killed after %d of %d", moved, n)
			time.Sleep(f.settleIn) // SQS: what the killed run received becomes visible again

			cmd, out = child(t, args...)
			if err := cmd.Wait(); err != nil {
				t.Fatalf("the second run failed: %v\n%s", err, out)
			}
			if !strings.Contains(out.String(), "moved ") || !strings.Contains(out.String(), "0 left in") {
				t.Errorf("the summary does not say everything moved:\n%s", out)
			}
			if left := f.left(t); left != 0 {
				t.Errorf("%d messages left in the dead-letter destination", left)
			}
			checkOnce(t, f.drain(t), n, 1)
		})
	}
}

// The filter moves the messages it matches and leaves the others where
// they are, and the run ends by itself although they stay.
func TestRedriveFilterLeavesTheRest(t *testing.T) {
	for _, bk := range brokers {
		if bk.name == "sqs" && testing.Short() {
			continue
		}
		t.Run(bk.name, func(t *testing.T) {
			f := bk.make(t)
			const n = 10
			f.seed(t, n)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			code, out, errOut := ferryDLQ(t, ctx, "redrive", f.dlq, "--to", f.to, "--broker", f.url, "--rate", "0",
				"--filter", "reason=perm*", "--filter", "x-tenant=acme", "--wait", "1s")
			if code != 0 {
				t.Fatalf("exit %d: %s%s", code, out, errOut)
			}
			if !strings.Contains(out, "moved 5 messages") || !strings.Contains(out, "5 skipped") {
				t.Errorf("summary: %s", out)
			}
			got := f.drain(t)
			for i := range n {
				id := fmt.Sprintf("m-%03d", i)
				if want := 1 - i%2; got[id] != want {
					t.Errorf("%s is at the source %d times, want %d", id, got[id], want)
				}
			}
			want := n / 2
			if f.kafka {
				want = 0 // the group passed over them; the topic keeps every record
			}
			testenv.WaitFor(t, 10*time.Second, "the skipped messages in the destination", func() bool { return f.left(t) == want })
		})
	}
}

// Interrupted, a redrive finishes the message in flight, gives the others
// back and says how far it got; running it again moves the rest, each
// message exactly once.
func TestRedriveInterruptedStopsCleanly(t *testing.T) {
	f := memoryFixture(t)
	const n = 20
	f.seed(t, n)
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(300*time.Millisecond, cancel)
	code, out, errOut := ferryDLQ(t, ctx, "redrive", f.dlq, "--to", f.to, "--broker", f.url, "--rate", "20/s")
	if code != 130 {
		t.Fatalf("exit %d, want 130: %s%s", code, out, errOut)
	}
	if !strings.Contains(errOut, "interrupted after moving") {
		t.Errorf("stderr does not say how far it got: %s", errOut)
	}
	moved := f.depth(t)
	if moved == 0 || moved == n || !strings.Contains(out, fmt.Sprintf("moved %d messages", moved)) {
		t.Errorf("moved %d of %d; summary %q", moved, n, out)
	}
	if left := f.left(t); left+moved != n {
		t.Errorf("%d moved and %d left of %d", moved, left, n)
	}
	code, _, errOut = ferryDLQ(t, context.Background(), "redrive", f.dlq, "--to", f.to, "--broker", f.url, "--rate", "0", "--wait", "200ms")
	if code != 0 {
		t.Fatalf("second run: exit %d: %s", code, errOut)
	}
	checkOnce(t, f.drain(t), n, 0)
	if left := f.left(t); left != 0 {
		t.Errorf("%d left", left)
	}
}

// The redriven message is the original again: its key, body, headers and
// original id, without the ferry-dlq-* headers, marked with where it came
// from.
func TestRedrivenMessageIsTheOriginal(t *testing.T) {
	f := memoryFixture(t)
	f.seed(t, 1)
	if code, _, errOut := ferryDLQ(t, context.Background(), "redrive", f.dlq, "--to", f.to, "--broker", f.url, "--wait", "200ms"); code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	mb, _ := memoryOf(f)
	ms := mb.Messages(f.to)
	if len(ms) != 1 {
		t.Fatalf("%d messages at the source", len(ms))
	}
	m := ms[0]
	if !strings.HasPrefix(m.ID, "m-000~r") || m.Key != "k-m-000" || string(m.Body) != "m-000" || m.Headers["x-tenant"] != "acme" ||
		m.Headers[HeaderRedrivenFrom] != f.dlq || m.Headers["traceparent"] == "" {
		t.Errorf("redriven message: %+v", m)
	}
	for k := range m.Headers {
		if strings.HasPrefix(k, "ferry-dlq-") || strings.HasPrefix(k, "x-delivery") || strings.HasPrefix(k, "x-last-death") {
			t.Errorf("the redriven message keeps %s", k)
		}
	}
}

// A usage error prints the error and one line naming the command's help,
// not the whole help: the error stays in sight.
func TestBadUsageExitsTwo(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"purge"}, `unknown command "purge"`},
		{[]string{"peek"}, "want one DESTINATION"},
		{[]string{"peek", "a", "b", "--broker", "kafka://127.0.0.1:9092"}, "want one DESTINATION"},
		{[]string{"peek", "a"}, "--broker URL is required"},
		{[]string{"peek", "a", "--broker", "nats://x"}, "scheme"},
		{[]string{"peek", "a", "--bogus"}, "flag provided but not defined: -bogus"},
		{[]string{"peek", "a", "--group", "g", "--from-start", "--broker", "kafka://127.0.0.1:9092"}, "give one"},
		{[]string{"redrive", "a", "--to", "b", "--rate", "fast", "--broker", "kafka://127.0.0.1:9092"}, "--rate"},
		{[]string{"redrive", "a", "--to", "b", "--filter", "reason", "--broker", "kafka://127.0.0.1:9092"}, "NAME=PATTERN"},
		{[]string{"redrive", "a", "--to", "a", "--broker", "kafka://127.0.0.1:9092"}, "destination itself"},
		{[]string{"peek", "a", "--limit", "0", "--broker", "kafka://127.0.0.1:9092"}, "--limit"},
		// A new process's in-process broker is empty: nothing to read.
		{[]string{"peek", "a", "--broker", "mem://x"}, "mem:// is the in-process broker: a new ferry process has its own, empty one"},
		{[]string{"redrive", "a", "--broker", "mem://"}, "mem:// is the in-process broker"},
		// A dead-letter topic is read through a consumer group of the command's own.
		{[]string{"peek", "a", "--broker", "kafka://127.0.0.1:9092?group_protocol=share"}, "without group_protocol=share"},
		{[]string{"redrive", "a", "--broker", "kafka://127.0.0.1:9092?group_protocol=share"}, "without group_protocol=share"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var out, errOut strings.Builder
			code := Run(context.Background(), tc.args, &out, &errOut)
			lines := strings.Split(strings.TrimSpace(errOut.String()), "\n")
			if code != 2 || !strings.Contains(lines[0], tc.want) {
				t.Errorf("exit %d, stderr %q; want 2 and %q", code, errOut.String(), tc.want)
			}
			sub := "dlq"
			if len(tc.args) > 0 && (tc.args[0] == "peek" || tc.args[0] == "redrive") {
				sub += " " + tc.args[0]
			}
			if len(lines) != 2 || lines[1] != "run 'ferry help "+sub+"' for its usage and flags" {
				t.Errorf("stderr is not the error and the line naming the help:\n%s", errOut.String())
			}
		})
	}
	if code, _, errOut := ferryDLQ(t, context.Background()); code != 2 || !strings.Contains(errOut, "Usage: ferry dlq") {
		t.Errorf("ferry dlq: exit %d, stderr %q", code, errOut)
	}
	for _, args := range [][]string{{"peek", "--help"}, {"redrive", "-h"}, {"--help"}} {
		code, out, errOut := ferryDLQ(t, context.Background(), args...)
		if code != 0 || !strings.Contains(out+errOut, "Usage: ferry dlq") || !strings.Contains(out+errOut, "-broker") {
			t.Errorf("%v: exit %d, output %q", args, code, out+errOut)
		}
	}
}

// A message redriven to an SQS FIFO queue within five minutes of its
// original publish is not dropped as a duplicate of the original: the
// redrive's id is not the original's.
func TestRedriveToAnSQSFIFOSourceIsNotADuplicateOfTheOriginal(t *testing.T) {
	f := sqsFixture(t)
	c := f.client
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	src := testenv.UniqueName(t, "src") + ".fifo"
	out, err := c.CreateQueue(ctx, &awssqs.CreateQueueInput{QueueName: aws.String(src), Attributes: map[string]string{"FifoQueue": "true"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.DeleteQueue(context.Background(), &awssqs.DeleteQueueInput{QueueUrl: out.QueueUrl}) })
	// The original, published and consumed.
	if err := f.pub.Publish(ctx, src, consumer.Message{ID: "m-000", Key: "k-m-000", Body: []byte("m-000")}); err != nil {
		t.Fatal(err)
	}
	r, err := c.ReceiveMessage(ctx, &awssqs.ReceiveMessageInput{QueueUrl: out.QueueUrl, WaitTimeSeconds: 2})
	if err != nil || len(r.Messages) != 1 {
		t.Fatalf("the original: %v, %d messages", err, len(r.Messages))
	}
	if _, err := c.DeleteMessage(ctx, &awssqs.DeleteMessageInput{QueueUrl: out.QueueUrl, ReceiptHandle: r.Messages[0].ReceiptHandle}); err != nil {
		t.Fatal(err)
	}
	f.seed(t, 1)
	if code, o, errOut := ferryDLQ(t, ctx, "redrive", f.dlq, "--to", src, "--broker", f.url, "--wait", "1s"); code != 0 || !strings.Contains(o, "moved 1 ") {
		t.Fatalf("exit %d: %s%s", code, o, errOut)
	}
	r, err = c.ReceiveMessage(ctx, &awssqs.ReceiveMessageInput{QueueUrl: out.QueueUrl, WaitTimeSeconds: 2})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Messages) != 1 || aws.ToString(r.Messages[0].Body) != "m-000" {
		t.Errorf("the FIFO source holds %d messages after the redrive, want the redriven one", len(r.Messages))
	}
}

// A redrive on Kafka refuses a group that has members (another redrive
// would commit over it, a consumer would have its offsets moved) before it
// publishes anything.
func TestRedriveOnKafkaRefusesAGroupInUse(t *testing.T) {
	f := kafkaFixture(t)
	f.seed(t, 3)
	group := testenv.UniqueName(t, "busy")
	l, err := f.pub.NewConsumer(context.Background(), f.dlq, consumer.WithName(group), consumer.WithShutdownGrace(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	running := make(chan struct{}, 1)
	done := make(chan error, 1)
	go func() {
		done <- l.Run(ctx, consumer.HandlerFunc(func(ctx context.Context, _ *consumer.Message) error {
			select {
			case running <- struct{}{}:
			default:
			}
			<-ctx.Done()
			return ctx.Err()
		}))
	}()
	select {
	case <-running:
	case <-time.After(30 * time.Second):
		t.Fatal("the consumer did not join")
	}
	code, out, errOut := ferryDLQ(t, context.Background(), "redrive", f.dlq, "--to", f.to, "--broker", f.url, "--group", group)
	if code != 1 || !strings.Contains(errOut, "members") {
		t.Errorf("exit %d, want 1 naming the members: %s%s", code, out, errOut)
	}
	if n := f.depth(t); n != 0 {
		t.Errorf("%d messages published", n)
	}
	cancel()
	<-done
}

// The progress bar is rewritten in place and erased at the end; it is
// never written off a terminal.
func TestProgressBar(t *testing.T) {
	var buf strings.Builder
	p := newProgress(RedriveConfig{Progress: &buf, ProgressBar: true}, Count{N: 10})
	p.show(Result{Moved: 4, Skipped: 1})
	if s := buf.String(); !strings.HasPrefix(s, "\r[===============               ] 5/10") || !strings.Contains(s, "moved 4 skipped 1") {
		t.Errorf("bar: %q", s)
	}
	p.done()
	if !strings.HasSuffix(buf.String(), "\r\033[K") {
		t.Errorf("the bar is not erased: %q", buf.String())
	}
	f := memoryFixture(t)
	f.seed(t, 3)
	_, out, errOut := ferryDLQ(t, context.Background(), "redrive", f.dlq, "--to", f.to, "--broker", f.url, "--wait", "200ms")
	if strings.Contains(out+errOut, "\r") {
		t.Errorf("a bar was written to a buffer: %q", out+errOut)
	}
}

// Off a terminal (a Job's log) a progress line comes every --progress,
// counting up; --progress 0 prints none.
func TestProgressLinesOffATerminal(t *testing.T) {
	f := memoryFixture(t)
	const n = 12
	f.seed(t, n)
	code, out, errOut := ferryDLQ(t, context.Background(), "redrive", f.dlq, "--broker", f.url, "--rate", "10/s", "--progress", "300ms", "--wait", "200ms")
	if code != 0 {
		t.Fatalf("exit %d: %s%s", code, out, errOut)
	}
	var moved []int
	for _, l := range strings.Split(errOut, "\n") {
		var read, m, skipped int
		if _, err := fmt.Sscanf(l, "ferry dlq redrive: %d of 12 read: moved %d, skipped %d,", &read, &m, &skipped); err == nil {
			moved = append(moved, m)
		}
	}
	if len(moved) < 3 {
		t.Fatalf("want a progress line every 300ms of a run over a second, got %d:\n%s", len(moved), errOut)
	}
	for i := 1; i < len(moved); i++ {
		if moved[i] < moved[i-1] {
			t.Errorf("the lines count down: %v", moved)
		}
	}
	if moved[0] == n || moved[len(moved)-1] == 0 {
		t.Errorf("the lines do not show the run moving: %v", moved)
	}
	f.seed(t, 3)
	_, _, errOut = ferryDLQ(t, context.Background(), "redrive", f.dlq, "--broker", f.url, "--rate", "10/s", "--progress", "0", "--wait", "200ms")
	if strings.Contains(errOut, "read: moved") {
		t.Errorf("--progress 0 printed progress:\n%s", errOut)
	}
}

// A message another consumer holds is not waited for beyond --idle: the
// redrive moves the rest and says what it left.
func TestRedriveGivesUpOnWhatOthersHold(t *testing.T) {
	f := memoryFixture(t)
	f.seed(t, 3)
	mb, _ := memoryOf(f)
	other, err := mb.Driver(t.Context(), f.dlq, driver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if got, err := other.Fetch(context.Background(), nil, 1); err != nil || len(got) != 1 {
		t.Fatalf("the other consumer got %d: %v", len(got), err)
	}
	start := time.Now()
	code, out, errOut := ferryDLQ(t, context.Background(), "redrive", f.dlq, "--to", f.to, "--broker", f.url, "--wait", "100ms", "--idle", "500ms")
	if code != 0 || !strings.Contains(out, "moved 2 messages") || !strings.Contains(errOut, "1 messages are still in") {
		t.Errorf("exit %d: %s%s", code, out, errOut)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("took %s", d)
	}
}

// SIGINT and SIGTERM (a Kubernetes Job's deadline, timeout(1)) stop the
// built command cleanly: exit 130 or 143, it says how far it got and what
// is left, and what it moved is exactly what left the destination. Each
// message goes to the source its ferry-dlq-source header names.
func TestRedriveStopsCleanlyOnSIGINTAndSIGTERM(t *testing.T) {
	for _, bk := range brokers[1:] { // memory lives in one process
		for _, sig := range []struct {
			sig  syscall.Signal
			code int
			says string
		}{
			{syscall.SIGINT, 130, "interrupted after moving"},
			{syscall.SIGTERM, 143, "terminated (SIGTERM) after moving"},
		} {
			t.Run(bk.name+"/"+sig.sig.String(), func(t *testing.T) {
				f := bk.make(t)
				const n = 20
				f.seed(t, n)
				cmd, out := child(t, "redrive", f.dlq, "--broker", f.url, "--rate", "10/s", "--wait", "1s")
				testenv.WaitFor(t, 60*time.Second, "some messages at the source", func() bool { return f.depth(t) >= 3 })
				if err := cmd.Process.Signal(sig.sig); err != nil {
					t.Fatal(err)
				}
				err := cmd.Wait()
				var ee *exec.ExitError
				if !errors.As(err, &ee) || ee.ExitCode() != sig.code {
					t.Fatalf("exit %v, want %d\n%s", err, sig.code, out)
				}
				moved := f.depth(t)
				if !strings.Contains(out.String(), fmt.Sprintf("%s %d messages; nothing in flight was lost", sig.says, moved)) {
					t.Errorf("the command does not say it moved %d:\n%s", moved, out)
				}
				if !strings.Contains(out.String(), fmt.Sprintf("moved %d messages from %s to their sources (%s: %d)", moved, f.dlq, f.src, moved)) ||
					!strings.Contains(out.String(), fmt.Sprintf("%d left in %s", n-moved, f.dlq)) {
					t.Errorf("the summary does not say %d moved and %d are left:\n%s", moved, n-moved, out)
				}
				if moved >= n {
					t.Fatalf("the signal came too late: %d moved", moved)
				}
				time.Sleep(f.settleIn)
				testenv.WaitFor(t, 10*time.Second, "the rest in the destination", func() bool { return f.left(t) == n-moved })
				checkOnceOf(t, f.drain(t), moved)
			})
		}
	}
}

// checkOnceOf checks that the source holds n distinct messages, each once.
func checkOnceOf(t *testing.T, got map[string]int, n int) {
	t.Helper()
	if len(got) != n {
		t.Errorf("the source holds %d distinct messages, want %d", len(got), n)
	}
	for id, c := range got {
		if c != 1 {
			t.Errorf("%s is at the source %d times", id, c)
		}
	}
}

// A redrive stopped by --limit says truthfully what is left: on RabbitMQ
// the messages the broker pushed ahead (the prefetch) and the redrive never
// took count too.
func TestRedriveLimitSaysWhatIsLeft(t *testing.T) {
	for _, bk := range brokers {
		t.Run(bk.name, func(t *testing.T) {
			f := bk.make(t)
			const n = 5
			f.seed(t, n)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			code, out, errOut := ferryDLQ(t, ctx, "redrive", f.dlq, "--to", f.to, "--broker", f.url, "--rate", "0", "--limit", "2", "--wait", "1s")
			if code != 0 {
				t.Fatalf("exit %d: %s%s", code, out, errOut)
			}
			if !strings.Contains(out, "moved 2 messages") || !strings.Contains(out, "3 left in "+f.dlq) {
				t.Errorf("summary: %s", out)
			}
			testenv.WaitFor(t, 10*time.Second, "3 messages in the destination", func() bool { return f.left(t) == 3 })
		})
	}
}

// Without --to, each message goes back to the source its ferry-dlq-source
// header names. One without that header stays where it is and the
// command says so (on Kafka its partition stops before it, so nothing is
// passed over); a run with --to then moves it.
func TestRedriveDefaultsToEachMessagesSource(t *testing.T) {
	for _, bk := range brokers {
		if bk.name == "sqs" && testing.Short() {
			continue
		}
		t.Run(bk.name, func(t *testing.T) {
			f := bk.make(t)
			const n = 4
			f.seed(t, n)
			orphan := deadLetters(f.src, n, 1)[0]
			delete(orphan.Headers, consumer.HeaderDLQSource)
			f.publish(t, orphan) // last: on Kafka nothing waits behind it in its partition
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			code, out, errOut := ferryDLQ(t, ctx, "redrive", f.dlq, "--broker", f.url, "--rate", "0", "--wait", "1s")
			if code != 0 {
				t.Fatalf("exit %d: %s%s", code, out, errOut)
			}
			if want := fmt.Sprintf("moved %d messages from %s to their sources (%s: %d)", n, f.dlq, f.src, n); !strings.Contains(out, want) ||
				!strings.Contains(out, "1 naming no source") || !strings.Contains(out, "1 left in "+f.dlq) {
				t.Errorf("summary %q, want %q, 1 naming no source and 1 left", out, want)
			}
			if !strings.Contains(errOut, "1 messages carry no ferry-dlq-source header") {
				t.Errorf("stderr does not say what stayed and why:\n%s", errOut)
			}
			if f.kafka && !strings.Contains(errOut, "stopped at offset") {
				t.Errorf("stderr does not say where the partition stopped:\n%s", errOut)
			}
			testenv.WaitFor(t, 10*time.Second, "the message without a source in the destination", func() bool { return f.left(t) == 1 })
			if d := f.depth(t); d != n {
				t.Fatalf("the source holds %d messages, want %d", d, n)
			}
			code, out, errOut = ferryDLQ(t, ctx, "redrive", f.dlq, "--to", f.to, "--broker", f.url, "--rate", "0", "--wait", "1s")
			if code != 0 || !strings.Contains(out, "moved 1 messages") || !strings.Contains(out, "0 left in") {
				t.Fatalf("the run with --to: exit %d: %s%s", code, out, errOut)
			}
			checkOnce(t, f.drain(t), n+1, 0)
		})
	}
}

// On RabbitMQ a source named bare is the queue of that name (through the
// default exchange), as is the older amq.default/QUEUE; a name no queue
// has is an exchange's, and amq.exchange/EXCHANGE names one outright: the
// message is routed by its key.
func TestRedriveOnRabbitMQToAQueueOrAnExchange(t *testing.T) {
	f := rabbitFixture(t)
	conn, err := amqp.Dial(f.url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	exchange, bound := testenv.UniqueName(t, "ex"), testenv.UniqueName(t, "bound")
	if err := ch.ExchangeDeclare(exchange, "fanout", false, true, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(bound, false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	defer ch.QueueDelete(bound, false, false, false)
	if err := ch.QueueBind(bound, "", exchange, false, nil); err != nil {
		t.Fatal(err)
	}
	boundDepth := func() int {
		q, err := ch.QueueDeclarePassive(bound, false, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		return q.Messages
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for i, tc := range []struct {
		to    string
		depth func() int
	}{
		{f.to, func() int { return f.depth(t) }},
		{"amq.default/" + f.to, func() int { return f.depth(t) }},
		{exchange, boundDepth},
		{rabbit.ToExchange(exchange), boundDepth},
	} {
		before := tc.depth()
		f.publish(t, deadLetters(f.src, i, 1)...)
		code, out, errOut := ferryDLQ(t, ctx, "redrive", f.dlq, "--to", tc.to, "--broker", f.url, "--wait", "500ms")
		if code != 0 || !strings.Contains(out, "moved 1 messages") {
			t.Fatalf("--to %s: exit %d: %s%s", tc.to, code, out, errOut)
		}
		testenv.WaitFor(t, 10*time.Second, "the message at "+tc.to, func() bool { return tc.depth() == before+1 })
	}
	// A name that is neither: the publish fails, and the message stays.
	f.publish(t, deadLetters(f.src, 4, 1)...)
	code, out, errOut := ferryDLQ(t, ctx, "redrive", f.dlq, "--to", "no-such-exchange-or-queue", "--broker", f.url, "--wait", "500ms")
	if code != 1 || !strings.Contains(errOut, "no-such-exchange-or-queue") || !strings.Contains(errOut, "it stays in") {
		t.Errorf("--to a name that reaches nothing: exit %d: %s%s", code, out, errOut)
	}
	testenv.WaitFor(t, 10*time.Second, "the message back in the destination", func() bool { return f.left(t) == 1 })
}

// On Kafka, peek shows what a redrive would still move: after a redrive,
// it reads past the redrive group's committed offsets and says so;
// --from-start reads the whole log, --group another group's offsets.
func TestPeekOnKafkaShowsWhatARedriveWouldStillMove(t *testing.T) {
	f := kafkaFixture(t)
	const n = 6
	f.seed(t, n)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	peek := func(args ...string) (string, []Story) {
		t.Helper()
		code, out, errOut := ferryDLQ(t, ctx, append([]string{"peek", f.dlq, "--broker", f.url, "--json"}, args...)...)
		if code != 0 {
			t.Fatalf("peek %v: exit %d: %s", args, code, errOut)
		}
		var s []Story
		if err := json.Unmarshal([]byte(out), &s); err != nil {
			t.Fatalf("peek %v printed %q: %v", args, out, err)
		}
		return errOut, s
	}
	if notes, s := peek(); len(s) != n || !strings.Contains(notes, "from the log start") || !strings.Contains(notes, fmt.Sprintf("%d of %d messages", n, n)) {
		t.Errorf("before any redrive: %d stories; stderr:\n%s", len(s), notes)
	}
	if code, out, errOut := ferryDLQ(t, ctx, "redrive", f.dlq, "--broker", f.url, "--limit", "2", "--rate", "0"); code != 0 {
		t.Fatalf("redrive: exit %d: %s%s", code, out, errOut)
	}
	notes, s := peek()
	if len(s) != n-2 || !strings.Contains(notes, `past the committed offsets of group "ferry-redrive"`) || !strings.Contains(notes, fmt.Sprintf("%d of %d messages", n-2, n-2)) {
		t.Errorf("after moving 2: %d stories, want %d; stderr:\n%s", len(s), n-2, notes)
	}
	moved := f.drain(t)
	for _, st := range s {
		if moved[st.Body] > 0 {
			t.Errorf("peek shows %s, which the redrive moved", st.Body)
		}
	}
	if notes, s := peek("--from-start"); len(s) != n || !strings.Contains(notes, "from the log start") {
		t.Errorf("--from-start: %d stories; stderr:\n%s", len(s), notes)
	}
	if notes, s := peek("--group", testenv.UniqueName(t, "other")); len(s) != n || !strings.Contains(notes, "past the committed offsets of group") {
		t.Errorf("--group other: %d stories; stderr:\n%s", len(s), notes)
	}
}
