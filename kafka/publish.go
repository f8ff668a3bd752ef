package kafka

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kbin"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
)

// Publish sends msgs to topic and returns nil once all in-sync replicas
// have every record (acks=all, idempotent producer). Key is the record key
// and picks the partition as the Java client does (murmur2), so Ferry and
// Java producers agree; an empty Key is no key (records spread over
// partitions). Headers become record headers; ID, when set, travels in the
// header HeaderMessageID. Records of one key are produced in the order given,
// within a call and across calls.
//
// Records the cluster refused are reported in a *[consumer.PublishError],
// each wrapping franz-go's error (kerr errors match with errors.Is). The
// cluster refuses whole batches: a record it refuses (larger than the
// topic's max.message.bytes, say) fails the records of its partition sent
// in the same batch with it, which may be records of other calls made at
// the same time (the producer lingers to batch them), and each call
// reports its own. Each record is checked before it is sent (its size
// counted as franz-go counts it), and the records of one key are sent
// one after another: a record that fails, refused here (larger than the
// producer's batch limit) or by the cluster, fails every later record of
// its key in the call, without sending them. A record with a NotBefore still
// ahead is refused so, wrapping [consumer.ErrDelayNotSupported]: Kafka has
// no delayed delivery. Publish returns when ctx ends, whatever its records
// wait for (a partition without a leader, too few in-sync replicas), with
// an error matching ctx's and, where the client saw it, why; its records
// may still be written after that (see the package doc).
func (b *Broker) Publish(ctx context.Context, topic string, msgs ...consumer.Message) error {
	start := time.Now()
	err := b.publish(ctx, topic, msgs)
	if len(msgs) > 0 {
		b.metrics.Record(ctx, topic, len(msgs), start, err)
	}
	return err
}

