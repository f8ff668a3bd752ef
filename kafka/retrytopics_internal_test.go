package kafka

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
)

// TestRetryGateDefersInSlicesUntilDue: a record of a retry topic that is
// not due is deferred for the rest of its wait, at most a slice of it; a
// due record, or one without a due time, runs.
func TestRetryGateDefersInSlicesUntilDue(t *testing.T) {
	var ran int
	g := &retryGate{slice: gateSliceFor(6 * time.Second), next: consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		ran++
		return nil
	})}
	if g.slice != 2*time.Second {
		t.Errorf("slice for a loop wedged after 6 s: %s, want a third, 2 s", g.slice)
	}
	if s := gateSliceFor(10 * time.Minute); s != 30*time.Second {
		t.Errorf("slice for the default 10 min: %s, want 30 s", s)
	}
	due := func(d time.Duration) *consumer.Message {
		return &consumer.Message{Headers: map[string]string{HeaderRetryDue: time.Now().Add(d).UTC().Format(time.RFC3339Nano)}}
	}
	var de *consumer.DeferredError
	if err := g.Handle(context.Background(), due(time.Minute)); !errors.As(err, &de) || de.Delay != 2*time.Second {
		t.Errorf("a record due in a minute: %v, want deferred for the 2 s slice", err)
	}
	if err := g.Handle(context.Background(), due(time.Second)); !errors.As(err, &de) || de.Delay > time.Second || de.Delay < 900*time.Millisecond {
		t.Errorf("a record due in a second: %v, want deferred for the rest of that second", err)
	}
	if err := g.Handle(context.Background(), due(-time.Second)); err != nil || ran != 1 {
		t.Errorf("a record due a second ago: %v, ran %d; want it run", err, ran)
	}
	if err := g.Handle(context.Background(), &consumer.Message{}); err != nil || ran != 2 {
		t.Errorf("a record without a due time: %v, ran %d; want it run", err, ran)
	}
}
