package dlqcmd

import (
	"context"
	"errors"
	"fmt"
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
// them (the queues whose redrive policy dead-lettered them). It shows the
// task's progress as Redrive does, and cancels the task when ctx ends
// (CancelMessageMoveTask): what moved stays moved. A moved message is the
// dead letter as it is, its ferry-dlq-* story and id included: SQS moves
// it whole, with no filter, limit or header of Ferry's, which is why
// Filter and Limit are refused. cfg.Rate, when set, is the task's rate,
// from 1 to 500 a second.
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
	task, err := c.StartMessageMoveTask(ctx, in)
	if err != nil {
		return res, fmt.Errorf("start a message move task from %s: %w", cfg.Destination, err)
	}
	where := cfg.To
	if where == "" {
		where = "their SQS sources"
	}
	t := time.NewTicker(movePoll)
	defer t.Stop()
	for {
		st, err := moveStatus(context.WithoutCancel(ctx), c, src, aws.ToString(task.TaskHandle))
		if err != nil {
			return finishMove(res, start, left, err)
		}
		res.Moved = int(st.ApproximateNumberOfMessagesMoved)
		res.To = map[string]int{where: res.Moved}
		bar.show(res)
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
		select {
		case <-ctx.Done():
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), opTimeout)
			out, err := c.CancelMessageMoveTask(cctx, &awssqs.CancelMessageMoveTaskInput{TaskHandle: task.TaskHandle})
			cancel()
			var ended *types.ResourceNotFoundException
			switch {
			case err == nil:
				res.Moved = int(out.ApproximateNumberOfMessagesMoved)
				res.To = map[string]int{where: res.Moved}
			case errors.As(err, &ended):
				// The task ended before the cancel came: say how far.
				if st, err := moveStatus(context.WithoutCancel(ctx), c, src, aws.ToString(task.TaskHandle)); err == nil {
					res.Moved = int(st.ApproximateNumberOfMessagesMoved)
					res.To = map[string]int{where: res.Moved}
					if aws.ToString(st.Status) == "COMPLETED" {
						return finishMove(res, start, left, nil)
					}
				}
			default:
				return finishMove(res, start, left, fmt.Errorf("cancel the message move task (it may go on): %w", err))
			}
			res.Interrupted = true
			return finishMove(res, start, left, nil)
		case <-t.C:
		}
	}
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
	if cfg.Rate > maxMoveRate || cfg.Rate > 0 && cfg.Rate < 1 {
		return cli.Usagef("--native moves from 1 to %d messages a second (SQS's MaxNumberOfMessagesPerSecond), or with no limit (--rate 0); got %g", maxMoveRate, cfg.Rate)
	}
	return nil
}

// finishMove fills in what is left and how long the move took.
func finishMove(res Result, start time.Time, left func() Count, err error) (Result, error) {
	res.Left = left()
	res.Elapsed = time.Since(start)
	return res, err
}

// moveStatus is the state of the move task handle from source: the most
// recent task SQS lists for it, which is the one it started last.
func moveStatus(ctx context.Context, c *awssqs.Client, source, handle string) (types.ListMessageMoveTasksResultEntry, error) {
	ctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	out, err := c.ListMessageMoveTasks(ctx, &awssqs.ListMessageMoveTasksInput{SourceArn: aws.String(source), MaxResults: aws.Int32(1)})
	if err != nil {
		return types.ListMessageMoveTasksResultEntry{}, fmt.Errorf("ask SQS how far the message move task got: %w", err)
	}
	if len(out.Results) == 0 {
		return types.ListMessageMoveTasksResultEntry{}, fmt.Errorf("SQS lists no message move task of %s", source)
	}
	r := out.Results[0]
	if h := aws.ToString(r.TaskHandle); h != "" && h != handle {
		return r, fmt.Errorf("another message move task of %s started since this one (%s)", source, h)
	}
	return r, nil
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
