// Package consumertest is the conformance suite that every Ferry broker
// driver passes: the memory broker in its unit tests, the Kafka, SQS and
// RabbitMQ adapters against real brokers in their own packages, and any
// driver a user writes. A new broker is done when it passes the suite.
//
// # What it checks
//
// The suite checks the contract of a consumer.Consumer as a user sees it:
// only by publishing messages, running a handler and watching what the
// handler is given (message ids, bodies, attempts, timing). It knows nothing
// of any broker, so the same tests hold every driver to the same guarantees:
//
//   - every message is delivered, once, when handlers succeed;
//   - a failed handler's message comes back, with the same ID and the next
//     Attempt, until it succeeds, and then never again;
//   - a message returned with consumer.RetryAfter(err, d) does not come back
//     before d;
//   - in at-most-once mode no message is delivered twice, even when its
//     handler fails or panics;
//   - on an ordered source (SQS FIFO groups, Kafka partitions) each key's
//     messages complete one at a time in publish order while several
//     handlers run, by lane and with consumer.OrderByKey;
//   - a consumer never runs more handlers than its concurrency, nor holds
//     more unacknowledged messages than consumer.WithMaxInFlight;
//   - a handler that runs three times the lease keeps its message: a second
//     consumer polling the same source never gets it;
//   - cancelling Run while a handler runs past the shutdown grace loses
//     nothing, and a handler that finishes within the grace is acked;
//   - a panic is redelivered and Run carries on;
//   - bodies (every byte value, empty, 1 MiB), keys and unicode headers
//     arrive as published;
//   - two consumers of one source never handle the same message at once,
//     nor again after one of them handled it successfully;
//   - Run returns nil soon after its context ends, and an error for a nil
//     handler;
//   - a consumer.Hold does not count as an attempt;
//   - a consumer stopped gracefully runs what it fetched instead of handing
//     it back (each hand-back would count as a delivery);
//   - Message.As reaches the broker's own delivery ([Harness.AsCheck]) and
//     refuses a type it does not know;
//   - a message published with a NotBefore ahead is not handled before it
//     (where [Capabilities].Delays), or is refused with
//     consumer.ErrDelayNotSupported while the rest of the call is published
//     (where not).
//
// Each check is a subtest named after its clause, such as
// HandlerErrorRedeliversWithNextAttempt, and runs on a fresh source. Waits
// for something that must happen are bounded (30 s), and watches for
// something that must not happen last a second or two, or the short lease
// and a second more, so the suite is slow only when the driver is wrong. On
// the memory broker it takes about 20 s under -race.
//
// # Running it for an adapter
//
// Write a [Harness]: methods that create a fresh source, hand out a
// Publisher, build a Consumer over a source with the suite's options, check
// Message.As against the broker's own delivery, and say what the broker can
// do. Then call [Run] from a test. The Kafka adapter's harness, shortened
// (kafka/conformance_test.go has it whole; memory, sqs and rabbit have
// theirs in the same file name):
//
//	func TestConformance(t *testing.T) {
//		b, err := kafka.New(testenv.RequireKafka(t))
//		if err != nil {
//			t.Fatal(err)
//		}
//		t.Cleanup(func() { b.Close() })
//		consumertest.Run(t, &harness{b: b})
//	}
//
//	type harness struct{ b *kafka.Broker }
//
//	func (h *harness) NewSource(t *testing.T, cfg consumertest.SourceConfig) string {
//		topic := testenv.UniqueName(t, "conformance")
//		if err := h.b.CreateTopic(context.Background(), topic, kafka.TopicConfig{Partitions: 4}); err != nil {
//			t.Fatal(err)
//		}
//		t.Cleanup(func() { h.b.DeleteTopic(context.Background(), topic) })
//		return topic
//	}
//
//	func (h *harness) Publisher(t *testing.T) consumer.Publisher { return h.b }
//
//	func (h *harness) NewConsumer(t *testing.T, source string, opts ...consumer.Option) consumer.Consumer {
//		// every consumer of a source in one group
//		c, err := h.b.NewConsumer(t.Context(), source, append(opts, consumer.WithName(source+"-group"))...)
//		if err != nil {
//			t.Fatal(err)
//		}
//		return c
//	}
//
//	func (h *harness) AsCheck(m *consumer.Message) error {
//		var r *kgo.Record
//		if !m.As(&r) || r.Offset != m.Offset {
//			return errors.New("Message.As does not reach the *kgo.Record")
//		}
//		return nil
//	}
//
//	func (h *harness) Capabilities() consumertest.Capabilities {
//		// A log: no lease, no redelivery by the broker, ordered partitions.
//		return consumertest.Capabilities{Ordered: true}
//	}
//
// Run it like any test: go test -race -run TestConformance ./yourpackage,
// or one clause with -run 'TestConformance/RetryAfter'. A failure names the
// clause, what was expected and what the handler saw; the loop's own logs
// are in the test output (shown with -v or on failure).
//
// A harness whose broker can count a source's unacknowledged messages may
// also implement [InFlightCounter], and the in-flight test then checks that
// count too. The memory broker's harness in memory/conformance_test.go is a
// complete, short example.
//
// The suite runs its subtests one after another, never in parallel: several
// of them watch timing, and a loaded machine running many brokers at once is
// where flaky suites come from.
package consumertest
