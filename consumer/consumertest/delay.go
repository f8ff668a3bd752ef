package consumertest

import (
	"context"
	"errors"
	"time"

	"github.com/ferrymq/ferry/consumer"
)

// delayAhead is how far ahead the delay clause sets a message's NotBefore:
// past a second, so that SQS's whole seconds are tested, and short enough
// for the suite.
const delayAhead = 3 * time.Second

// testNotBefore: a message published with a NotBefore ahead is never handled
// before that time, and a message of the same call without one is handled
// at once; a broker that cannot hold a message (Capabilities.Delays false)
// refuses it in a *consumer.PublishError wrapping
// consumer.ErrDelayNotSupported, publishes the other, and never delivers
// the refused one.
func testNotBefore(s *suite) {
	src := s.source(SourceConfig{})
	var rec recorder
	s.start("consumer", src, grace, rec.handler("consumer", nil))
	msgs := messages("delay", 2)
	notBefore := time.Now().Add(delayAhead)
	msgs[1].NotBefore = notBefore
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if s.pub == nil {
		s.pub = s.h.Publisher(s.t)
	}
	err := s.pub.Publish(ctx, src, msgs...)
	if !s.caps.Delays {
		var perr *consumer.PublishError
		if !errors.As(err, &perr) || len(perr.Failed) != 1 || perr.Failed[0].Index != 1 || !errors.Is(perr.Failed[0].Err, consumer.ErrDelayNotSupported) {
			s.t.Fatalf("Publish of a message with NotBefore on a broker that cannot delay = %v; want a *consumer.PublishError failing index 1 alone, wrapping consumer.ErrDelayNotSupported", err)
		}
		s.waitFor("the message without NotBefore handled", func() bool { return len(rec.of("delay-0")) > 0 })
		s.watch(delayAhead+time.Second, func() error {
			if len(rec.of("delay-1")) > 0 {
				return errors.New("the refused delayed message was delivered")
			}
			return nil
		})
		return
	}
	if err != nil {
		s.t.Fatalf("Publish with a NotBefore %s ahead: %v", delayAhead, err)
	}
	s.waitFor("the message without NotBefore handled", func() bool { return len(rec.of("delay-0")) > 0 })
	s.waitFor("the delayed message handled", func() bool { return len(rec.of("delay-1")) > 0 })
	// The broker's clock and the suite's may differ by a hair (the memory
	// broker holds a monotonic delay): a few milliseconds early is the same
	// time.
	if d := rec.of("delay-1")[0]; d.start.Before(notBefore.Add(-5 * time.Millisecond)) {
		s.t.Errorf("the delayed message was handled %s before its NotBefore", notBefore.Sub(d.start))
	}
}
