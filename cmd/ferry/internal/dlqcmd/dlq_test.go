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

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/memory"
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
					if s.Source != "orders" || s.MessageID != id || s.Attempts != 10 || s.Deliveries != 11 || s.Unseen != 1 ||
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
				waitUntil(t, 10*time.Second, "the peeked messages back in the destination", func() bool { return f.inDLQ(t) == n })
			}
			code, out, errOut := ferryDLQ(t, ctx, "peek", f.dlq, "--broker", f.url, "--wait", "1s", "--limit", "4")
			if code != 0 {
				t.Fatalf("peek exited %d: %s", code, errOut)
			}
			lines := strings.Split(strings.TrimSpace(out), "\n")
			if len(lines) != 5 || !strings.Contains(lines[0], "LAST ERROR") || !strings.Contains(out, "invalid JSON") || !strings.Contains(out, "max-attempts") {
				t.Errorf("the table of 4 messages is not one:\n%s", out)
			}
			waitUntil(t, 10*time.Second, "the peeked messages back in the destination", func() bool { return f.inDLQ(t) == n })
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
	l, err := mb.NewConsumer("orders", consumer.WithName("billing"))
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
	waitUntil(t, 10*time.Second, "the dead letter", func() bool { return len(mb.Messages("orders-dlq")) == 1 })
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
			waitUntil(t, 60*time.Second, "a third of the messages at the source", func() bool { return f.depth(t) >= n/3 })
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
			waitUntil(t, 10*time.Second, "the skipped messages in the destination", func() bool { return f.left(t) == want })
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

func TestBadUsageExitsTwo(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "Usage: ferry dlq"},
		{[]string{"purge"}, `unknown command "purge"`},
		{[]string{"peek"}, "want one DESTINATION"},
		{[]string{"peek", "a", "b", "--broker", "mem://x"}, "want one DESTINATION"},
		{[]string{"peek", "a"}, "--broker URL is required"},
		{[]string{"peek", "a", "--broker", "nats://x"}, "scheme"},
		{[]string{"redrive", "a", "--broker", "mem://x"}, "--to SOURCE is required"},
		{[]string{"redrive", "a", "--to", "b", "--rate", "fast", "--broker", "mem://x"}, "--rate"},
		{[]string{"redrive", "a", "--to", "b", "--filter", "reason", "--broker", "mem://x"}, "NAME=PATTERN"},
		{[]string{"redrive", "a", "--to", "a", "--broker", "mem://x"}, "destination itself"},
		{[]string{"peek", "a", "--limit", "0", "--broker", "mem://x"}, "--limit"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			code, _, errOut := ferryDLQ(t, context.Background(), tc.args...)
			if code != 2 || !strings.Contains(errOut, tc.want) {
				t.Errorf("exit %d, stderr %q; want 2 and %q", code, errOut, tc.want)
			}
		})
	}
	for _, args := range [][]string{{"peek", "--help"}, {"redrive", "-h"}, {"--help"}} {
		code, out, errOut := ferryDLQ(t, context.Background(), args...)
		if code != 0 || !strings.Contains(out+errOut, "Usage: ferry dlq") {
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

// The progress bar is rewritten in place and erased at the end; without a
// terminal nothing of it is written.
func TestProgressBar(t *testing.T) {
	var buf strings.Builder
	p := newProgress(&buf, 10)
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

// A message another consumer holds is not waited for beyond --idle: the
// redrive moves the rest and says what it left.
func TestRedriveGivesUpOnWhatOthersHold(t *testing.T) {
	f := memoryFixture(t)
	f.seed(t, 3)
	mb, _ := memoryOf(f)
	other, err := mb.Driver(f.dlq)
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

// SIGINT stops the command cleanly: exit 130, it says how far it got, and
// what it moved is exactly what left the destination.
func TestRedriveStopsCleanlyOnSIGINT(t *testing.T) {
	for _, bk := range brokers[1:] { // memory lives in one process
		t.Run(bk.name, func(t *testing.T) {
			f := bk.make(t)
			const n = 20
			f.seed(t, n)
			cmd, out := child(t, "redrive", f.dlq, "--to", f.to, "--broker", f.url, "--rate", "10/s", "--wait", "1s")
			waitUntil(t, 60*time.Second, "some messages at the source", func() bool { return f.depth(t) >= 3 })
			if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
				t.Fatal(err)
			}
			err := cmd.Wait()
			var ee *exec.ExitError
			if !errors.As(err, &ee) || ee.ExitCode() != 130 {
				t.Fatalf("exit %v, want 130\n%s", err, out)
			}
			moved := f.depth(t)
			if !strings.Contains(out.String(), fmt.Sprintf("interrupted after moving %d messages", moved)) {
				t.Errorf("the command does not say it moved %d:\n%s", moved, out)
			}
			if moved >= n {
				t.Fatalf("the interrupt came too late: %d moved", moved)
			}
			time.Sleep(f.settleIn)
			waitUntil(t, 10*time.Second, "the rest in the destination", func() bool { return f.left(t) == n-moved })
			checkOnceOf(t, f.drain(t), moved)
		})
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