func (b *Broker) publish(ctx context.Context, topic string, msgs []consumer.Message) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if b.isClosed() {
		return fmt.Errorf("kafka: publish to %q: %w", topic, ErrClosed)
	}
	if topic == "" {
		return consumer.ConfigErrorf("topic", "must not be empty")
	}
	if len(msgs) == 0 {
		return nil
	}
	if err := b.checkAccess(ctx); err != nil {
		return fmt.Errorf("kafka: publish to %q: %w", topic, err)
	}
	maxBytes := b.maxRecordFor(topic)
	start := time.Now()
	var (
		failed []consumer.FailedMessage
		dead   map[string]bool // keys with a failed record: their later records are not sent
	)
	fail := func(i int, err error) {
		failed = append(failed, consumer.FailedMessage{Index: i, Err: err})
	}
	kill := func(key string) {
		if key == "" {
			return
		}
		if dead == nil {
			dead = make(map[string]bool)
		}
		dead[key] = true
	}
	// Each record is checked before it is sent, and the records of a
	// key are sent one after another (the next once the cluster has the
	// previous): a record of a key that fails, here or in the cluster,
	// fails the key's later records of the call without sending them.
	recs := make([]kgo.Record, len(msgs))
	// The keys' and header values' bytes share one buffer, and the
	// headers one slice: a few allocations a call rather than a few a
	// record. A call that can end before its records do (its context has
	// a deadline or can be cancelled: see produceSync) copies their bodies
	// there too, since the producer keeps a record until it is written.
	copyBodies := ctx.Done() != nil
	nbytes, nheaders := 0, 0
	for i := range msgs {
		m := &msgs[i]
		nbytes += len(m.Key) + len(m.ID)
		if copyBodies {
			nbytes += len(m.Body)
		}
		nheaders += len(m.Headers)
		if m.ID != "" {
			nheaders++
		}
		for _, v := range m.Headers {
			nbytes += len(v)
		}
	}
	buf := make([]byte, 0, nbytes)
	bytesOf := func(s string) []byte {
		n := len(buf)
		buf = append(buf, s...)
		return buf[n:len(buf):len(buf)]
	}
	headers := make([]kgo.RecordHeader, 0, nheaders)
	var (
		wave  = make([]int, 0, len(msgs)) // sent together: keyless records, and the first of each key
		queue map[string][]int            // each key's later records, in order; nil when no key repeats
		keys  map[string]struct{}         // the keys seen, until one repeats
		twice bool                        // a key repeats
	)
	for i := range msgs {
		m := &msgs[i]
		r := &recs[i]
		r.Topic = topic
		if m.Key != "" {
			r.Key = bytesOf(m.Key)
		}
		r.Value = m.Body
		if copyBodies && m.Body != nil {
			n := len(buf)
			buf = append(buf, m.Body...)
			r.Value = buf[n:len(buf):len(buf)]
		}
		if len(m.Headers) > 0 || m.ID != "" {
			h0 := len(headers)
			if m.ID != "" {
				headers = append(headers, kgo.RecordHeader{Key: HeaderMessageID, Value: bytesOf(m.ID)})
			}
			for k, v := range m.Headers {
				if k == HeaderMessageID && m.ID != "" {
					continue
				}
				headers = append(headers, kgo.RecordHeader{Key: k, Value: bytesOf(v)})
			}
			r.Headers = headers[h0:len(headers):len(headers)]
		}
		if m.Key != "" && !twice {
			if keys == nil {
				keys = make(map[string]struct{}, len(msgs))
			}
			_, twice = keys[m.Key]
			keys[m.Key] = struct{}{}
		}
	}
	// Most calls repeat no key: then every record goes in one wave.
	for i := range msgs {
		key := msgs[i].Key
		switch {
		case !twice || key == "":
			wave = append(wave, i)
		case queue[key] != nil:
			queue[key] = append(queue[key], i)
		default:
			if queue == nil {
				queue = make(map[string][]int, len(keys))
			}
			queue[key] = []int{}
			wave = append(wave, i)
		}
	}
	var (
		sendable []int
		batch    []*kgo.Record
		index    map[*kgo.Record]int // a record's place in recs, made on the first failure
	)
	// failWithContext fails records, and every record queued behind the
	// wave, with the context that ended.
	failWithContext := func(records []int) {
		for _, i := range records {
			fail(i, b.publishErr(topic, ctx.Err()))
		}
		for _, rest := range queue {
			for _, i := range rest {
				fail(i, b.publishErr(topic, ctx.Err()))
			}
		}
	}
	for len(wave) > 0 {
		if ctx.Err() != nil {
			// The context ended with the last wave: what is left is not
			// handed to the producer (it could be written after the
			// call returned).
			failWithContext(wave)
			break
		}
		sendable = sendable[:0]
		for _, i := range wave {
			r, key := &recs[i], msgs[i].Key
			switch {
			case dead[key]:
				fail(i, fmt.Errorf("kafka: key %q: %w", key, errEarlierFailed))
			case msgs[i].NotBefore.After(start):
				fail(i, fmt.Errorf("kafka: NotBefore %s ahead: Kafka delivers a record as soon as it is written, and cannot hold one back: %w",
					msgs[i].NotBefore.Sub(start).Round(time.Millisecond), consumer.ErrDelayNotSupported))
				kill(key)
			case maxBytes > 0 && recordSize(r) > int(maxBytes):
				fail(i, fmt.Errorf("kafka: record of about %d bytes exceeds the producer's batch limit of %d bytes: %w", recordSize(r), maxBytes, kerr.MessageTooLarge))
				kill(key)
			default:
				sendable = append(sendable, i)
			}
		}
		// ProduceSync rather than Produce and a wait: it ends the linger
		// of the partitions it wrote to once every record is buffered, so
		// a caller waiting for its acks does not also wait out the linger
		// that batches concurrent callers' records.
		batch = batch[:0]
		for _, i := range sendable {
			batch = append(batch, &recs[i])
		}
		results, finished := b.produceSync(ctx, batch)
		if !finished {
			failWithContext(sendable) // the context ended first
			break
		}
		for _, res := range results {
			if res.Err == nil {
				continue
			}
			if index == nil {
				index = make(map[*kgo.Record]int, len(recs))
				for i := range recs {
					index[&recs[i]] = i
				}
			}
			i := index[res.Record]
			err := b.publishErr(topic, res.Err)
			if isContextErr(res.Err) && ctx.Err() == nil {
				// franz-go fails a partition's buffered records together
				// when the first one's context ends: another call's.
				err = fmt.Errorf("kafka: publish to %q: failed with the records buffered before it for its partition, whose call's context ended (%v); publish it again", topic, res.Err)
			}
			fail(i, err)
			kill(msgs[i].Key)
		}
		wave = wave[:0]
		for key, rest := range queue {
			if len(rest) == 0 {
				delete(queue, key)
				continue
			}
			wave = append(wave, rest[0])
			queue[key] = rest[1:]
		}
		slices.Sort(wave)
	}
	if len(failed) == 0 {
		return nil
	}
	sortFailed(failed)
	// Every record failed with the context (or behind one of its key
	// that did): the call's error is the deadline's, with why.
	byContext := func(f consumer.FailedMessage) bool { return isContextErr(f.Err) || errors.Is(f.Err, errEarlierFailed) }
	if err := ctx.Err(); err != nil && len(failed) == len(msgs) && !slices.ContainsFunc(failed, func(f consumer.FailedMessage) bool { return !byContext(f) }) {
		return b.deadlineErr(topic, err, start)
	}
	return &consumer.PublishError{Failed: failed}
}

