package sqs

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/ferrymq/ferry/consumer"
)

var _ consumer.Admin = (*Broker)(nil)

// DefaultMaxDeliveries is the maxReceiveCount of the redrive policy
// CreateSource sets when a SourceConfig names a DeadLetter queue and
// leaves MaxDeliveries 0: SQS itself has no default, and 10 is what its
// console offers.
const DefaultMaxDeliveries = 10

// The retention SQS accepts (MessageRetentionPeriod) and its longest
// visibility timeout.
const (
	minRetention = time.Minute
	maxRetention = 14 * 24 * time.Hour
	maxLease     = 12 * time.Hour
)

// ceilSeconds is d in whole seconds, rounded up: SQS takes seconds, and a
// lease or retention shorter than asked would surprise.
func ceilSeconds(d time.Duration) time.Duration {
	return (d + time.Second - 1) / time.Second
}

// CreateSource creates queue name with cfg ([consumer.Admin]). cfg.FIFO makes
// a FIFO queue (FifoQueue), whose name must end in ".fifo" (else a
// *[consumer.ConfigError]); a name ending so makes a FIFO queue with FIFO
// unset too, SQS having no other kind of that name. cfg.Retention is
// MessageRetentionPeriod,
// in whole seconds rounded up, between a minute and 14 days as SQS allows
// (else a *[consumer.ConfigError]). cfg.Lease is VisibilityTimeout, in whole
// seconds rounded up, at most 12 hours as SQS allows. cfg.Partitions is
// ignored.
//
// cfg.DeadLetter sets a redrive policy to that queue after cfg.MaxDeliveries
// receives ([DefaultMaxDeliveries] when 0). The dead-letter queue is created
// first when it does not exist, of the same kind (a FIFO queue's must be
// FIFO, so its name must end in ".fifo" too) and with no configuration of
// its own: a redrive policy names the queue by ARN, which a queue that does
// not exist has none of, and a caller asking for dead-lettering wants the
// queue it goes to. DeleteSource does not delete it: other queues may
// dead-letter to it.
//
// A queue that exists with the same attributes is not an error; with others
// SQS refuses (QueueAlreadyExists) and so does CreateSource.
func (b *Broker) CreateSource(ctx context.Context, name string, cfg consumer.SourceConfig) error {
	if name == "" {
		return consumer.ConfigErrorf("queue", "must not be empty")
	}
	if b.isClosed() {
		return fmt.Errorf("sqs: create queue %q: %w", name, ErrClosed)
	}
	fifo := cfg.FIFO || strings.HasSuffix(name, ".fifo")
	if fifo && !strings.HasSuffix(name, ".fifo") {
		return consumer.ConfigErrorf("SourceConfig.FIFO", "an SQS FIFO queue's name must end in \".fifo\", got %q", name)
	}
	if cfg.MaxDeliveries < 0 {
		return consumer.ConfigErrorf("SourceConfig.MaxDeliveries", "must be >= 0, got %d", cfg.MaxDeliveries)
	}
	if cfg.MaxDeliveries > 0 && cfg.DeadLetter == "" {
		return consumer.ConfigErrorf("SourceConfig.MaxDeliveries", "needs a DeadLetter queue: SQS counts receives for its redrive policy only")
	}
	if cfg.DeadLetter == name {
		return consumer.ConfigErrorf("SourceConfig.DeadLetter", "must not be the queue itself")
	}
	if cfg.DeadLetter != "" && fifo != strings.HasSuffix(cfg.DeadLetter, ".fifo") {
		return consumer.ConfigErrorf("SourceConfig.DeadLetter", "the dead-letter queue of %q must be FIFO exactly when it is (its name ending in \".fifo\"), got %q", name, cfg.DeadLetter)
	}
	if cfg.Retention != 0 && (cfg.Retention < minRetention || cfg.Retention > maxRetention) {
		return consumer.ConfigErrorf("SourceConfig.Retention", "SQS keeps messages between %v and %v, got %v", minRetention, maxRetention, cfg.Retention)
	}
	if cfg.Lease < 0 || cfg.Lease > maxLease {
		return consumer.ConfigErrorf("SourceConfig.Lease", "an SQS visibility timeout is between 0 and %v, got %v", maxLease, cfg.Lease)
	}
	attrs := map[string]string{}
	if fifo {
		attrs[string(types.QueueAttributeNameFifoQueue)] = "true"
	}
	if cfg.Lease != 0 {
		attrs[string(types.QueueAttributeNameVisibilityTimeout)] = strconv.FormatInt(int64(ceilSeconds(cfg.Lease)), 10)
	}
	if cfg.Retention != 0 {
		attrs[string(types.QueueAttributeNameMessageRetentionPeriod)] = strconv.FormatInt(int64(ceilSeconds(cfg.Retention)), 10)
	}
	if cfg.DeadLetter != "" {
		arn, err := b.deadLetterARN(ctx, cfg.DeadLetter, fifo)
		if err != nil {
			return err
		}
		n := cfg.MaxDeliveries
		if n == 0 {
			n = DefaultMaxDeliveries
		}
		attrs[string(types.QueueAttributeNameRedrivePolicy)] = fmt.Sprintf(`{"deadLetterTargetArn":%q,"maxReceiveCount":"%d"}`, arn, n)
	}
	if err := b.createQueue(ctx, name, attrs); err != nil {
		return err
	}
	// The broker may have looked the queue up before (a Publish to it while
	// it did not exist): what it knew of it is stale.
	b.forget(name)
	return nil
}

