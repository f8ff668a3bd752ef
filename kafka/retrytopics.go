package kafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/ratelog"
	"github.com/ferrymq/ferry/internal/utf8cut"
)

// Headers a record carries on a retry topic (see RetryTopics), beside its
// own headers, key and body. The dead letter of a record that went through
// the retry topics keeps them, so the whole story travels: where it came
// from, how many runs it had, and when it first failed.
const (
	// HeaderRetryTier is the number of the retry tier the record is on: 1
	// for the first retry topic.
	HeaderRetryTier = "ferry-retry-tier"
	// HeaderRetryDue is when the record may run again, RFC 3339 with
	// nanoseconds, UTC: when it was sent to the tier plus the tier's delay.
	HeaderRetryDue = "ferry-retry-due"
	// HeaderRetryAttempts is how many runs the record had before it was
	// sent to this tier, on every topic it went through, in decimal.
	HeaderRetryAttempts = "ferry-retry-attempts"
	// HeaderRetryOriginTopic is the topic the record was first consumed
	// from.
	HeaderRetryOriginTopic = "ferry-retry-origin-topic"
	// HeaderRetryOriginPartition is its partition there, in decimal.
	HeaderRetryOriginPartition = "ferry-retry-origin-partition"
	// HeaderRetryOriginOffset is its offset there, in decimal.
	HeaderRetryOriginOffset = "ferry-retry-origin-offset"
	// HeaderRetryOriginPublishedAt is when Kafka took the record on the
	// topic it was first consumed from, RFC 3339 with nanoseconds, UTC
	// (absent where the record had no timestamp).
	HeaderRetryOriginPublishedAt = "ferry-retry-origin-published-at"
	// HeaderRetryFirstFailure is when the record was first sent to a retry
	// topic (its runs on the origin topic had failed), RFC 3339 with
	// nanoseconds, UTC.
	HeaderRetryFirstFailure = "ferry-retry-first-failure"
	// HeaderRetryError is the last error, cut to 2 KiB.
	HeaderRetryError = "ferry-retry-error"
)

// RetryTopics configures a consumer whose failing records do not hold
// their partition ([Broker.NewRetryingConsumer]), as Spring Kafka's
// retryable topics do. A record whose handler failed, once the handler's
// own retries (a [consumer.Retry] in it) are spent, is published to the
// retry topic of the first tier, and its partition goes on. The tier's
// consumer, of the same handler, runs it once the tier's delay has passed
// since it was sent there; a failure sends it to the next tier, and a
// failure on the last tier to the dead-letter topic, with its story. A
// permanent failure ([consumer.Permanent]) goes to the dead-letter topic
// at once. A record held by an open breaker stays where it is, and so
// does one whose run failed while a breaker of the handler's chain is not
// closed (the failure that opened it, a failed half-open trial: it is
// retried in place): an outage pauses consumption rather than running the
// records through the tiers.
//
// The records behind a record sent to a tier overtake it, and so do later
// records of its key: retry topics give up order, and Ferry makes you say
// so (GiveUpOrder) unless the consumer is [consumer.Unordered]. They run
// on consumer groups (not share groups, whose broker redelivers by
// itself) and at least once (an at-most-once ack before the run would
// lose the records a tier defers). A tier's delay should stay well within
// the retention of its topic.
type RetryTopics struct {
	// Delays are the tiers' delays, in order: one retry topic each. At
	// least one; each above zero, and well within the retry topics'
	// retention.
	Delays []time.Duration
	// DeadLetterTopic is where a record goes whose last tier failed, or
	// which failed permanently, with the headers of [consumer.DeadLetter]
	// beside the HeaderRetry ones. Required.
	DeadLetterTopic string
	// GiveUpOrder says that the records of a partition (or of a key) may
	// run out of their order: required unless the consumer's ordering is
	// consumer.Unordered.
	GiveUpOrder bool
	// TopicName names the retry topic of tier n (1 for the first) of
	// topic. Default topic + ".retry." + n: names that stay when the
	// delays change. Each tier's consumer is named the consumer's name +
	// ".retry." + n.
	TopicName func(topic string, n int) string
}

