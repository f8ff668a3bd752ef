package kafka

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
)

// kafkaDriver is one consumer group member over one topic. Fetch runs on
// the loop's fetcher, Settle on its settler, the rebalance callbacks on
// franz-go's group goroutine, and commits on a goroutine of the driver's
// own; mu guards the partition table they share.
type kafkaDriver struct {
	membership

	revC chan driver.Revocation

	mu       sync.Mutex
	cl       *kgo.Client
	maxAsked int                // the largest batch the loop asked Fetch for
	wakePoll context.CancelFunc // ends Fetch's poll, for records waiting here
	strBuf   []byte             // messages' scratch: a group's strings before they are one
	spans    []span             // messages' scratch: where each is
	// lastDigits ends with the last lastLen decimal digits of lastOffset,
	// the offset appendOffset wrote last.
	lastDigits [20]byte
	lastLen    int
	lastOffset int64
	parts      map[int32]*partition // owned now; a new assignment gets a new *partition
	member     string
	gen        uint64 // counts assignments: a partition assigned anew gets the next
	// losses counts the times franz-go reported partitions lost. A commit
	// is issued only if none was lost since it read what to commit; see
	// commit.
	losses uint64
	// afterCommitRead, when set (by tests), runs in commit between
	// reading the offsets and committing them.
	afterCommitRead func()

	// commitMu serialises commits: the periodic one, the one on revoke and
	// the last one on Close. cancelCommit cancels a periodic commit in
	// progress, so that a rebalance never waits behind one.
	commitMu     sync.Mutex
	cancelCommit context.CancelFunc

	stop      chan struct{}
	closeOnce sync.Once
	wg        sync.WaitGroup
}

// errPartitionsLost is why a commit was not issued: partitions were lost
// after it read its offsets.
var errPartitionsLost = errors.New("partitions were lost since the offsets were read; not committing them")

var (
	_ driver.Driver      = (*kafkaDriver)(nil)
	_ driver.Revoker     = (*kafkaDriver)(nil)
	_ driver.LagReporter = (*kafkaDriver)(nil)
	_ driver.Aser        = (*kafkaDriver)(nil)
	_ driver.Connector   = (*kafkaDriver)(nil)
)

// handle is what the loop holds for one delivery: the record, the
// assignment of its partition it was fetched under, and its sequence
// number there (see partition).
type handle struct {
	rec *kgo.Record
	p   *partition
	seq int64
}