// createQueue calls CreateQueue.
func (b *Broker) createQueue(ctx context.Context, name string, attrs map[string]string) error {
	last := &lastAttempt{}
	ctx = context.WithValue(ctx, lastAttemptKey{}, last)
	_, err := b.client.CreateQueue(ctx, &awssqs.CreateQueueInput{QueueName: aws.String(name), Attributes: attrs}, recordAttempts)
	return b.callErr("CreateQueue", name, err, last.get())
}

// deadLetterARN returns the ARN of queue name, creating it (FIFO when fifo)
// when it does not exist.
func (b *Broker) deadLetterARN(ctx context.Context, name string, fifo bool) (string, error) {
	attrs := map[string]string{}
	if fifo {
		attrs[string(types.QueueAttributeNameFifoQueue)] = "true"
	}
	url, err := b.queueURL(ctx, name)
	if err != nil {
		return "", err
	}
	if url == "" {
		if err := b.createQueue(ctx, name, attrs); err != nil {
			return "", fmt.Errorf("sqs: create the dead-letter queue: %w", err)
		}
		if url, err = b.queueURL(ctx, name); err != nil {
			return "", err
		}
	}
	last := &lastAttempt{}
	actx := context.WithValue(ctx, lastAttemptKey{}, last)
	out, err := b.client.GetQueueAttributes(actx, &awssqs.GetQueueAttributesInput{
		QueueUrl: aws.String(url), AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameQueueArn},
	}, recordAttempts)
	if err != nil {
		return "", b.callErr("GetQueueAttributes", name, err, last.get())
	}
	arn := out.Attributes[string(types.QueueAttributeNameQueueArn)]
	if arn == "" {
		return "", fmt.Errorf("sqs: dead-letter queue %q: SQS gave no QueueArn", name)
	}
	return arn, nil
}

// queueURL returns the URL of queue name, or "" when it does not exist.
func (b *Broker) queueURL(ctx context.Context, name string) (string, error) {
	last := &lastAttempt{}
	ctx = context.WithValue(ctx, lastAttemptKey{}, last)
	out, err := b.client.GetQueueUrl(ctx, &awssqs.GetQueueUrlInput{QueueName: aws.String(name)}, recordAttempts)
	if isQueueGone(err) {
		return "", nil
	}
	if err != nil {
		return "", b.callErr("GetQueueUrl", name, err, last.get())
	}
	return aws.ToString(out.QueueUrl), nil
}

// DeleteSource deletes queue name (a name or a queue URL) and its messages
// ([consumer.Admin]). A queue that does not exist is not an error. SQS takes
// up to 60 seconds to forget a deleted queue: a queue of the same name
// created meanwhile may fail (QueueDeletedRecently).
func (b *Broker) DeleteSource(ctx context.Context, name string) error {
	qname, err := queueName(name)
	if err != nil {
		return err
	}
	if b.isClosed() {
		return fmt.Errorf("sqs: delete queue %q: %w", name, ErrClosed)
	}
	url := name
	if qname == name {
		if url, err = b.queueURL(ctx, name); err != nil || url == "" {
			return err
		}
	}
	b.forget(name)
	last := &lastAttempt{}
	ctx = context.WithValue(ctx, lastAttemptKey{}, last)
	_, err = b.client.DeleteQueue(ctx, &awssqs.DeleteQueueInput{QueueUrl: aws.String(url)}, recordAttempts)
	if err == nil || isQueueGone(err) {
		return nil
	}
	if err = b.callErr("DeleteQueue", qname, err, last.get()); errors.Is(err, consumer.ErrSourceNotFound) {
		return nil
	}
	return err
}