// RetryingConsumer is a consumer of a topic and of its retry topics: one
// [consumer.Loop] each, run together by Run. Make one with
// [Broker.NewRetryingConsumer].
type RetryingConsumer struct {
	b     *Broker
	topic string
	tiers []retryTier
	loops []*consumer.Loop // the topic's, then one per tier
	dead  *consumer.DeadLetter
	logs  *ratelog.Limiter
	log   *slog.Logger
}

// retryTier is one retry topic and its delay.
type retryTier struct {
	topic string
	delay time.Duration
}

// NewRetryingConsumer returns a consumer of topic whose failing records go
// through the retry topics cfg describes (see RetryTopics) instead of
// holding their partition. opts configure every loop (WithName is
// required; each tier's consumer is named after it). It makes the retry
// topics and the dead-letter topic that do not exist yet, with topic's
// partition count (one when topic does not exist yet), and warns of a
// retry topic with fewer partitions than topic. It fails with a
// *consumer.ConfigError naming the problem: no delays, a delay not above
// zero, no dead-letter topic or topic's own, a share group Broker,
// at-most-once delivery, an ordering kept without GiveUpOrder, or what
// NewConsumer refuses.
func (b *Broker) NewRetryingConsumer(ctx context.Context, topic string, cfg RetryTopics, opts ...consumer.Option) (*RetryingConsumer, error) {
	if b.cfg.protocol == Share {
		return nil, consumer.ConfigErrorf("RetryTopics", "not on a share group Broker: its broker redelivers a record by itself, counting deliveries, and a record waiting in a tier would spend them")
	}
	if len(cfg.Delays) == 0 {
		return nil, consumer.ConfigErrorf("RetryTopics.Delays", "needs at least one tier")
	}
	for i, d := range cfg.Delays {
		if d <= 0 {
			return nil, consumer.ConfigErrorf("RetryTopics.Delays", "tier %d: must be above zero, got %s", i+1, d)
		}
	}
	if cfg.DeadLetterTopic == "" || cfg.DeadLetterTopic == topic {
		return nil, consumer.ConfigErrorf("RetryTopics.DeadLetterTopic", "must be set, and not to the topic consumed (%q)", topic)
	}
	name := cfg.TopicName
	if name == nil {
		name = func(topic string, n int) string { return topic + ".retry." + strconv.Itoa(n) }
	}
	r := &RetryingConsumer{b: b, topic: topic, logs: ratelog.New(5, time.Minute)}
	seen := map[string]bool{topic: true, cfg.DeadLetterTopic: true}
	for i, d := range cfg.Delays {
		t := name(topic, i+1)
		if t == "" || seen[t] {
			return nil, consumer.ConfigErrorf("RetryTopics.TopicName", "tier %d is named %q, which is empty or taken", i+1, t)
		}
		seen[t] = true
		r.tiers = append(r.tiers, retryTier{topic: t, delay: d})
	}
	main, err := b.NewConsumer(ctx, topic, opts...)
	if err != nil {
		return nil, err
	}
	r.loops = []*consumer.Loop{main}
	r.log = b.log.With("topic", topic, "consumer", main.Name())
	fail := func(err error) (*RetryingConsumer, error) {
		discard(r.loops)
		return nil, err
	}
	switch o := main.Ordering(); {
	case main.DeliveryMode() == consumer.AtMostOnce:
		return fail(consumer.ConfigErrorf("RetryTopics", "needs at-least-once delivery: an at-most-once ack before the run would lose every record a retry tier defers"))
	case o != consumer.Unordered && !cfg.GiveUpOrder:
		return fail(consumer.ConfigErrorf("RetryTopics.GiveUpOrder",
			"must be true with ordering %s: a record sent to a retry topic is overtaken by the records behind it; set it, or use consumer.Unordered", o))
	}
	if err := r.makeTopics(ctx, cfg.DeadLetterTopic); err != nil {
		return fail(err)
	}
	for i, t := range r.tiers {
		l, err := b.NewConsumer(ctx, t.topic, slices.Concat(opts, []consumer.Option{consumer.WithName(main.Name() + ".retry." + strconv.Itoa(i+1))})...)
		if err != nil {
			return fail(fmt.Errorf("kafka: consumer of retry topic %q: %w", t.topic, err))
		}
		r.loops = append(r.loops, l)
	}
	// Its MaxAttempts stops no Retry: the tiers count the runs.
	r.dead, err = consumer.NewDeadLetter(b, cfg.DeadLetterTopic, consumer.DeadLetterMaxAttempts(math.MaxInt32), consumer.DeadLetterConsumerName(main.Name()))
	if err != nil {
		return fail(err)
	}
	return r, nil
}

