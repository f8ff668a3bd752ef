package dlqcmd

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/cmd/ferry/internal/cli"
	"github.com/ferrymq/ferry/sqs"
)

// maxMoveRate is the most messages a second SQS moves in a message move
// task (MaxNumberOfMessagesPerSecond).
const maxMoveRate = 500

// movePoll is how often a native move asks SQS how far its task got.
const movePoll = time.Second

// RedriveNative moves the messages of the SQS dead-letter queue
// cfg.Destination with SQS's own message move task (StartMessageMoveTask),
// server side: to cfg.To when set, else to the source queues SQS records for
// them (the queues whose redrive policy dead-lettered them). SQS takes only
// a queue that is the dead-letter queue of some queue's redrive policy. It
// shows the task's progress as Redrive does, and cancels the task when ctx
// ends (CancelMessageMoveTask), waiting until SQS says it is cancelled:
// what moved stays moved. A moved message is the dead letter with its
// ferry-dlq-* story, under a new message id (SQS's): SQS moves it whole,
// with no filter, limit or header of Ferry's, which is why Filter and Limit
// are refused. cfg.Rate, when set, is the task's rate, a whole number from
// 1 to 500 a second; 0 lets SQS pick.
func RedriveNative(ctx context.Context, b ferry.Broker, cfg RedriveConfig) (Result, error) {
	start := time.Now()
	res := Result{Left: unknown("the run ended before SQS was asked"), To: map[string]int{}}
	if err := nativeRefusal(b, cfg); err != nil {
		return res, err
	}
	c := b.(*sqs.Broker).Client()
	src, srcURL, err := queueARN(ctx, c, cfg.Destination)
	if err != nil {
		return res, err
	}
	in := &awssqs.StartMessageMoveTaskInput{SourceArn: aws.String(src)}
	if cfg.To != "" {
		dst, _, err := queueARN(ctx, c, cfg.To)
		if err != nil {
			return res, err
		}
		in.DestinationArn = aws.String(dst)
	}
	if cfg.Rate > 0 {
		in.MaxNumberOfMessagesPerSecond = aws.Int32(int32(cfg.Rate))
	}
	left := func() Count {
		lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), opTimeout)
		defer cancel()
		out, err := c.GetQueueAttributes(lctx, &awssqs.GetQueueAttributesInput{QueueUrl: aws.String(srcURL),
			AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameApproximateNumberOfMessages}})
		if err != nil {
			return unknown("asking SQS failed: " + ferry.Redact(err.Error()))
		}
		n, err := strconv.ParseInt(out.Attributes[string(types.QueueAttributeNameApproximateNumberOfMessages)], 10, 64)
		if err != nil {
			return unknown("SQS gave no ApproximateNumberOfMessages")
		}
		return Count{N: n, Approx: true}
	}
	bar := newProgress(cfg, left())
	defer bar.done()
	where := cfg.To
	if where == "" {
		where = "their SQS sources"
	}
	// The task this run starts is the first listed that started after the
	// newest task before it (a finished task's handle is not listed).
	var before int64
	if prev, err := latestMove(context.WithoutCancel(ctx), c, src); err == nil && prev != nil {
		before = prev.StartedTimestamp
	}
	// Started whatever ctx does meanwhile: a start cut short may still
	// have made a task, which nothing would then cancel.
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), opTimeout)
	task, err := c.StartMessageMoveTask(sctx, in)
	cancel()
	if err != nil {
		return finishMove(res, start, left, fmt.Errorf("start a message move task from %s: %w", cfg.Destination, err))
	}
	handle := aws.ToString(task.TaskHandle)
	mine := func(r *types.ListMessageMoveTasksResultEntry) bool {
		if h := aws.ToString(r.TaskHandle); h != "" {
			return h == handle
		}
		return r.StartedTimestamp > before
	}
	t := time.NewTicker(movePoll)
	defer t.Stop()
	cancelled := false // this run asked SQS to cancel the task
	seen := false      // SQS listed the task
	for {
		st, err := latestMove(context.WithoutCancel(ctx), c, src)
		switch {
		case err != nil && cancelled:
			res.Interrupted = true
			return finishMove(res, start, left, nil)
		case err != nil:
			return finishMove(res, start, left, fmt.Errorf("%w; the task may go on: cancel it with CancelMessageMoveTask (handle %s)", err, handle))
		case st != nil && mine(st):
			seen = true
			res.Moved = int(st.ApproximateNumberOfMessagesMoved)
			res.To = map[string]int{where: res.Moved}
			bar.show(res)
			switch aws.ToString(st.Status) {
			case "COMPLETED":
				return finishMove(res, start, left, nil)
			case "CANCELLED":
				if cancelled {
					res.Interrupted = true
					return finishMove(res, start, left, nil)
				}
				return finishMove(res, start, left, fmt.Errorf("the message move task from %s was cancelled outside this run after moving %d", cfg.Destination, res.Moved))
			case "FAILED":
				return finishMove(res, start, left, fmt.Errorf("the message move task from %s failed after moving %d: %s",
					cfg.Destination, res.Moved, aws.ToString(st.FailureReason)))
			}
		}
		if !seen && time.Since(start) > opTimeout {
			return finishMove(res, start, left, fmt.Errorf("SQS did not list the message move task it started (handle %s) within %s", handle, opTimeout))
		}
		if ctx.Err() != nil && !cancelled {
			// Stopped: ask SQS to cancel, then wait for the task to say
			// CANCELLED (or that it finished first) before counting.
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), opTimeout)
			out, err := c.CancelMessageMoveTask(cctx, &awssqs.CancelMessageMoveTaskInput{TaskHandle: task.TaskHandle})
			cancel()
			cancelled = true
			if err == nil {
				res.Moved = int(out.ApproximateNumberOfMessagesMoved)
				res.To = map[string]int{where: res.Moved}
			} else {
				var ended *types.ResourceNotFoundException
				if !errors.As(err, &ended) {
					bar.done()
					fmt.Fprintf(cfgProgress(cfg), "ferry dlq redrive: cancelling the message move task: %s\n", ferry.Redact(err.Error()))
				}
			}
			deadline := time.Now().Add(opTimeout)
			for time.Now().Before(deadline) {
				st, err := latestMove(context.WithoutCancel(ctx), c, src)
				if err != nil {
					break
				}
				if st == nil || !mine(st) {
					// No longer listed (ElasticMQ forgets a cancelled
					// task; SQS lists it CANCELLED).
					res.Interrupted = true
					return finishMove(res, start, left, nil)
				}
				res.Moved = int(st.ApproximateNumberOfMessagesMoved)
				res.To = map[string]int{where: res.Moved}
				switch aws.ToString(st.Status) {
				case "COMPLETED":
					return finishMove(res, start, left, nil)
				case "CANCELLED":
					res.Interrupted = true
					return finishMove(res, start, left, nil)
				case "FAILED":
					return finishMove(res, start, left, fmt.Errorf("the message move task from %s failed after moving %d: %s",
						cfg.Destination, res.Moved, aws.ToString(st.FailureReason)))
				}
				time.Sleep(movePoll / 4)
			}
			res.Interrupted = true
			return finishMove(res, start, left, fmt.Errorf("the message move task did not say it was cancelled within %s; it may go on (handle %s)", opTimeout, handle))
		}
		select {
		case <-ctx.Done():
		case <-t.C:
		}
	}
}

