package dlqcmd

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/ferrymq/ferry/internal/testenv"
)

// --native on SQS moves every message of the dead-letter queue to --to
// with SQS's message move task, server side: each exactly once, the
// summary saying how many moved and that none is left; the messages are
// the dead letters as they were (their story kept).
func TestRedriveNativeMovesEveryMessageWithSQSsTask(t *testing.T) {
	f := nativeFixture(t)
	const n = 25
	f.seed(t, n)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	testenv.WaitFor(t, 10*time.Second, "the dead letters in the DLQ", func() bool { return f.inDLQ(t) == n })
	code, out, errOut := ferryDLQ(t, ctx, "redrive", f.dlq, "--native", "--to", f.to, "--broker", f.url, "--rate", "100/s")
	if code != 0 {
		t.Fatalf("exit %d: %s%s", code, out, errOut)
	}
	if !strings.Contains(out, "moved 25 messages from "+f.dlq+" to "+f.to) || !strings.Contains(out, "about 0 left in "+f.dlq) {
		t.Errorf("summary %q, want 25 moved to %s and about 0 left", out, f.to)
	}
	checkOnce(t, f.drain(t), n, 0)
}

// --native refuses what SQS's task cannot do, before anything moves, with
// a usage error naming why: a filter, a limit, a rate over 500/s, a broker
// other than SQS.
func TestRedriveNativeRefusesWhatSQSCannotDo(t *testing.T) {
	f := sqsFixture(t)
	f.seed(t, 2)
	mem := memoryFixture(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, tc := range []struct {
		on   *fixture
		args []string
		want string
	}{
		{f, []string{"--filter", "reason=permanent"}, "no --filter or --limit"},
		{f, []string{"--limit", "1"}, "no --filter or --limit"},
		{f, []string{"--rate", "1000/s"}, "from 1 to 500 (SQS's MaxNumberOfMessagesPerSecond)"},
		{mem, nil, "not SQS"},
	} {
		args := append([]string{"redrive", tc.on.dlq, "--native", "--to", tc.on.to, "--broker", tc.on.url}, tc.args...)
		code, out, errOut := ferryDLQ(t, ctx, args...)
		if code != 2 || !strings.Contains(errOut, tc.want) || strings.Contains(out, "moved") {
			t.Errorf("redrive --native %v: exit %d, stdout %q, stderr %q; want exit 2 saying %q", tc.args, code, out, errOut, tc.want)
		}
	}
	if n := f.inDLQ(t); n != 2 {
		t.Fatalf("%d messages in the DLQ after refused runs, want 2", n)
	}
}

// A native move stopped halfway (the command's context ends, as on SIGINT)
// cancels SQS's task: what moved stays moved, the rest stays in the DLQ,
// the run says it was interrupted, and a second run moves the rest; every
// message ends at the source exactly once.
func TestRedriveNativeInterruptedCancelsTheTask(t *testing.T) {
	f := nativeFixture(t)
	const n = 20
	f.seed(t, n)
	testenv.WaitFor(t, 10*time.Second, "the dead letters in the DLQ", func() bool { return f.inDLQ(t) == n })
	ctx, cancel := context.WithTimeout(context.Background(), 2500*time.Millisecond)
	defer cancel()
	code, out, errOut := ferryDLQ(t, ctx, "redrive", f.dlq, "--native", "--to", f.to, "--broker", f.url, "--rate", "2/s")
	if code == 0 || !strings.Contains(errOut, "run the same command again") {
		t.Fatalf("interrupted run: exit %d: %s%s; want an interrupted exit that says to run again", code, out, errOut)
	}
	moved := f.depth(t)
	if moved == 0 || moved >= n {
		t.Fatalf("%d of %d moved by a run cut after 2.5s at 2/s", moved, n)
	}
	time.Sleep(2 * time.Second) // a task that went on would move more
	if d := f.depth(t); d != moved {
		t.Fatalf("the task went on after the cancel: %d moved, then %d", moved, d)
	}
	ctx2, cancel2 := context.WithTimeout(context.Background(), time.Minute)
	defer cancel2()
	code, out, errOut = ferryDLQ(t, ctx2, "redrive", f.dlq, "--native", "--to", f.to, "--broker", f.url)
	if code != 0 {
		t.Fatalf("second run: exit %d: %s%s", code, out, errOut)
	}
	// The second run counts its own task, not the cancelled one before it.
	if want := fmt.Sprintf("moved %d messages", n-moved); !strings.Contains(out, want) {
		t.Errorf("second run: %q, want %q", out, want)
	}
	checkOnce(t, f.drain(t), n, 0)
}

// nativeFixture is the SQS fixture with its DLQ made the dead-letter queue
// of the source's redrive policy: SQS starts a message move task only from
// such a queue (ElasticMQ does not check).
func nativeFixture(t *testing.T) *fixture {
	f := sqsFixture(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dlq, _, err := queueARN(ctx, f.client, f.dlq)
	if err != nil {
		t.Fatal(err)
	}
	_, src, err := queueARN(ctx, f.client, f.to)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.client.SetQueueAttributes(ctx, &awssqs.SetQueueAttributesInput{QueueUrl: aws.String(src),
		Attributes: map[string]string{"RedrivePolicy": `{"deadLetterTargetArn":"` + dlq + `","maxReceiveCount":"10"}`}}); err != nil {
		t.Fatal(err)
	}
	return f
}