// discard closes the drivers of loops that will never run: a Loop's
// driver is closed by its Run, and a Run on an ended context stops before
// it reaches the cluster.
func discard(loops []*consumer.Loop) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for _, l := range loops {
		_ = l.Run(ctx, consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }))
	}
}

// makeTopics makes the retry topics and the dead-letter topic that do not
// exist, with as many partitions as the consumed topic (one when it does
// not exist yet).
func (r *RetryingConsumer) makeTopics(ctx context.Context, deadLetter string) error {
	names := []string{r.topic, deadLetter}
	for _, t := range r.tiers {
		names = append(names, t.topic)
	}
	md, err := r.b.adm.Metadata(ctx, names...)
	if err != nil {
		return fmt.Errorf("kafka: retry topics of %q: %w", r.topic, wrapAuth(err))
	}
	partitions := int32(1)
	if t, ok := md.Topics[r.topic]; ok && t.Err == nil && len(t.Partitions) > 0 {
		partitions = int32(len(t.Partitions))
	}
	for _, name := range names[1:] {
		if t, ok := md.Topics[name]; ok && t.Err == nil {
			if n := int32(len(t.Partitions)); n < partitions {
				r.log.Warn("ferry/kafka: a topic for retries has fewer partitions than the topic, so fewer of its records run at once",
					"retries_topic", name, "partitions", n, "topic_partitions", partitions)
			}
			continue
		}
		if err := r.b.CreateTopic(ctx, name, TopicConfig{Partitions: partitions}); err != nil {
			return fmt.Errorf("kafka: retry topics of %q: %w", r.topic, err)
		}
		r.log.Info("ferry/kafka: made a topic for retries", "made", name, "partitions", partitions)
	}
	return nil
}

// Loops returns the consumer's loops: the topic's first, then one per
// tier, for their Health, Lag and Stats. A tier's lag counts the records
// that wait for their delay.
func (r *RetryingConsumer) Loops() []*consumer.Loop { return r.loops }

// Topics returns the retry topics, tier by tier.
func (r *RetryingConsumer) Topics() []string {
	out := make([]string, len(r.tiers))
	for i, t := range r.tiers {
		out[i] = t.topic
	}
	return out
}

// DeadLetter returns the DeadLetter that publishes to the dead-letter
// topic, for its counts.
func (r *RetryingConsumer) DeadLetter() *consumer.DeadLetter { return r.dead }