// errEarlierFailed fails the records of a key that come after one of the
// call that failed: they are not sent, so that a retry keeps their order.
var errEarlierFailed = errors.New("not sent: an earlier record of its key in this call failed")

// produceSync is the producer's ProduceSync, returning when ctx ends if
// that comes first (finished false). franz-go fails a record whose context
// ended only when it next looks at the record's partition (for a partition
// without a leader, its next metadata refresh, up to 5 s later), and not
// at all once the record was sent and its outcome is unknown (a write
// below min.insync.replicas, a broker that died with the request): the
// idempotent producer waits for that outcome, for minutes if need be, and
// writes the record when the cluster takes it. ProduceSync goes on in the
// background meanwhile, holding the call's records (whose bodies the call
// copied): a Publish that failed at its deadline may have written some of
// its records, or write them later, as on every broker (at least once).
func (b *Broker) produceSync(ctx context.Context, batch []*kgo.Record) (kgo.ProduceResults, bool) {
	if ctx.Done() == nil {
		return b.prod.ProduceSync(ctx, batch...), true
	}
	done := make(chan kgo.ProduceResults, 1)
	go func() { done <- b.prod.ProduceSync(ctx, batch...) }()
	select {
	case res := <-done:
		return res, true
	case <-ctx.Done():
		select {
		case res := <-done:
			return res, true
		default:
			return nil, false
		}
	}
}

