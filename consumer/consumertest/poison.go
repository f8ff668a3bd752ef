package consumertest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
)

// testPoisonMix: the Standard stack, with idempotency, over traffic that has
// everything at once: transient failures, poison messages that fail with a
// plain error (a bug) and with a permanent one (bad input), and duplicates.
// Every good message has its effect exactly once, every poison message
// reaches the dead-letter destination with its reason and no good one does,
// and the breaker never opens (one message failing run after run is no
// outage). How long the mix took with and without the breaker is logged, not
// compared: a broker's redelivery times vary too much under load to hold a
// test to them (an SQS return once took 30 s instead of 1 s here), and the
// breaker's own count says whether it opened.
func testPoisonMix(s *suite) {
	without := s.poisonMix("nobreaker", false)
	with := s.poisonMix("breaker", true)
	s.t.Logf("the mix took %s with the breaker, %s without", with.Round(time.Millisecond), without.Round(time.Millisecond))
}

const (
	mixGood        = 300
	mixPoisons     = 3 // of each kind
	mixDuplicates  = 6 // good messages published twice
	mixTransientAt = 20
)

var errConstraint = errors.New("consumertest: constraint violated (a poison message)")

// poisonMix runs the mix once, with or without the Standard stack's
// breaker, checks what it must, and returns how long it took until every
// good message had its effect and every poison one was dead-lettered.
func (s *suite) poisonMix(name string, withBreaker bool) time.Duration {
	s.t.Helper()
	src, dlq := s.source(SourceConfig{}), s.source(SourceConfig{})
	var msgs []consumer.Message
	for i := range mixGood {
		msgs = append(msgs, message(fmt.Sprintf("good-%d", i)))
	}
	for i := range mixDuplicates {
		msgs = append(msgs, message(fmt.Sprintf("good-%d", i*mixGood/mixDuplicates)))
	}
	for i := range mixPoisons {
		msgs = append(msgs, message(fmt.Sprintf("plain-%d", i)), message(fmt.Sprintf("permanent-%d", i)))
	}
	// Spread the poison and the duplicates through the good traffic.
	for i := range msgs {
		j := (i * 7919) % len(msgs)
		msgs[i], msgs[j] = msgs[j], msgs[i]
	}
	s.publish(src, msgs...)

	quietLog := slog.New(slog.DiscardHandler)
	stack, err := consumer.Standard(s.pub, dlq,
		consumer.StandardRetry(consumer.RetryInitial(5*time.Millisecond), consumer.RetryMaxInterval(50*time.Millisecond),
			consumer.RetryRedeliveryMax(300*time.Millisecond)),
		consumer.StandardDeadLetter(consumer.DeadLetterMaxAttempts(5), consumer.DeadLetterLogger(quietLog)))
	if err != nil {
		s.t.Fatal(err)
	}
	breaker := stack.Breaker
	if !withBreaker {
		stack.Breaker = nil
	}
	dedup, err := idempotency.New(idempotency.NewMemoryStore(), name, idempotency.WithKey(idempotency.KeyFromHeader(idHeader)),
		idempotency.WithLogger(quietLog))
	if err != nil {
		s.t.Fatal(err)
	}

	var mu sync.Mutex
	effects := map[string]int{}
	runs := map[string]int{}
	work := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		id := m.Header(idHeader)
		mu.Lock()
		defer mu.Unlock()
		runs[id]++
		switch {
		case strings.HasPrefix(id, "plain-"):
			return errConstraint
		case strings.HasPrefix(id, "permanent-"):
			return consumer.Permanent(errConstraint)
		}
		if n, _ := strconv.Atoi(strings.TrimPrefix(id, "good-")); n%mixTransientAt == 7 && runs[id] == 1 {
			return errors.New("consumertest: a transient failure")
		}
		effects[id]++
		return nil
	})
	start := time.Now()
	s.start(name, src, grace, stack.Wrap(dedup.Wrap(work)).Handle)

	var dead recorder
	s.start(name+"-dlq", dlq, grace, dead.handler(name+"-dlq", nil))
	allDone := func() bool {
		if dead.distinct() < 2*mixPoisons {
			return false
		}
		mu.Lock()
		defer mu.Unlock()
		return len(effects) == mixGood
	}
	s.waitUpTo(3*time.Minute, fmt.Sprintf("(%s) every good message's effect and every poison message in the dead-letter destination", name), allDone)
	took := time.Since(start)

	s.watch(s.settleWindow(), func() error {
		mu.Lock()
		defer mu.Unlock()
		for id, n := range effects {
			if n != 1 {
				return fmt.Errorf("(%s) %s had its effect %d times, want once", name, id, n)
			}
		}
		return nil
	})
	for i := range mixPoisons {
		for kind, reason := range map[string]string{"plain": "max-attempts", "permanent": "permanent"} {
			id := fmt.Sprintf("%s-%d", kind, i)
			ds := dead.of(id)
			if len(ds) == 0 {
				s.t.Errorf("(%s) %s is not in the dead-letter destination", name, id)
				continue
			}
			if got := ds[0].headers[consumer.HeaderDLQReason]; got != reason {
				s.t.Errorf("(%s) %s dead-lettered with reason %q, want %q", name, id, got, reason)
			}
		}
	}
	if n := dead.distinct(); n != 2*mixPoisons {
		s.t.Errorf("(%s) %d distinct messages in the dead-letter destination, want only the %d poison ones", name, n, 2*mixPoisons)
	}
	if withBreaker && breaker.Opened() != 0 {
		s.t.Errorf("the breaker opened %d times: poison messages and transient failures opened it for everyone", breaker.Opened())
	}
	return took
}
