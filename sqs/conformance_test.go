package sqs_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/consumertest"
	ferrysqs "github.com/ferrymq/ferry/sqs"
)

// TestConformance runs the conformance suite every broker adapter passes
// against ElasticMQ, on standard queues and, for the ordering clauses, FIFO
// queues whose message group is the key.
func TestConformance(t *testing.T) {
	c := newClient(t, nil)
	consumertest.Run(t, &harness{c: c, b: newBroker(t, c), urls: make(map[string]string)})
}

type harness struct {
	c    *awssqs.Client
	b    *ferrysqs.Broker
	urls map[string]string
}

var (
	_ consumertest.Harness         = (*harness)(nil)
	_ consumertest.InFlightCounter = (*harness)(nil)
)

// conformanceLease is the visibility timeout of the lease tests' queues.
const conformanceLease = time.Second

func (h *harness) NewSource(t *testing.T, cfg consumertest.SourceConfig) string {
	vis := 30 * time.Second
	if cfg.Lease > 0 {
		vis = cfg.Lease
	}
	name, url := createQueue(t, h.c, "conf", queueConfig{fifo: cfg.Ordered, visibility: vis})
	h.urls[name] = url
	return name
}

func (h *harness) Publisher(t *testing.T) consumer.Publisher { return h.b }

func (h *harness) NewConsumer(t *testing.T, source string, opts ...consumer.Option) consumer.Consumer {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	l, err := h.b.NewConsumer(ctx, source, opts...)
	if err != nil {
		t.Fatalf("new consumer of %q: %v", source, err)
	}
	return l
}

func (h *harness) AsCheck(m *consumer.Message) error {
	var tm types.Message
	if !m.As(&tm) {
		return errors.New("Message.As(*types.Message) = false")
	}
	rc, _ := strconv.Atoi(tm.Attributes[string(types.MessageSystemAttributeNameApproximateReceiveCount)])
	if aws.ToString(tm.MessageId) != m.ID || rc != m.Deliveries || aws.ToString(tm.ReceiptHandle) == "" {
		return fmt.Errorf("Message.As gave message %s, receive count %d, receipt handle %q for message %s, delivery %d",
			aws.ToString(tm.MessageId), rc, aws.ToString(tm.ReceiptHandle), m.ID, m.Deliveries)
	}
	return nil
}

func (h *harness) InFlight(t *testing.T, source string) int {
	_, inflight, _ := depth(t, h.c, h.urls[source])
	return inflight
}

func (h *harness) Capabilities() consumertest.Capabilities {
	return consumertest.Capabilities{
		Ordered:    true,
		Lease:      conformanceLease,
		Redelivers: true,
		Delays:     true,
		// A body that is not text travels base64-encoded: 4/3 of its size,
		// within SQS's 1 MiB with room for the headers.
		MaxBody: 3 * (ferrysqs.DefaultMaxMessageSize - 4096) / 4,
	}
}

// TestConformanceFIFO runs the whole suite on FIFO queues. The suite
// publishes most messages without a key, which a FIFO queue refuses; its
// publisher here gives each such message a group of its own (its suite id,
// with a prefix), as a caller with no order to keep would, and its
// consumers take that key away again before the suite's handler sees it.
func TestConformanceFIFO(t *testing.T) {
	c := newClient(t, nil)
	consumertest.Run(t, &fifoHarness{harness{c: c, b: newBroker(t, c), urls: make(map[string]string)}})
}

type fifoHarness struct{ harness }

func (h *fifoHarness) NewSource(t *testing.T, cfg consumertest.SourceConfig) string {
	cfg.Ordered = true
	return h.harness.NewSource(t, cfg)
}

func (h *fifoHarness) Publisher(t *testing.T) consumer.Publisher { return ownGroups{h.b} }

// Capabilities: a FIFO queue delays the whole queue, never a message, so
// Publish refuses a NotBefore there.
func (h *fifoHarness) Capabilities() consumertest.Capabilities {
	c := h.harness.Capabilities()
	c.Delays = false
	return c
}

func (h *fifoHarness) NewConsumer(t *testing.T, source string, opts ...consumer.Option) consumer.Consumer {
	return ownGroupsConsumer{h.harness.NewConsumer(t, source, opts...)}
}

const ownGroupPrefix = "own-group-"

type ownGroupsConsumer struct{ c consumer.Consumer }

func (o ownGroupsConsumer) Run(ctx context.Context, h consumer.Handler) error {
	if h == nil {
		return o.c.Run(ctx, nil)
	}
	return o.c.Run(ctx, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if strings.HasPrefix(m.Key, ownGroupPrefix) {
			m.Key = ""
		}
		return h.Handle(ctx, m)
	}))
}

// ownGroups publishes each message without a key in a group of its own.
type ownGroups struct{ p consumer.Publisher }

func (o ownGroups) Publish(ctx context.Context, dest string, msgs ...consumer.Message) error {
	msgs = append([]consumer.Message(nil), msgs...)
	for i := range msgs {
		if msgs[i].Key == "" {
			msgs[i].Key = ownGroupPrefix + msgs[i].Header("ferrytest-id")
		}
	}
	return o.p.Publish(ctx, dest, msgs...)
}