// checkAccess makes sure the producer gets through before records wait
// on a connection that never comes: franz-go retries a refused SASL
// handshake until the records' delivery timeout, and a TLS/plaintext
// mismatch for as long as it is asked to, so a wrong password or a wrong
// port would otherwise look like a hang. A cluster that does not answer
// is no such refusal: Publish waits for it, up to its context. Once the
// producer got through, it is not asked again.
func (b *Broker) checkAccess(ctx context.Context) error {
	if b.authOK.Load() {
		return nil
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	err := b.prod.Ping(pctx)
	switch {
	case err == nil:
		b.authOK.Store(true)
		return nil
	case refusedBy(&b.plink, err):
		addr, _ := b.plink.last()
		return refused(b.addrOr(addr), err)
	}
	return nil // not answering for now: the producer keeps trying, as it should
}

// deadlineErr is the error of a Publish to topic, begun at start, whose
// every record failed as its context ended with ctxErr: that error, and why
// the records were not written: the cluster's last refusal of a write to
// the topic since start (a partition with too few in-sync replicas, a
// leader moving), else the last broker the producer could not reach since
// start (a partition's leader that died, while the others answer), else
// what the producer last saw of the cluster when it had not got through
// since.
func (b *Broker) deadlineErr(topic string, ctxErr error, start time.Time) error {
	// No broker answered during the call, and one failed: the cluster is
	// out of reach (or refuses the client).
	if addr, seen := b.plink.last(); seen != nil && b.plink.okAt.Load() < start.UnixNano() {
		return fmt.Errorf("kafka: publish to %q: %w; the client last saw: %w", topic, ctxErr, b.linkErr(addr, seen))
	}
	if v, ok := b.loadErrs.Load(topic); ok {
		if le := v.(loadErr); !le.at.Before(start) {
			return fmt.Errorf("kafka: publish to %q: %w; the cluster's metadata last said of partition %d: %w", topic, ctxErr, le.partition, le.err)
		}
	}
	if addr, seen := b.plink.lastSince(start); seen != nil {
		return fmt.Errorf("kafka: publish to %q: %w; other brokers answer, but since the call began the producer could not reach one: %w",
			topic, ctxErr, b.linkErr(addr, seen))
	}
	return fmt.Errorf("kafka: publish to %q: %w", topic, ctxErr)
}

// linkErr is a failure the producer's link saw at addr, as the kind it is:
// a refusal no retry fixes, or a broker out of reach.
func (b *Broker) linkErr(addr string, seen error) error {
	if refusedBy(&b.plink, seen) {
		return refused(addr, seen)
	}
	return unreachable(addr, seen)
}

func (b *Broker) publishErr(topic string, err error) error {
	if isRefusal(err) {
		addr, _ := b.plink.last()
		return fmt.Errorf("kafka: publish to %q: %w", topic, refused(b.addrOr(addr), err))
	}
	return fmt.Errorf("kafka: publish to %q: %w", topic, err)
}

func sortFailed(f []consumer.FailedMessage) {
	for i := 1; i < len(f); i++ {
		for j := i; j > 0 && f[j].Index < f[j-1].Index; j-- {
			f[j], f[j-1] = f[j-1], f[j]
		}
	}
}

// recordSize is the size of a batch holding r alone, as franz-go counts it
// before it refuses a record as too large (a v2 batch header, and the
// record's varint-framed encoding), plus a small margin.
func recordSize(r *kgo.Record) int {
	const (
		batchHeader = 61 // franz-go's recordBatchOverhead
		margin      = 16
	)
	l := 1 + 1 + 1 + // attributes, timestamp delta, offset delta (first of its batch)
		kbin.VarintLen(int32(len(r.Key))) + len(r.Key) +
		kbin.VarintLen(int32(len(r.Value))) + len(r.Value) +
		kbin.VarintLen(int32(len(r.Headers)))
	for _, h := range r.Headers {
		l += kbin.VarintLen(int32(len(h.Key))) + len(h.Key) + kbin.VarintLen(int32(len(h.Value))) + len(h.Value)
	}
	return batchHeader + kbin.VarintLen(int32(l)) + l + margin
}

// maxRecordFor is the largest batch the producer sends to topic: its batch
// limit, or less when its request limit leaves less room.
func (b *Broker) maxRecordFor(topic string) int32 {
	m := b.maxRecord
	if b.maxWrite > 0 {
		// A produce request's own header, the topic and the partition
		// come out of the request limit; 512 bytes is more than those.
		if w := b.maxWrite - 512 - int32(len(topic)); m <= 0 || w < m {
			m = w
		}
	}
	return m
}

// loadErr is what the cluster's metadata last said of a topic's partition
// the producer has records for and cannot write to (LEADER_NOT_AVAILABLE:
// its leader died and none has taken over): franz-go waits for a leader
// until the record's context ends, and tells of it only in a log line,
// which producerLogger reads.
type loadErr struct {
	partition int32
	err       error
	at        time.Time
}

// producerLogger is the producer's kgoLogger: it also keeps, per topic,
// the last partition error of the cluster's that franz-go logs ("produce
// partition load error" with a kerr error; the same line carries dial
// errors, which the link reports), so that a Publish that ends at its
// deadline can say why its records were not written.
type producerLogger struct {
	kgoLogger
	b *Broker
}

func (l producerLogger) Log(level kgo.LogLevel, msg string, keyvals ...any) {
	if strings.HasPrefix(msg, "produce partition load error") {
		var topic string
		le := loadErr{partition: -1, at: time.Now()}
		for i := 0; i+1 < len(keyvals); i += 2 {
			switch keyvals[i] {
			case "topic":
				topic, _ = keyvals[i+1].(string)
			case "partition":
				le.partition, _ = keyvals[i+1].(int32)
			case "err":
				le.err, _ = keyvals[i+1].(error)
			}
		}
		var ke *kerr.Error
		if topic != "" && errors.As(le.err, &ke) {
			l.b.loadErrs.Store(topic, le)
		}
	}
	l.kgoLogger.Log(level, msg, keyvals...)
}
