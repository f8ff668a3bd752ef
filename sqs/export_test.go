package sqs

import (
	"context"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/ferrymq/ferry/consumer/driver"
)

// SetMaxVisibility shortens the visibility limit after one receive (SQS's
// 12 hours) of a driver made by Broker.Driver, so that a test can reach it.
// Call it before the driver is used.
func SetMaxVisibility(d driver.Driver, v time.Duration) { d.(*sqsDriver).maxVis = v }

// Buffer puts messages into a driver's buffer of received messages, as if
// a receive had brought them age ago, for the next Fetch to hand over. It
// looks the queue up first.
func Buffer(ctx context.Context, d driver.Driver, msgs []types.Message, age time.Duration) error {
	sd := d.(*sqsDriver)
	q, err := sd.info(ctx)
	if err != nil {
		return err
	}
	at := time.Now().Add(-age)
	sd.mu.Lock()
	defer sd.mu.Unlock()
	for _, m := range msgs {
		r := &receipt{handle: aws.ToString(m.ReceiptHandle), msg: m, receivedAt: at, leaseStart: at}
		p := pending{r: r, m: driver.Message{Handle: r}}
		_ = decode(q, &m, &p.m)
		sd.buf = append(sd.buf, p)
	}
	return nil
}