// newDriver makes the driver of one member of group over topic. Its
// client is made by Connect (or the first Fetch), once a loop runs to hear
// of revocations.
func (b *Broker) newDriver(topic, group string) (*kafkaDriver, error) {
	if topic == "" {
		return nil, consumer.ConfigErrorf("topic", "must not be empty")
	}
	if group == "" {
		return nil, consumer.ConfigErrorf("group", "must not be empty")
	}
	if b.isClosed() {
		return nil, fmt.Errorf("kafka: consumer of %q: %w", topic, ErrClosed)
	}
	d := &kafkaDriver{
		membership: membership{b: b, topic: topic, group: group, log: b.log.With("topic", topic, "group", group)},
		revC:       make(chan driver.Revocation),
		parts:      make(map[int32]*partition),
		stop:       make(chan struct{}),
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.cfg.instanceID != "" {
		// A second member of the group here would join as the same
		// static member, and the coordinator would fence the first.
		for o := range b.drivers {
			if od, ok := o.(*kafkaDriver); ok && od.group == group {
				return nil, consumer.ConfigErrorf("InstanceID", "a consumer of group %q is already open on this Broker as static member %q; "+
					"a second would fence it: close the first, or give the second a Broker with an instance id of its own", group, b.cfg.instanceID)
			}
		}
	}
	b.drivers[d] = struct{}{}
	return d, nil
}

func (d *kafkaDriver) clientOpts() []kgo.Opt {
	c := &d.b.cfg
	opts := []kgo.Opt{
		kgo.ConsumerGroup(d.group),
		kgo.ConsumeTopics(d.topic),
		kgo.DisableAutoCommit(),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.Balancers(kgo.CooperativeStickyBalancer()),
		kgo.OnPartitionsAssigned(d.onAssigned),
		kgo.OnPartitionsRevoked(d.onRevoked),
		kgo.OnPartitionsLost(d.onLost),
		kgo.FetchMaxWait(500 * time.Millisecond),
	}
	if c.protocol == NextGen {
		opts = append(opts, kgo.ServerSideBalancer())
	}
	if c.sessionTimeout > 0 {
		opts = append(opts, kgo.SessionTimeout(c.sessionTimeout))
	}
	if c.instanceID != "" {
		opts = append(opts, kgo.InstanceID(c.instanceID), kgo.WithHooks(fenceHook{d}))
	}
	if c.rebalanceTO > 0 {
		opts = append(opts, kgo.RebalanceTimeout(c.rebalanceTO))
	}
	return d.b.clientOpts(&d.link, opts...)
}

// fenceHook stops a static member's group management as soon as the
// coordinator fences it (another process joined with its instance id):
// franz-go would rejoin after a short backoff and fence the newcomer in
// turn, before the loop has drained and closed the client. LeaveGroup ends
// the management and sends no leave for a static member; Fetch then ends
// the Run with ErrFenced.
type fenceHook struct{ d *kafkaDriver }

var _ kgo.HookGroupManageError = fenceHook{}

// OnGroupManageError implements kgo.HookGroupManageError.
func (h fenceHook) OnGroupManageError(err error) {
	if !errors.Is(err, kerr.FencedInstanceID) || !h.d.fenced.CompareAndSwap(false, true) {
		return
	}
	h.d.mu.Lock()
	cl := h.d.cl
	h.d.mu.Unlock()
	if cl != nil {
		go cl.LeaveGroup() // it waits for the management goroutine, which runs this hook
	}
}

// revokeWait is how long a rebalance waits for the loop to let go of
// revoked partitions: the configured bound, and always some seconds less
// than the rebalance timeout.
func (d *kafkaDriver) revokeWait() time.Duration {
	w := d.b.cfg.revokeWait
	rt := d.b.cfg.rebalanceTO
	if rt == 0 {
		rt = d.b.cfg.kgoRebalanceTO
	}
	if rt > 0 {
		w = min(w, max(rt-5*time.Second, rt/2))
	}
	return w
}

// client returns the group client, making it on first use (Connect and
// Fetch call it, from the loop's fetcher: never concurrently).
func (d *kafkaDriver) client() (*kgo.Client, error) {
	d.mu.Lock()
	cl := d.cl
	d.mu.Unlock()
	if cl != nil {
		return cl, nil
	}
	closedErr := fmt.Errorf("kafka: consumer of %q: %w", d.topic, ErrClosed)
	select {
	case <-d.stop:
		return nil, closedErr
	default:
	}
	cl, err := kgo.NewClient(d.clientOpts()...)
	if err != nil {
		return nil, fmt.Errorf("kafka: consumer of %q: %w", d.topic, err)
	}
	d.mu.Lock()
	select {
	case <-d.stop:
		d.mu.Unlock()
		cl.Close()
		return nil, closedErr
	default:
	}
	d.cl = cl
	d.wg.Add(1)
	d.mu.Unlock()
	go d.commitLoop()
	return cl, nil
}

// Capabilities reports a log: records cannot be taken back, so the loop
// retries them in place. The source is the topic.
func (d *kafkaDriver) Capabilities() driver.Capabilities {
	return driver.Capabilities{Redelivers: false, Source: d.topic, System: MessagingSystem}
}

// connectWithin bounds Connect, so that it returns within
// [driver.ReportWithin].
const connectWithin = driver.ReportWithin - 500*time.Millisecond

// pollSlice is how long one poll of Fetch waits before Fetch looks at
// what the client saw of its connections: a client that cannot get
// through is reported within failGrace and a slice.
const pollSlice = 500 * time.Millisecond

// Connect makes the group client (which starts joining the group) and
// asks the cluster for the topic's metadata. It returns nil once a broker
// answered that the topic exists; otherwise, within [driver.ReportWithin],
// an error wrapping [consumer.ErrSourceNotFound] (the cluster answers and
// has no such topic), [consumer.ErrUnreachable] (no broker answered: the
// address and what the client saw), or, marked [driver.Fatal],
// [consumer.ErrRefused] (a TLS/plaintext mismatch, a failed authentication,
// an authorization refused).
func (d *kafkaDriver) Connect(ctx context.Context) error {
	cl, err := d.client()
	if err != nil {
		return driver.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(ctx, connectWithin)
	defer cancel()
	d.askedAt = time.Now()
	_, err = d.lookUp(ctx, cl)
	d.failed = failureOf(err)
	return err
}

// Revoked delivers the partitions a rebalance takes away, as lanes.
func (d *kafkaDriver) Revoked() <-chan driver.Revocation { return d.revC }

// Fetch polls up to max records. Records of partitions this member no
// longer owns are dropped; their next owner reads them from the committed
// offset.
func (d *kafkaDriver) Fetch(ctx context.Context, dst []driver.Message, max int) ([]driver.Message, error) {
	cl, err := d.client()
	if err != nil {
		return dst, driver.Fatal(err)
	}
	if max <= 0 {
		max = 1
	}
	d.mu.Lock()
	if max > d.maxAsked {
		d.maxAsked = max
	}
	limit, fixed := d.bufferLimit()
	// Records polled earlier beyond their partition's share go first.
	n0 := len(dst)
	dst = d.drainStashes(dst, max, limit)
	var (
		pctx   = ctx
		cancel context.CancelFunc
		poll   bool
	)
	if len(dst) == n0 {
		// Nothing to hand out: poll, and let Settle wake the poll when a
		// partition's waiting records may go out. Unless enough records
		// wait here already (their partitions at their limit): then only
		// wait for Settle. franz-go fetches again only once what it
		// buffered was polled, so not polling holds fetching back without
		// pausing partitions that make progress (a resume can wait for a
		// fetch in flight, up to FetchMaxWait).
		pctx, cancel = context.WithCancel(ctx)
		d.wakePoll = cancel
		poll = d.waitingUnpaused() < 2*d.maxAsked
	}
	d.mu.Unlock()
	if cancel != nil && !poll {
		t := time.NewTimer(StuckAfter) // then look for stuck partitions again
		select {
		case <-pctx.Done():
		case <-t.C:
		}
		t.Stop()
		d.mu.Lock()
		d.wakePoll = nil
		d.mu.Unlock()
		cancel()
		if err := ctx.Err(); err != nil {
			return dst, err
		}
	}
	var res pollResult
	if cancel != nil && poll {
		res = d.poll(pctx, cl, max)
		d.mu.Lock()
		d.wakePoll = nil
		d.mu.Unlock()
		cancel()
		if err := ctx.Err(); err != nil {
			return dst, err
		}
		d.mu.Lock()
		res.fs.EachPartition(func(fp kgo.FetchTopicPartition) {
			p := d.parts[fp.Partition]
			recs := fp.Records
			if p == nil || fp.Topic != d.topic || len(recs) == 0 {
				return
			}
			if last := recs[len(recs)-1].Offset; last >= p.fetchedTo {
				p.fetchedTo = last + 1 // a partition's records come in offset order
			}
			// A partition holds at most limit of the loop's room: the
			// rest waits here, in order, until its records finish, so
			// that a partition whose oldest record does not progress
			// cannot fill the loop.
			n := 0
			if room := limit - p.outstanding; len(p.stash) == 0 && room > 0 {
				n = min(len(recs), room)
			}
			dst = d.messages(dst, p, recs[:n])
			if n < len(recs) {
				p.stash = append(p.stash, recs[n:]...)
			}
		})
		d.mu.Unlock()
	}
	d.mu.Lock()
	d.adjustPauses(cl, limit, fixed)
	d.mu.Unlock()
	return dst, d.fetchErr(ctx, cl, res)
}

// bufferLimit is how many unfinished records of one partition the loop may
// hold: half of the loop's fetch batch (itself bounded by the loop's
// in-flight limit), or WithPartitionBuffer. fixed reports a set
// [WithPartitionBuffer], under which a partition holding as many is paused
// at once rather than once it makes no progress. d.mu is held.
func (d *kafkaDriver) bufferLimit() (limit int, fixed bool) {
	if n := d.b.cfg.partitionBuffer; n > 0 {
		return n, true
	}
	return max(d.maxAsked/2, 1), false
}

// keptStash is the most room for waiting records a partition keeps once
// none wait: a partition whose polls bring more than its limit stashes
// again and again, and its stash is not made anew each time.
const keptStash = 8192

// drainStashes appends, up to max in all, the records partitions polled
// beyond their limit, as far as their limit now allows. d.mu is held.
func (d *kafkaDriver) drainStashes(dst []driver.Message, max, limit int) []driver.Message {
	n := 0
	for _, p := range d.parts {
		k := min(len(p.stash), limit-p.outstanding, max-n)
		if k <= 0 {
			continue
		}
		dst = d.messages(dst, p, p.stash[:k])
		n += k
		rest := copy(p.stash, p.stash[k:]) // the rest to the front: the stash's room is used again
		clear(p.stash[rest:])
		p.stash = p.stash[:rest]
		if rest == 0 && cap(p.stash) > keptStash {
			p.stash = nil
		}
	}
	return dst
}

// waitingUnpaused counts the records polled beyond their partition's
// limit, of partitions not paused: what the loop can take once those
// partitions progress. d.mu is held.
func (d *kafkaDriver) waitingUnpaused() int {
	n := 0
	for _, p := range d.parts {
		if !p.paused {
			n += len(p.stash)
		}
	}
	return n
}

// adjustPauses pauses fetching a partition whose records wait (as many
// unfinished as its limit, with no progress for [StuckAfter], or at once
// under [WithPartitionBuffer]; or more waiting here than it finished in the
// last [StuckAfter]) and resumes one that is down to half its limit. A
// partition that goes fast is not paused: Fetch stops polling instead
// while enough records wait, which costs no fetch round trip on resuming.
// But a slow one would hold polling back for every other partition (and
// franz-go's buffered fetch would hand out its records before theirs), so
// once its waiting records would take longer than [StuckAfter] to go out at
// its rate, it is paused. franz-go is called under d.mu, so that the
// pauses and resumes Fetch and Settle decide reach it in the order they
// were decided. d.mu is held.
func (d *kafkaDriver) adjustPauses(cl *kgo.Client, limit int, fixed bool) {
	now := time.Now().UnixNano()
	stuck := now - int64(StuckAfter)
	var pause, resume []int32
	for _, p := range d.parts {
		if p.winStart <= stuck {
			p.lastWinAcks = -1
			if p.winBusy && p.outstanding > 0 {
				p.lastWinAcks = p.winAcks
			}
			p.winAcks, p.winStart, p.winBusy = 0, now, p.outstanding > 0
		}
		held := p.outstanding + len(p.stash)
		slow := p.lastWinAcks >= 0 && len(p.stash) > max(p.lastWinAcks, limit)
		switch {
		case !p.paused && (slow || held >= limit && (fixed || p.progress < stuck)):
			p.paused = true
			pause = append(pause, p.id)
		case p.paused && held <= limit/2:
			p.paused = false
			resume = append(resume, p.id)
		}
	}
	if cl == nil {
		return
	}
	if pause != nil {
		cl.PauseFetchPartitions(map[string][]int32{d.topic: pause})
		d.log.Debug("ferry/kafka: paused fetching partitions whose records wait", "partitions", pause, "buffer", limit)
	}
	if resume != nil {
		cl.ResumeFetchPartitions(map[string][]int32{d.topic: resume})
	}
}

// handleSlab is how many records are handed out together: the handles of
// up to handleSlab consecutive records of one partition, handed out by one
// Fetch, share one array, and their small strings (keys, IDs, header
// values) one string, so that a record costs the loop a share of two
// allocations rather than one for each handle and string. Either lives
// while any record's part of it does, and a handle keeps its record (and
// franz-go's batch behind it) alive: so groups are small, of one
// partition's consecutive records (which mostly share a batch anyway, and
// of which, in partition order, the later ones are still in the loop while
// an earlier one is), sized to what is handed out, and never kept by the
// driver.
const handleSlab = 16

// smallStrings is how many bytes of a record's key, [HeaderMessageID] and
// other header values may go into its group's string: what does not fit
// is a string of its own, so that a record whose string outlives it (a
// key kept in a map) keeps at most some 8 KiB of its group's alive. An ID
// made of topic/partition/offset (at most some 280 bytes) always goes in.
const smallStrings = 256

// recordStrings is what layOut found of a record: its spans start at
// spans[span]; its ID is the value of r.Headers[id] (-1: the ID is made of
// topic/partition/offset); others counts its headers other than
// HeaderMessageID.
type recordStrings struct {
	span   int
	id     int
	others int
}

// span is one string of a record in its group's string, from < 0 when it
// is a string of its own.
type span struct{ from, to int32 }

// messages appends recs, polled in order from p, to dst as the loop takes
// them, and enters them in p. d.mu is held.
//
// The strings are copies of the record's bytes, never the bytes themselves
// seen as a string (unsafe.String): a handler may write a record's bytes
// through As, as a []byte allows, and a decompression pool given to
// franz-go (kgo.WithPools, through [WithClientOpts]) zeroes and reuses them
// once the record is recycled; a string must never change.
func (d *kafkaDriver) messages(dst []driver.Message, p *partition, recs []*kgo.Record) []driver.Message {
	for len(recs) > 0 {
		group := recs[:min(len(recs), handleSlab)]
		recs = recs[len(group):]
		var rs [handleSlab]recordStrings
		buf, spans := d.strBuf[:0], d.spans[:0]
		for i, r := range group {
			rs[i].span = len(spans)
			buf, spans = d.layOut(buf, spans, &rs[i], r, p)
		}
		d.strBuf, d.spans = buf, spans
		str := string(buf) // the group's small strings, in one allocation
		cut := func(b []byte, sp span) string {
			switch {
			case sp.from < 0:
				return string(b)
			case sp.from == sp.to:
				return ""
			}
			return str[sp.from:sp.to]
		}
		hs := make([]handle, len(group))
		for i, r := range group {
			h := &hs[i]
			h.rec, h.p, h.seq = r, p, p.add(r)
			at := rs[i].span
			// Built in place: a message built aside and appended is
			// copied again, with a write barrier over the whole of it
			// while the collector runs.
			dst = append(dst, driver.Message{})
			m := &dst[len(dst)-1]
			m.Key = cut(r.Key, spans[at])
			m.Body = r.Value
			m.Source = d.topic
			m.Lane = p.lane
			m.Offset = r.Offset
			m.PublishedAt = r.Timestamp
			m.Deliveries = 1
			m.Handle = h
			m.Generation = p.gen
			var id []byte
			if rs[i].id >= 0 {
				id = r.Headers[rs[i].id].Value
			}
			m.ID = cut(id, spans[at+1])
			if rs[i].others > 0 {
				at += 2
				m.Headers = make(map[string]string, rs[i].others)
				for _, hd := range r.Headers {
					if hd.Key != HeaderMessageID {
						m.Headers[hd.Key] = cut(hd.Value, spans[at])
						at++
					}
				}
			}
		}
	}
	return dst
}

// layOut appends r's small strings to buf (the group's string) and their
// spans to spans, in the order messages reads them: the key, the ID, the
// values of headers other than HeaderMessageID. It reads the headers as
// readHeaders does: the ID is the last [HeaderMessageID], and a record
// without one, or with an empty one, gets the ID topic/partition/offset.
func (d *kafkaDriver) layOut(buf []byte, spans []span, rs *recordStrings, r *kgo.Record, p *partition) ([]byte, []span) {
	room := smallStrings
	put := func(b []byte) {
		if len(b) > room {
			spans = append(spans, span{-1, -1})
			return
		}
		room -= len(b)
		from := len(buf)
		buf = append(buf, b...)
		spans = append(spans, span{int32(from), int32(len(buf))})
	}
	rs.id, rs.others = -1, 0
	for i := range r.Headers {
		if r.Headers[i].Key == HeaderMessageID {
			rs.id = i
		} else {
			rs.others++
		}
	}
	put(r.Key)
	if rs.id >= 0 && len(r.Headers[rs.id].Value) > 0 {
		put(r.Headers[rs.id].Value)
	} else {
		rs.id = -1
		from := len(buf)
		buf = append(buf, d.topic...)
		buf = append(buf, '/')
		buf = append(buf, p.lane...)
		buf = append(buf, '/')
		buf = d.appendOffset(buf, r.Offset)
		spans = append(spans, span{int32(from), int32(len(buf))})
	}
	if rs.others > 0 {
		for i := range r.Headers {
			if r.Headers[i].Key != HeaderMessageID {
				put(r.Headers[i].Value)
			}
		}
	}
	return buf, spans
}

// appendOffset appends off in decimal to buf. A partition's records come
// mostly one offset after the other, so the digits of the last offset
// written are kept and counted up by one rather than formatted afresh.
func (d *kafkaDriver) appendOffset(buf []byte, off int64) []byte {
	if off < 0 { // never fetched; kept out of the digits counted up
		d.lastLen = 0
		return strconv.AppendInt(buf, off, 10)
	}
	digits := &d.lastDigits
	from := len(digits) - d.lastLen
	switch {
	case d.lastLen > 0 && off == d.lastOffset+1:
		i := len(digits) - 1
		for i >= from && digits[i] == '9' {
			digits[i] = '0'
			i--
		}
		if i < from { // all nines, now all zeros: one digit more
			from--
			i = from
			digits[i] = '0'
		}
		digits[i]++
	case d.lastLen == 0 || off != d.lastOffset:
		from = len(digits)
		for v := uint64(off); ; v /= 10 {
			from--
			digits[from] = byte('0' + v%10)
			if v < 10 {
				break
			}
		}
	}
	d.lastLen, d.lastOffset = len(digits)-from, off
	return append(buf, digits[from:]...)
}

// Settle marks acked records done. A record whose partition was revoked
// since it was fetched is left alone: its offset belongs to the next owner.
// Return is a no-op: the record stays unfinished, so no commit passes it,
// and whoever owns the partition next reads it again.
//
// The loop settles a lane's records mostly together and in order: each
// run of acks of one partition is marked first, through the handles, and
// its commit point then moves once over all it finished.
func (d *kafkaDriver) Settle(ctx context.Context, batch []driver.Settlement) error {
	var (
		wake     bool
		amo      []int   // at-most-once acks: committed before Settle returns
		amoParts []int32 // their partitions
		gone     []int   // at-most-once acks of partitions no longer ours
		now      int64   // read once a record finishes: its partition's progress
		run      *partition
		finished bool // a record of run finished
	)
	d.mu.Lock()
	limit, fixed := d.bufferLimit()
	endRun := func() {
		if run == nil {
			return
		}
		run.advance()
		if finished {
			if now == 0 {
				now = time.Now().UnixNano()
			}
			run.progress = now
		}
		if len(run.stash) > 0 && run.outstanding < limit {
			wake = true
		}
		run, finished = nil, false
	}
	for i := range batch {
		s := &batch[i]
		h, ok := s.Handle.(*handle)
		if !ok || h == nil || s.Action != driver.Ack {
			continue
		}
		p := h.p
		if p.gone {
			if s.BeforeRun {
				gone = append(gone, i) // its handler must not run: nothing of it can be committed
			}
			continue // revoked since: not ours to commit
		}
		if p != run {
			endRun()
			run = p
		}
		if p.finish(h.seq) {
			finished = true
		}
		if s.BeforeRun {
			amo = append(amo, i)
			if !slices.Contains(amoParts, p.id) {
				amoParts = append(amoParts, p.id)
			}
		}
	}
	endRun()
	if wake && d.wakePoll != nil {
		d.wakePoll() // a partition's waiting records may go out now
	}
	d.adjustPauses(d.cl, limit, fixed)
	d.mu.Unlock()
	if len(amo) > 0 {
		// At most once: the handler runs once Settle returns, so the
		// commit must be made by then, or a crash during the handler
		// would run the record again on the next owner.
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := d.commit(cctx, amoParts, false)
		cancel()
		if err != nil {
			gone = append(gone, amo...)
			slices.Sort(gone)
			return &driver.SettleError{Failed: gone, Err: err}
		}
	}
	if len(gone) > 0 {
		return &driver.SettleError{Failed: gone, Err: fmt.Errorf("kafka: settle %q: partition revoked since the record was fetched", d.topic)}
	}
	return nil
}

// As gives a handler the record: target is a **kgo.Record (set to the
// record itself) or a *kgo.Record (a copy).
func (d *kafkaDriver) As(h, target any) bool {
	hd, ok := h.(*handle)
	return ok && hd != nil && recordAs(hd.rec, target)
}

// recordAs sets target, a **kgo.Record or a *kgo.Record, from rec: the
// record itself, or a copy. Both drivers' As.
func recordAs(rec *kgo.Record, target any) bool {
	switch t := target.(type) {
	case **kgo.Record:
		if t == nil {
			return false
		}
		*t = rec
		return true
	case *kgo.Record:
		if t == nil {
			return false
		}
		*t = *rec
		return true
	}
	return false
}

// onAssigned starts tracking newly assigned partitions, each with a fresh
// state, and makes sure none of them stays paused from an earlier
// assignment (franz-go keeps pauses across rebalances).
func (d *kafkaDriver) onAssigned(_ context.Context, cl *kgo.Client, assigned map[string][]int32) {
	ps := assigned[d.topic]
	if len(ps) == 0 {
		return
	}
	d.mu.Lock()
	d.gen++
	for _, id := range ps {
		// A partition assigned again without a revocation in between
		// (an incremental KIP-848 assignment restating what we own)
		// keeps its state: a fresh one would forget records in flight
		// and commit past them.
		if d.parts[id] == nil {
			d.parts[id] = newPartition(id)
			d.parts[id].gen = d.gen
		}
		d.parts[id].paused = false // resumed below; paused again if it still waits
	}
	d.member, _ = cl.GroupMetadata()
	cl.ResumeFetchPartitions(map[string][]int32{d.topic: ps}) // under d.mu: see adjustPauses
	d.mu.Unlock()
	d.log.Debug("ferry/kafka: partitions assigned", "partitions", ps)
	d.hook(RebalanceEvent{Assigned: ps})
}

func (d *kafkaDriver) hook(ev RebalanceEvent) {
	if fn := d.b.cfg.rebalanceHook; fn != nil {
		d.mu.Lock()
		ev.Member = d.member
		d.mu.Unlock()
		ev.Topic, ev.Group = d.topic, d.group
		fn(ev)
	}
}

// onRevoked lets the loop cancel the handlers of the revoked partitions
// and waits (bounded) until they returned and their outcomes were settled,
// commits what finished, and then forgets the partitions.
func (d *kafkaDriver) onRevoked(ctx context.Context, cl *kgo.Client, revoked map[string][]int32) {
	ps := revoked[d.topic]
	if len(ps) == 0 {
		return
	}
	d.handOver(ps)
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	_ = d.commit(cctx, ps, true)
	cancel()
	d.forgetPartitions(cl, ps)
	d.log.Debug("ferry/kafka: partitions revoked", "partitions", ps)
	d.hook(RebalanceEvent{Revoked: ps})
}

// onLost lets the loop cancel the handlers of lost partitions, and commits
// nothing: another member may own them already.
func (d *kafkaDriver) onLost(_ context.Context, cl *kgo.Client, lost map[string][]int32) {
	ps := lost[d.topic]
	if len(ps) == 0 {
		return
	}
	d.mu.Lock()
	d.losses++ // a commit that read these partitions before now is not issued
	d.mu.Unlock()
	d.forgetPartitions(cl, ps) // before the loop hears: nothing of them is settled or committed from now on
	d.handOver(ps)
	d.log.Warn("ferry/kafka: partitions lost (the group went on without this member); their unfinished records go to their next owner", "partitions", ps)
	d.hook(RebalanceEvent{Lost: ps})
}

// handOver tells the loop the partitions are gone and waits for it to let
// go of them, at most revokeWait.
func (d *kafkaDriver) handOver(ps []int32) {
	d.interruptCommit()
	lanes := make([]string, len(ps))
	for i, p := range ps {
		lanes[i] = strconv.Itoa(int(p))
	}
	d.mu.Lock()
	// Records fetched under these assignments and still on their way to
	// the loop are dropped there, not run: the next owner reads them.
	before := d.gen + 1
	d.mu.Unlock()
	rev := driver.Revocation{Lanes: lanes, Done: make(chan struct{}), Before: before}
	t := time.NewTimer(d.revokeWait())
	defer t.Stop()
	select {
	case d.revC <- rev:
	case <-d.stop:
		return
	case <-t.C:
		d.log.Warn("ferry/kafka: the loop did not take a revocation in time", "partitions", ps)
		return
	}
	select {
	case <-rev.Done:
	case <-d.stop:
	case <-t.C:
		d.log.Warn("ferry/kafka: handlers of revoked partitions still run; committing what finished", "partitions", ps)
	}
}

func (d *kafkaDriver) forgetPartitions(cl *kgo.Client, ps []int32) {
	d.mu.Lock()
	for _, id := range ps {
		if p := d.parts[id]; p != nil {
			p.gone = true // its records in the loop are no longer ours to commit
			delete(d.parts, id)
		}
	}
	if cl != nil { // nil in unit tests
		cl.ResumeFetchPartitions(map[string][]int32{d.topic: ps}) // under d.mu: see adjustPauses
	}
	d.mu.Unlock()
}

// interruptCommit cancels a periodic commit in progress, so that a
// rebalance does not wait behind it.
func (d *kafkaDriver) interruptCommit() {
	d.mu.Lock()
	if d.cancelCommit != nil {
		d.cancelCommit()
	}
	d.mu.Unlock()
}

func (d *kafkaDriver) commitLoop() {
	defer d.wg.Done()
	t := time.NewTicker(d.b.cfg.commitInterval)
	defer t.Stop()
	for {
		select {
		case <-d.stop:
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		d.mu.Lock()
		d.cancelCommit = cancel
		d.mu.Unlock()
		if err := d.commit(ctx, nil, false); err != nil && ctx.Err() == nil && !errors.Is(err, errPartitionsLost) {
			d.log.Warn("ferry/kafka: commit failed; retrying at the next interval", "err", err)
		}
		d.mu.Lock()
		d.cancelCommit = nil
		d.mu.Unlock()
		cancel()
	}
}

// commit commits, for each owned partition (of only, when only is not
// nil), the offset below which every fetched record is finished, when it
// is past what was committed. A partition revoked meanwhile is left out.
func (d *kafkaDriver) commit(ctx context.Context, only []int32, rebalance bool) error {
	d.commitMu.Lock()
	defer d.commitMu.Unlock()
	d.mu.Lock()
	cl := d.cl
	losses := d.losses
	offs := make(map[int32]kgo.EpochOffset)
	at := make(map[int32]*partition)
	for id, p := range d.parts {
		if only != nil && !slices.Contains(only, id) {
			continue
		}
		if p.next > p.committed {
			offs[id] = kgo.EpochOffset{Epoch: p.nextEpoch, Offset: p.next}
			at[id] = p
		}
	}
	d.mu.Unlock()
	if len(offs) == 0 || cl == nil {
		return nil
	}
	if d.afterCommitRead != nil {
		d.afterCommitRead()
	}
	var (
		cerr error
		ok   = make(map[int32]int64, len(offs))
	)
	// franz-go waits for a join in progress and then commits under the
	// membership it has when it sends, which after partitions were lost
	// and the member rejoined is a new and valid one: the broker would
	// accept offsets read under the old membership for partitions another
	// member owns now, and move that member's committed offset back. So
	// just before the request goes out, it is dropped if partitions were
	// lost since the offsets were read. (A loss after this check is
	// harmless: franz-go reports a loss before it rejoins, so the request
	// carries the old membership, and the broker refuses it.)
	ctx = kgo.PreCommitFnContext(ctx, func(*kmsg.OffsetCommitRequest) error {
		d.mu.Lock()
		defer d.mu.Unlock()
		if d.losses != losses {
			return errPartitionsLost
		}
		return nil
	})
	cl.CommitOffsetsSync(ctx, map[string]map[int32]kgo.EpochOffset{d.topic: offs},
		func(_ *kgo.Client, _ *kmsg.OffsetCommitRequest, resp *kmsg.OffsetCommitResponse, err error) {
			if err != nil {
				cerr = err
				return
			}
			for _, t := range resp.Topics {
				for _, p := range t.Partitions {
					if err := kerr.ErrorForCode(p.ErrorCode); err != nil {
						cerr = err
						continue
					}
					if o, found := offs[p.Partition]; found {
						ok[p.Partition] = o.Offset
					}
				}
			}
		})
	d.mu.Lock()
	for id, off := range ok {
		if p := at[id]; off > p.committed {
			p.committed = off
		}
	}
	member := d.member
	d.mu.Unlock()
	if len(ok) > 0 && d.b.cfg.commitHook != nil {
		d.b.cfg.commitHook(CommitEvent{Topic: d.topic, Group: d.group, Member: member, Offset: maps.Clone(ok)})
	}
	if cerr != nil {
		if rebalance {
			d.log.Warn("ferry/kafka: commit on revoke failed; the next owner reads the uncommitted records again", "err", cerr)
		}
		return fmt.Errorf("kafka: commit %q: %w", d.topic, cerr)
	}
	return nil
}

// Close commits what finished, leaves the group (a static member stays in
// it, see WithInstanceID) and closes the client. The loop calls it when Run
// ends.
func (d *kafkaDriver) Close() error {
	d.closeOnce.Do(func() {
		d.mu.Lock()
		close(d.stop) // under mu: no client is made after this
		cl := d.cl
		d.mu.Unlock()
		if cl != nil {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			if err := d.commit(ctx, nil, false); err != nil {
				d.log.Warn("ferry/kafka: last commit failed; the next owner reads the uncommitted records again", "err", err)
			}
			cancel()
		}
		d.interruptCommit()
		d.wg.Wait()
		if cl != nil {
			// Leaving the group revokes everything; onRevoked sees stop
			// closed, tells no loop, and commits what finished (nothing new by now).
			cl.Close()
		}
		d.b.forget(d)
	})
	return nil
}

// Lag reports, per partition (Lanes), the high watermark minus the
// group's committed offset (the log start offset where the group committed
// nothing yet), as kadm computes it and ferry lag prints it: what the
// group has not done yet. Of that, InFlight is what this member took: the
// records it polled past the committed offset (being handled, waiting in
// the driver, or finished and waiting for the next commit), and Messages
// the rest, which no consumer has taken yet; the two add up to the sum of
// Lanes. OldestAge is the age of the oldest unfinished record here (by
// record timestamp). It reads the coordinator's offsets directly rather
// than through kadm.Client.Lag, which describes groups with the classic
// API only and so cannot see a KIP-848 group.
func (d *kafkaDriver) Lag(ctx context.Context) (driver.Lag, error) {
	adm := d.b.adm
	fail := func(what string, err error) (driver.Lag, error) {
		return driver.Lag{}, fmt.Errorf("kafka: lag of group %q on %q: %s: %w", d.group, d.topic, what, wrapAuth(err))
	}
	commits, err := adm.FetchOffsets(ctx, d.group)
	if err != nil {
		return fail("committed offsets", err)
	}
	ends, err := adm.ListEndOffsets(ctx, d.topic)
	if err != nil {
		return fail("end offsets", err)
	}
	starts, err := adm.ListStartOffsets(ctx, d.topic)
	if err != nil {
		return fail("start offsets", err)
	}
	d.mu.Lock()
	var oldest int64
	taken := make(map[int32]int64, len(d.parts)) // partition -> the offset after the last record polled
	for id, p := range d.parts {
		taken[id] = p.fetchedTo
		ts := p.oldest()
		if ts == 0 && len(p.stash) > 0 {
			ts = p.stash[0].Timestamp.UnixNano()
		}
		if ts > 0 && (oldest == 0 || ts < oldest) {
			oldest = ts
		}
	}
	d.mu.Unlock()
	out := driver.Lag{Lanes: make(map[string]int64), Positions: make(map[string]int64)}
	var ferr error
	ends.Each(func(e kadm.ListedOffset) {
		if e.Topic != d.topic {
			return
		}
		if e.Err != nil {
			ferr = e.Err
			return
		}
		from := int64(0)
		if c, ok := commits.Lookup(d.topic, e.Partition); ok && c.Err == nil && c.At >= 0 {
			from = c.At
			out.Positions[strconv.Itoa(int(e.Partition))] = c.At
		} else if s, ok := starts.Lookup(d.topic, e.Partition); ok && s.Err == nil {
			from = s.Offset
		}
		lag := max(e.Offset-from, 0)
		out.Lanes[strconv.Itoa(int(e.Partition))] = lag
		held := min(max(taken[e.Partition]-from, 0), lag)
		out.InFlight += held
		out.Messages += lag - held
	})
	if ferr != nil {
		return fail("end offsets", ferr)
	}
	if oldest > 0 {
		out.OldestAge = time.Since(time.Unix(0, oldest))
	}
	return out, nil
}

// isAuthErr reports whether err is a failure to authenticate: SASL refused,
// or a TLS handshake that failed.
func isAuthErr(err error) bool {
	var (
		unknownCA x509.UnknownAuthorityError
		hostname  x509.HostnameError
		verify    *tls.CertificateVerificationError
		alert     tls.AlertError
	)
	return errors.Is(err, kerr.SaslAuthenticationFailed) ||
		errors.Is(err, kerr.IllegalSaslState) ||
		errors.Is(err, kerr.UnsupportedSaslMechanism) ||
		errors.As(err, &unknownCA) || errors.As(err, &hostname) ||
		errors.As(err, &verify) || errors.As(err, &alert)
}

// wrapAuth marks authentication failures with [consumer.ErrRefused] and
// ErrAuthentication.
func wrapAuth(err error) error {
	if err != nil && isAuthErr(err) && !errors.Is(err, ErrAuthentication) {
		return fmt.Errorf("%w: %w: %w", consumer.ErrRefused, ErrAuthentication, err)
	}
	return err
}