// Run runs h on the topic and on every retry topic until ctx ends, each
// loop as [consumer.Loop.Run] does, and returns when all have stopped. A
// loop that fails stops the others; Run returns the errors, each naming
// its topic. Give h the middleware of its own (Retry, a Breaker, a
// Timeout...), but no DeadLetter: RetryingConsumer dead-letters, with the
// story of every topic the record went through, and refuses a chain that
// holds one with a *consumer.ConfigError. The topic's loop reports the
// chain's middleware in its Health and metrics (the dead letters too);
// the tiers' loops report their own figures only.
func (r *RetryingConsumer) Run(ctx context.Context, h consumer.Handler) error {
	parts, err := consumer.Inspect(h)
	if err != nil {
		return err
	}
	if len(parts.DeadLetters) > 0 {
		return consumer.ConfigErrorf("Handler", "holds a DeadLetter: a retrying consumer dead-letters itself, to RetryTopics.DeadLetterTopic, once a record's tiers are spent (one in the handler would dead-letter from a tier, without the record's story); use consumer.Retry, a Breaker and the others without it")
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make([]error, len(r.loops))
	var wg sync.WaitGroup
	for i, l := range r.loops {
		hop := &retryHop{r: r, tier: i, next: h, breakers: parts.Breakers}
		var run consumer.Handler = &chainView{retryHop: hop, view: r.dead.Wrap(h)}
		topic := r.topic
		if i > 0 {
			// The tiers' loops see no middleware: theirs is the topic's,
			// counted and judged there once.
			run = &retryGate{next: hop, slice: gateSliceFor(l.WedgedAfter())}
			topic = r.tiers[i-1].topic
		}
		wg.Go(func() {
			if err := l.Run(ctx, run); err != nil {
				errs[i] = fmt.Errorf("kafka: consumer of %q: %w", topic, err)
				cancel()
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// retryHop runs next, a record's handler on the topic or on tier (0 for
// the topic itself), and sends a record whose run failed to the next tier,
// or from the last to the dead-letter topic.
type retryHop struct {
	r        *RetryingConsumer
	tier     int
	next     consumer.Handler
	breakers []*consumer.Breaker // those of next's chain
}

// chainView is the topic's retryHop as its loop looks down the chain: the
// handler it runs, as r.dead wraps it, so that the loop counts the dead
// letters with the chain's own middleware (Health, metrics). The view is
// never run: a DeadLetter around the handler would dead-letter a failure
// itself, without the story of the topics the record went through.
type chainView struct {
	*retryHop
	view consumer.Handler
}

// Unwrap returns the handler the hop runs, as the dead letter wraps it.
func (c *chainView) Unwrap() consumer.Handler { return c.view }

// Handle runs the record and judges its failure.
func (h *retryHop) Handle(ctx context.Context, m *consumer.Message) error {
	err := h.next.Handle(ctx, m)
	switch {
	case err == nil, consumer.IsHeld(err), consumer.IsDeferred(err):
		return err // done, or not run: it stays here
	case errors.Is(ctx.Err(), context.Canceled):
		return err // the consumer stops or lost the partition: back to Kafka
	}
	var dle *consumer.DeadLetterError
	if errors.As(err, &dle) {
		return err // a dead letter that could not be published: it comes back
	}
	story, first := h.story(m)
	if consumer.IsPermanent(err) {
		return h.r.dead.Send(ctx, story, err, first)
	}
	for _, b := range h.breakers {
		if b.State() != consumer.BreakerClosed {
			// The failure that opened it, or a failed half-open trial:
			// what it protects is down, and the record stays here
			// (retried in place; held while it is open) rather than
			// spend its tiers during the outage.
			return err
		}
	}
	if h.tier == len(h.r.tiers) {
		return h.r.dead.Send(ctx, story, err, first)
	}
	return h.r.forward(ctx, m, story, h.tier, err)
}

// story is m as its dead letter tells it: from the topic it was first
// consumed from, with every run it had, and when it first failed (zero
// on the topic itself: the runs seen tell).
func (h *retryHop) story(m *consumer.Message) (*consumer.Message, time.Time) {
	s := *m
	if h.tier == 0 {
		return &s, time.Time{}
	}
	prior, _ := strconv.Atoi(m.Headers[HeaderRetryAttempts])
	s.Attempt += max(prior, 0)
	if t := m.Headers[HeaderRetryOriginTopic]; t != "" {
		s.Source = t
		s.Lane = m.Headers[HeaderRetryOriginPartition]
		if o, err := strconv.ParseInt(m.Headers[HeaderRetryOriginOffset], 10, 64); err == nil {
			s.Offset = o
		}
		s.PublishedAt = time.Time{}
		if at, err := time.Parse(time.RFC3339Nano, m.Headers[HeaderRetryOriginPublishedAt]); err == nil {
			s.PublishedAt = at
		}
	}
	first, _ := time.Parse(time.RFC3339Nano, m.Headers[HeaderRetryFirstFailure])
	return &s, first
}

// forward publishes m to the retry topic after tier (0: the first), with
// its story in the HeaderRetry headers; once Kafka has it, m is done here.
func (r *RetryingConsumer) forward(ctx context.Context, m, story *consumer.Message, tier int, cause error) error {
	if ra, ok := cause.(*consumer.RetryAfterError); ok {
		cause = ra.Err // a Retry's way of giving the record back, not the story
	}
	to := r.tiers[tier]
	now := time.Now()
	hs := make(map[string]string, len(m.Headers)+8)
	maps.Copy(hs, m.Headers)
	hs[HeaderRetryTier] = strconv.Itoa(tier + 1)
	hs[HeaderRetryDue] = now.Add(to.delay).UTC().Format(time.RFC3339Nano)
	hs[HeaderRetryAttempts] = strconv.Itoa(max(story.Attempt, 1))
	hs[HeaderRetryError] = utf8cut.Cut(cause.Error(), 2<<10)
	if tier == 0 {
		hs[HeaderRetryOriginTopic] = m.Source
		hs[HeaderRetryOriginPartition] = m.Lane
		hs[HeaderRetryOriginOffset] = strconv.FormatInt(m.Offset, 10)
		hs[HeaderRetryFirstFailure] = now.UTC().Format(time.RFC3339Nano)
		if !m.PublishedAt.IsZero() {
			hs[HeaderRetryOriginPublishedAt] = m.PublishedAt.UTC().Format(time.RFC3339Nano)
		}
	}
	msg := consumer.Message{ID: m.ID, Key: m.Key, Body: m.Body, Headers: hs}
	if err := r.b.Publish(ctx, to.topic, msg); err != nil {
		if ok, left := r.logs.Allow("failed"); ok {
			r.log.Error("ferry/kafka: a failed record could not be sent to its retry topic; it runs again where it is",
				"retry_topic", to.topic, "source", m.Source, "partition", m.Lane, "offset", m.Offset, "err", err, "unlogged", left)
		}
		return fmt.Errorf("kafka: send to retry topic %q: %w (handler error: %w)", to.topic, err, cause)
	}
	if ok, left := r.logs.Allow("forwarded"); ok {
		r.log.Warn("ferry/kafka: a record's runs failed; sent to a retry topic, and its partition goes on",
			"retry_topic", to.topic, "tier", tier+1, "delay", to.delay, "source", m.Source, "partition", m.Lane, "offset", m.Offset,
			"attempts", story.Attempt, "err", cause, "unlogged", left)
	}
	return nil
}

// retryGate defers a record of a retry topic until it is due
// (HeaderRetryDue), then runs next.
type retryGate struct {
	next  consumer.Handler
	slice time.Duration // the longest one deferral (gateSliceFor)
}

// Unwrap returns the handler it runs, for the loop's look at the chain.
func (g *retryGate) Unwrap() consumer.Handler { return g.next }

// gateSliceFor is the longest a record waits for its time before the
// gate looks again, in a loop judged wedged after wedgedAfter without
// progress (WithWedgedAfter): each look is progress, so a tier whose
// records wait out a long delay is not taken for wedged. 30 s at most,
// a third of wedgedAfter when that is shorter.
func gateSliceFor(wedgedAfter time.Duration) time.Duration {
	return max(min(30*time.Second, wedgedAfter/3), 10*time.Millisecond)
}

// errNotDue is why a record of a retry topic waits.
var errNotDue = errors.New("kafka: the record's retry delay has not passed")

// Handle defers m until its due time, or runs it. A record without a due
// time (published to the retry topic by something else) runs at once.
func (g *retryGate) Handle(ctx context.Context, m *consumer.Message) error {
	if due, err := time.Parse(time.RFC3339Nano, m.Headers[HeaderRetryDue]); err == nil {
		if wait := time.Until(due); wait > 0 {
			return consumer.Defer(errNotDue, min(wait, g.slice))
		}
	}
	return g.next.Handle(ctx, m)
}
