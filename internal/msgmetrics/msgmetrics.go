// Package msgmetrics holds the instruments of the OpenTelemetry messaging
// semantic conventions that more than one package records: the duration of
// client operations (publish, receive, settle) and of processing, and the
// count of messages sent. The consumer loop and every broker's Publish use
// them, so that the same name carries the same attributes everywhere.
package msgmetrics

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// Names of the instruments, as the messaging semantic conventions give them.
const (
	ProcessDuration   = "messaging.process.duration"
	OperationDuration = "messaging.client.operation.duration"
	SentMessages      = "messaging.client.sent.messages"
)

// Boundaries are the bucket boundaries, in seconds, that the conventions
// advise for the messaging durations.
var Boundaries = []float64{0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10}

// Attribute keys the conventions require or recommend.
const (
	KeySystem        = attribute.Key("messaging.system")
	KeyOperationName = attribute.Key("messaging.operation.name")
	KeyOperationType = attribute.Key("messaging.operation.type")
	KeyDestination   = attribute.Key("messaging.destination.name")
	KeyGroup         = attribute.Key("messaging.consumer.group.name")
	KeyErrorType     = attribute.Key("error.type")
)

// Duration returns the histogram named name, in seconds with Boundaries.
func Duration(m metric.Meter, name, desc string) (metric.Float64Histogram, error) {
	return m.Float64Histogram(name, metric.WithDescription(desc), metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(Boundaries...))
}

// Publisher records a broker's publish calls: their duration and the
// messages they sent, with error.type on a failure.
type Publisher struct {
	dur    metric.Float64Histogram
	sent   metric.Int64Counter
	system attribute.KeyValue
	ok     sync.Map // destination → *sentOpts: the attributes of a success, made once
	oks    atomic.Int32
}

// sentOpts are a success's attributes for one destination, as options of
// both instruments. Made once: building an attribute set (copy, sort,
// dedupe) on every call cost more than the call's recording, and passing
// prepared slices to Record and Add costs no allocation.
type sentOpts struct {
	rec []metric.RecordOption
	add []metric.AddOption
}

// maxCachedDestinations bounds how many destinations' attributes a
// Publisher keeps; beyond it, they are built per call.
const maxCachedDestinations = 1024

// NewPublisher returns a Publisher recording through mp for the broker
// named system (OpenTelemetry's messaging.system: "kafka", "aws_sqs",
// "rabbitmq"). With a no-op provider it records nothing and costs nearly
// nothing.
func NewPublisher(mp metric.MeterProvider, system string) (*Publisher, error) {
	m := mp.Meter("github.com/ferrymq/ferry")
	dur, err := Duration(m, OperationDuration, "Duration of messaging operations: publish, receive and settle calls.")
	if err != nil {
		return nil, err
	}
	sent, err := m.Int64Counter(SentMessages, metric.WithDescription("Messages a producer attempted to send to the broker."),
		metric.WithUnit("{message}"))
	if err != nil {
		return nil, err
	}
	return &Publisher{dur: dur, sent: sent, system: KeySystem.String(system)}, nil
}

// Record records one publish call of n messages to destination that began
// at start and ended with err (nil for success).
func (p *Publisher) Record(ctx context.Context, destination string, n int, start time.Time, err error) {
	if p == nil {
		return
	}
	o := p.opts(destination, err)
	p.dur.Record(ctx, time.Since(start).Seconds(), o.rec...)
	p.sent.Add(ctx, int64(n), o.add...)
}

// opts returns the options of a call to destination that ended with err.
func (p *Publisher) opts(destination string, err error) *sentOpts {
	if err == nil {
		if o, ok := p.ok.Load(destination); ok {
			return o.(*sentOpts)
		}
	}
	attrs := []attribute.KeyValue{p.system, KeyOperationName.String("send"), KeyOperationType.String("send"),
		KeyDestination.String(destination)}
	if err != nil {
		attrs = append(attrs, KeyErrorType.String(ErrorType(err)))
	}
	set := metric.WithAttributeSet(attribute.NewSet(attrs...))
	o := &sentOpts{rec: []metric.RecordOption{set}, add: []metric.AddOption{set}}
	if err == nil && p.oks.Load() < maxCachedDestinations {
		if _, loaded := p.ok.LoadOrStore(destination, o); !loaded {
			p.oks.Add(1)
		}
	}
	return o
}

// ErrorType is the error.type of err: "timeout" for a deadline, "canceled"
// for a cancelled context, else InnermostType (a bounded set: the types the
// code returns).
func ErrorType(err error) string {
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, context.Canceled):
		return "canceled"
	}
	return InnermostType(err)
}

// InnermostType returns the Go type of the innermost error of err's chain,
// following the first branch of a joined error.
func InnermostType(err error) string {
	for {
		var next error
		switch u := err.(type) {
		case interface{ Unwrap() error }:
			next = u.Unwrap()
		case interface{ Unwrap() []error }:
			if errs := u.Unwrap(); len(errs) > 0 {
				next = errs[0]
			}
		}
		if next == nil {
			return fmt.Sprintf("%T", err)
		}
		err = next
	}
}