// cfgProgress is where a run's notes go: its progress writer, or nowhere.
func cfgProgress(cfg RedriveConfig) io.Writer {
	if cfg.Progress == nil {
		return io.Discard
	}
	return cfg.Progress
}

// nativeRefusal says why cfg cannot move natively on b: a broker other than
// SQS, a filter or a limit (SQS moves every message), a rate SQS does not
// take.
func nativeRefusal(b ferry.Broker, cfg RedriveConfig) error {
	if _, ok := b.(*sqs.Broker); !ok {
		return cli.Usagef("--native moves with SQS's message move task: the broker is %s, not SQS", cli.Kind(b))
	}
	if len(cfg.Filter) > 0 || cfg.Limit > 0 {
		return cli.Usagef("--native moves every message as SQS does, server side: it takes no --filter or --limit")
	}
	if cfg.Rate > maxMoveRate || cfg.Rate > 0 && cfg.Rate < 1 || cfg.Rate != float64(int32(cfg.Rate)) {
		return cli.Usagef("--native moves a whole number of messages a second from 1 to %d (SQS's MaxNumberOfMessagesPerSecond), or at the rate SQS picks (no --rate, or 0); got %g", maxMoveRate, cfg.Rate)
	}
	return nil
}

// finishMove fills in what is left and how long the move took.
func finishMove(res Result, start time.Time, left func() Count, err error) (Result, error) {
	res.Left = left()
	res.Elapsed = time.Since(start)
	return res, err
}

// latestMove is the most recent message move task SQS lists for source,
// or nil when it lists none.
func latestMove(ctx context.Context, c *awssqs.Client, source string) (*types.ListMessageMoveTasksResultEntry, error) {
	ctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	out, err := c.ListMessageMoveTasks(ctx, &awssqs.ListMessageMoveTasksInput{SourceArn: aws.String(source), MaxResults: aws.Int32(1)})
	if err != nil {
		return nil, fmt.Errorf("ask SQS how far the message move task got: %w", err)
	}
	if len(out.Results) == 0 {
		return nil, nil
	}
	return &out.Results[0], nil
}

// queueARN is the ARN and URL of the SQS queue name.
func queueARN(ctx context.Context, c *awssqs.Client, name string) (arn, url string, err error) {
	ctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	u, err := c.GetQueueUrl(ctx, &awssqs.GetQueueUrlInput{QueueName: aws.String(name)})
	if err != nil {
		return "", "", fmt.Errorf("queue %s: %w", name, err)
	}
	out, err := c.GetQueueAttributes(ctx, &awssqs.GetQueueAttributesInput{QueueUrl: u.QueueUrl,
		AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameQueueArn}})
	if err != nil {
		return "", "", fmt.Errorf("queue %s: its ARN: %w", name, err)
	}
	return out.Attributes[string(types.QueueAttributeNameQueueArn)], aws.ToString(u.QueueUrl), nil
}
