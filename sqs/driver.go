package sqs

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
)

// receipt is the driver's handle of one delivery: what Settle, Extend and
// As are given back.
type receipt struct {
	handle     string
	msg        types.Message // as ReceiveMessage returned it, for As
	receivedAt time.Time     // when the receive that got it answered
	leaseStart time.Time     // when its visibility last started (while buffered)
	dead       atomic.Bool   // SQS refused its extension: the handle is no longer good
	capped     atomic.Bool   // reached MaxVisibility
}

// pending is a received message not yet handed to the loop.
type pending struct {
	r *receipt
	m driver.Message
}

// attemptID is a FIFO ReceiveRequestAttemptId of a receive that failed,
// to be reused by the next receive within SQS's five minutes.
type attemptID struct {
	id   string
	used time.Time
}

// Times the driver keeps to.
const (
	// recvSlack is how much longer than its wait time a receive may take
	// before it is given up as unanswered. With MaxWaitTime it makes
	// driver.ReportWithin: a receive open when SQS stops answering fails
	// within that, and the loop reports the outage.
	recvSlack = 2 * time.Second
	// stopWait is how long Fetch, when its context ends, waits for the
	// receives it has open to answer before it cuts them.
	stopWait = 500 * time.Millisecond
	// closeWait is how long Close waits for open short receives (a
	// backlog's, waiting a second) to end by themselves before it cuts
	// them. Long polls are cut at once: they ask for pollVisibility only.
	closeWait = 2 * time.Second
	// pollVisibility is the VisibilityTimeout a long poll (a wait above a
	// second) asks for; what it brings is extended to the Lease as soon as
	// it answers. A poll cut by Close, a timeout or the process ending
	// stays open in SQS until its wait time ends and takes the next
	// messages: they then stay invisible this long, not a whole lease.
	pollVisibility = 3 * time.Second
	// releaseTimeout bounds the call that gives back, at Close, messages
	// received and never handed over.
	releaseTimeout = 5 * time.Second
	// attemptIDTTL is how long a FIFO ReceiveRequestAttemptId is reused
	// (SQS keeps one for five minutes).
	attemptIDTTL = 4 * time.Minute
	// roomWait is how long a Fetch with room for less than a full receive
	// waits, with a backlog, for the acks in flight to make more, and
	// roomWaits how many times in a row before it receives what fits.
	roomWait  = 5 * time.Millisecond
	roomWaits = 4
	// batchCalls bounds the batch calls one Settle or Extend makes at once.
	batchCalls = 16
	// probeEvery is how often, on a FIFO queue, a consumer that holds
	// messages probes for other groups when nothing says there are any.
	probeEvery = time.Second
)

// MaxWaitTime is the longest a receive waits for messages to arrive
// (WaitTimeSeconds), and the default of [WithWaitTime]: with the time it
// allows the answer to take, it is [driver.ReportWithin], so that a consumer
// says within that time that SQS no longer answers, rather than after a
// long poll of SQS's 20 seconds.
const MaxWaitTime = driver.ReportWithin - recvSlack

// sqsDriver is the [driver.Driver] over one queue.
//
// The driver makes no call until Connect, or the first Fetch or Lag,
// looks the queue up; it looks it up again after SQS said that it does not
// exist. Fetch opens enough ReceiveMessage calls to cover the room the
// loop gives it (max), ten messages each, and no more, counting the
// receives still open and the messages waiting in buf: the loop's bound on
// messages in flight holds for the messages the driver holds too. Fetch
// returns as soon as one receive answers, and the others go on: what they
// bring waits in buf for the next Fetch, and the keeper goroutine extends
// it should it wait a third of the lease. Receives are opened only for a
// Fetch that waits (by it, or by a Settle that opens a FIFO group), so
// while the loop does not fetch (full, or paused by an open
// breaker) no new one is; when the loop stops, Drain (or the last Fetch)
// hands over what the open ones bring within a moment, and Close gives
// back what comes later.
type sqsDriver struct {
	b        *Broker
	queue    string // as the caller named it: a name or a URL
	name     string // the queue's name
	maxVis   time.Duration
	wait     int32
	httpOpt  func(*awssqs.Options)
	log      *slog.Logger
	capacity int

	qi    atomic.Pointer[queueInfo] // the latest look-up; nil before the first
	stale atomic.Bool               // SQS said the queue does not exist: look it up again
	lease atomic.Int64              // time.Duration: driver.MinLease until the first look-up, then the queue's visibility timeout

	// keepMu is held by whoever extends buffered messages (the keeper, or
	// Fetch before it hands them over), so that a message is never
	// extended after it was handed to the loop.
	keepMu sync.Mutex

	mu          sync.Mutex
	leased      bool // lease is the queue's and the keeper runs
	buf         []pending
	outstanding int // messages the open receives asked for
	receiving   int // open receives
	recvErr     error
	stopped     bool // Fetch saw its context end: open no more receives
	cut         bool // and handed over what it had: give back what comes later
	attemptIDs  []attemptID
	oldestSent  time.Time // of the messages of the latest receive that got any
	backlog     bool      // the latest receive came back full
	maxSeen     int       // the most room a Fetch was given
	roomWaits   int       // Fetches in a row that waited for room
	allowance   int       // room the last Fetch left: what Drain may hand over
	answers     uint64    // receives that answered (or failed), ever
	notify      chan struct{}

	// On a FIFO queue (see fillFIFO):
	unsettled  int       // messages handed to the loop and not yet settled
	fetchMax   int       // the max of the Fetch waiting for an answer; 0: none waits
	probeOK    bool      // a probe may go now: the last one came back full, or a Settle left groups unlocked since
	emptyProbe time.Time // when a probe last came back short

	recvCtx    context.Context // of short receives
	recvCancel context.CancelFunc
	pollCtx    context.Context // of long polls
	pollCancel context.CancelFunc
	wg         sync.WaitGroup
	done       chan struct{}
	closeOnce  sync.Once

	settleMu   sync.Mutex
	lastSettle time.Time // when the last Settle began; under settleMu
}

// settlers is how many Settle calls the loop may have out at once.
const settlers = 4

var (
	_ driver.Driver      = (*sqsDriver)(nil)
	_ driver.Connector   = (*sqsDriver)(nil)
	_ driver.Extender    = (*sqsDriver)(nil)
	_ driver.LagReporter = (*sqsDriver)(nil)
	_ driver.Drainer     = (*sqsDriver)(nil)
	_ driver.Aser        = (*sqsDriver)(nil)
)

func newDriver(b *Broker, queue, name string) *sqsDriver {
	d := &sqsDriver{
		b:        b,
		queue:    queue,
		name:     name,
		maxVis:   MaxVisibility,
		wait:     int32(b.cfg.waitTime / time.Second),
		log:      b.cfg.logger.With("queue", name),
		capacity: b.cfg.receivers * MaxBatch,
		notify:   make(chan struct{}),
		done:     make(chan struct{}),
	}
	d.lease.Store(int64(driver.MinLease))
	d.recvCtx, d.recvCancel = context.WithCancel(context.Background())
	d.pollCtx, d.pollCancel = context.WithCancel(context.Background())
	d.httpOpt = longPollHTTP(b.client, b.cfg.waitTime+recvSlack)
	return d
}

// longPollHTTP returns an option that gives ReceiveMessage an HTTP client
// whose timeout outlasts the long poll, when the client's own is shorter;
// nil when it needs none.
func longPollHTTP(c *awssqs.Client, need time.Duration) func(*awssqs.Options) {
	switch hc := c.Options().HTTPClient.(type) {
	case *awshttp.BuildableClient:
		if hc.GetTimeout() == 0 || hc.GetTimeout() >= need {
			return nil
		}
		longer := hc.WithTimeout(need)
		return func(o *awssqs.Options) { o.HTTPClient = longer }
	case *http.Client:
		if hc.Timeout == 0 || hc.Timeout >= need {
			return nil
		}
		// The same client (transport, redirects, cookies) with a timeout
		// that outlives the poll.
		longer := *hc
		longer.Timeout = need
		return func(o *awssqs.Options) { o.HTTPClient = &longer }
	}
	return nil
}

func (d *sqsDriver) closed() bool {
	select {
	case <-d.done:
		return true
	default:
		return false
	}
}

// signal wakes whoever waits on d.notify. Called with d.mu held.
func (d *sqsDriver) signal() {
	close(d.notify)
	d.notify = make(chan struct{})
}

// leaseNow is the lease the driver counts with.
func (d *sqsDriver) leaseNow() time.Duration { return time.Duration(d.lease.Load()) }

// callErr is callError for a call about the driver's queue.
func (d *sqsDriver) callErr(op string, err, last error) error {
	return d.b.callErr(op, d.name, err, last)
}

// Connect looks the queue up (GetQueueUrl for a name, then
// GetQueueAttributes), within [driver.ReportWithin]. A queue that does not
// exist yet fails with an error wrapping [consumer.ErrSourceNotFound], SQS
// not answering with one wrapping [consumer.ErrUnreachable] (both retried
// by the loop), and credentials or permissions SQS refuses with one
// wrapping [consumer.ErrRefused], marked [driver.Fatal]. So does a queue whose
// visibility timeout is below [driver.MinLease], with a
// *[consumer.ConfigError]: its leases cannot be kept.
func (d *sqsDriver) Connect(ctx context.Context) error {
	if d.closed() || d.b.isClosed() {
		return driver.Fatal(fmt.Errorf("sqs: connect to %q: %w", d.name, ErrClosed))
	}
	_, err := d.lookUp(ctx)
	return err
}

// lookUp asks SQS for the queue and adopts what it says.
func (d *sqsDriver) lookUp(ctx context.Context) (*queueInfo, error) {
	ctx, cancel := context.WithTimeout(ctx, driver.ReportWithin)
	defer cancel()
	q, err := d.b.lookUp(ctx, d.queue)
	if err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.leased {
		// The lease is the visibility timeout of the first look-up: the
		// loop has counted with it since, and every receive asks for it,
		// whatever the queue's attribute says later.
		if q.visibility < driver.MinLease {
			return nil, driver.Fatal(consumer.ConfigErrorf("VisibilityTimeout", "of queue %q is %s; a consumer needs at least %s to keep its messages", q.name, q.visibility, driver.MinLease))
		}
		d.lease.Store(int64(q.visibility))
		d.leased = true
		if !d.closed() {
			d.wg.Add(1)
			go d.keeper()
		}
	}
	d.qi.Store(q)
	d.stale.Store(false)
	return q, nil
}

// info returns the queue as last looked up, looking it up first when it
// never was or SQS said since that it does not exist.
func (d *sqsDriver) info(ctx context.Context) (*queueInfo, error) {
	if q := d.qi.Load(); q != nil && !d.stale.Load() {
		return q, nil
	}
	return d.lookUp(ctx)
}

// url is the queue's URL, for calls about messages received from it.
func (d *sqsDriver) url() string {
	if q := d.qi.Load(); q != nil {
		return q.url
	}
	return d.queue
}

// Fetch hands over up to max received messages. It opens receives for the
// room it was given that the receives already open and the messages
// already received do not cover, and returns as soon as one receive
// answers: with what it brought, with nothing when it brought nothing (so
// that the loop can pause fetching, for an open breaker, before the next),
// or with its error. The receives still open go on, and what they bring
// waits for the next Fetch. While receives come back full the queue has a
// backlog: Fetch opens as many as fill the room, each waiting at most a
// second. Once one comes back short, it keeps a single long poll open
// ([WithWaitTime]), which answers as soon as a message arrives. Fetch looks
// the queue up first when Connect did not, or when SQS said since that it
// does not exist.
func (d *sqsDriver) Fetch(ctx context.Context, dst []driver.Message, max int) ([]driver.Message, error) {
	max = min(max, d.capacity)
	if max <= 0 {
		max = 1
	}
	n := len(dst)
	dst, err := d.fetch(ctx, dst, max)
	d.mu.Lock()
	d.allowance = max - (len(dst) - n)
	d.mu.Unlock()
	return dst, err
}

func (d *sqsDriver) fetch(ctx context.Context, dst []driver.Message, max int) ([]driver.Message, error) {
	for {
		if d.closed() || d.b.isClosed() {
			return dst, driver.Fatal(fmt.Errorf("sqs: fetch from %q: %w", d.name, ErrClosed))
		}
		if err := ctx.Err(); err != nil {
			return d.stop(dst, max, err)
		}
		d.mu.Lock()
		if len(d.buf) > 0 {
			d.mu.Unlock()
			return d.handOver(dst, max), nil
		}
		if err := d.recvErr; err != nil {
			d.recvErr = nil
			d.mu.Unlock()
			return dst, err
		}
		if d.receiving == 0 && (d.qi.Load() == nil || d.stale.Load()) {
			d.mu.Unlock()
			if _, err := d.lookUp(ctx); err != nil {
				if ctx.Err() != nil {
					return d.stop(dst, max, ctx.Err())
				}
				return dst, err
			}
			continue
		}
		if max > d.maxSeen {
			d.maxSeen = max
		}
		if d.receiving == 0 && d.backlog && max < MaxBatch && d.maxSeen >= MaxBatch && d.roomWaits < roomWaits {
			// A backlog, and room for less than a full receive: let the
			// acks in flight make room first, a few milliseconds.
			d.roomWaits++
			d.mu.Unlock()
			t := time.NewTimer(roomWait)
			select {
			case <-t.C:
			case <-ctx.Done():
			case <-d.done:
			}
			t.Stop()
			return dst, nil
		}
		d.roomWaits = 0
		gate := d.fill(max - d.outstanding)
		wake, answers := d.notify, d.answers
		d.fetchMax = max
		d.mu.Unlock()
		var gateC <-chan time.Time
		var gateT *time.Timer
		if gate > 0 {
			gateT = time.NewTimer(gate)
			gateC = gateT.C
		}
		empty := false
		select {
		case <-wake:
			d.mu.Lock()
			// A receive that came back empty: return, as for any answer.
			empty = d.answers != answers && len(d.buf) == 0 && d.recvErr == nil
			d.mu.Unlock()
		case <-gateC:
		case <-ctx.Done():
		case <-d.done:
		}
		if gateT != nil {
			gateT.Stop()
		}
		d.mu.Lock()
		d.fetchMax = 0
		d.mu.Unlock()
		if empty {
			return dst, nil
		}
	}
}

// fill opens receives for room messages: with a backlog, ten messages each
// while ten fit (a smaller receive only when no other is open); without,
// one long poll, unless one is open. On a FIFO queue, fillFIFO decides.
// It returns how long until a receive it held back may go (0: none is
// held back). Called with d.mu held.
func (d *sqsDriver) fill(room int) time.Duration {
	q := d.qi.Load()
	if d.stopped || d.closed() || d.b.isClosed() {
		return 0
	}
	if q.fifo {
		return d.fillFIFO(q, room)
	}
	backlog := d.backlog
	if !backlog && d.receiving > 0 {
		return 0
	}
	for room > 0 && d.receiving < d.b.cfg.receivers {
		n := min(room, MaxBatch)
		if n < MaxBatch && d.receiving > 0 {
			return 0
		}
		room -= n
		wait := d.wait
		if backlog {
			wait = 1
		}
		d.open(q, n, wait, "")
		if !backlog {
			return 0
		}
	}
	return 0
}

// fillFIFO opens a receive on a FIFO queue: one at a time. SQS hands out
// no message of a group while another of it is in flight, so while this
// consumer holds messages, their groups are closed to every receive: one
// that waits would mostly wait for this consumer's own acks, and does
// nothing for the group meanwhile (on ElasticMQ it even slows the deletes
// that open the group, and receives that wait side by side stall it).
// So, holding nothing, the driver receives as on a standard queue (a
// second's wait with a backlog, else a long poll); holding messages, it
// probes for other groups with a receive that does not wait, and only
// when more may be there: after a probe that came back full, after a
// Settle that left others of the consumer's messages unsettled (the
// settled ones' groups are open again), or probeEvery after a probe that
// came back short. A group that is done is received again at once, the
// way a loop of one receive and one delete does.
func (d *sqsDriver) fillFIFO(q *queueInfo, room int) time.Duration {
	if d.receiving > 0 || room <= 0 {
		return 0
	}
	n := min(room, MaxBatch)
	wait := d.wait
	if d.backlog {
		wait = 1
	}
	if d.unsettled > 0 || len(d.buf) > 0 {
		if !d.probeOK {
			if left := probeEvery - time.Since(d.emptyProbe); left > 0 {
				return left
			}
		}
		wait = 0
	}
	d.open(q, n, wait, d.takeAttemptID())
	return 0
}

// open starts a receive of n messages that waits wait seconds. Called with
// d.mu held.
func (d *sqsDriver) open(q *queueInfo, n int, wait int32, attempt string) {
	d.outstanding += n
	d.receiving++
	d.wg.Add(1)
	go d.receive(q, int32(n), wait, attempt)
}

// takeAttemptID returns the ReceiveRequestAttemptId of a failed receive
// that may still be retried, or a fresh one. Called with d.mu held.
func (d *sqsDriver) takeAttemptID() string {
	for len(d.attemptIDs) > 0 {
		a := d.attemptIDs[len(d.attemptIDs)-1]
		d.attemptIDs = d.attemptIDs[:len(d.attemptIDs)-1]
		if time.Since(a.used) < attemptIDTTL {
			return a.id
		}
	}
	return randomID()
}

// receiveAttributes are the system attributes every receive asks for.
var receiveAttributes = []types.MessageSystemAttributeName{types.MessageSystemAttributeNameAll}

var allMessageAttributes = []string{"All"}

// receive makes one ReceiveMessage call on q for n messages and buffers
// what it brings.
func (d *sqsDriver) receive(q *queueInfo, n, wait int32, attempt string) {
	defer d.wg.Done()
	// Every receive asks for the visibility it relies on (not the queue's
	// attribute, which may have changed since it was read): the Lease, or
	// for a long poll pollVisibility, extended to the Lease on its answer.
	lease := d.leaseNow()
	vis, parent := lease, d.recvCtx
	if wait > 1 {
		parent = d.pollCtx
		vis = min(lease, pollVisibility)
	}
	in := &awssqs.ReceiveMessageInput{
		QueueUrl:                    aws.String(q.url),
		MaxNumberOfMessages:         n,
		WaitTimeSeconds:             wait,
		VisibilityTimeout:           int32(vis / time.Second),
		MessageSystemAttributeNames: receiveAttributes,
		MessageAttributeNames:       allMessageAttributes,
	}
	if attempt != "" {
		in.ReceiveRequestAttemptId = aws.String(attempt)
	}
	// An answer later than the wait plus recvSlack is none: SQS stopped
	// answering, and the loop must hear of it within driver.ReportWithin.
	timeout := time.Duration(wait)*time.Second + recvSlack
	ctx, cancel := context.WithTimeout(parent, timeout)
	last := &lastAttempt{}
	ctx = context.WithValue(ctx, lastAttemptKey{}, last)
	sent := time.Now()
	var out *awssqs.ReceiveMessageOutput
	var err error
	if d.httpOpt != nil {
		out, err = d.b.client.ReceiveMessage(ctx, in, recordAttempts, d.httpOpt)
	} else {
		out, err = d.b.client.ReceiveMessage(ctx, in, recordAttempts)
	}
	if err != nil && parent.Err() == nil && errors.Is(ctx.Err(), context.DeadlineExceeded) {
		err = fmt.Errorf("no answer within %s: %w", timeout, err)
	}
	cancel()
	// SQS starts the visibility when it hands the messages out, at the end
	// of a long poll; the answer's arrival is close after.
	at := time.Now()

	var got []pending
	var bad int
	if err == nil {
		got = make([]pending, 0, len(out.Messages))
		for i := range out.Messages {
			m := &out.Messages[i]
			r := &receipt{handle: aws.ToString(m.ReceiptHandle), msg: *m, receivedAt: at, leaseStart: at}
			p := pending{r: r, m: driver.Message{Handle: r}}
			if derr := decode(q, m, &p.m); derr != nil {
				bad++
			}
			got = append(got, p)
		}
	}
	if bad > 0 {
		d.log.Warn("ferry/sqs: received messages whose "+MetaAttribute+" attribute is malformed; delivering their body and attributes as SQS gave them", "count", bad)
	}
	var leaseErr error
	if len(got) > 0 && vis < lease {
		d.mu.Lock()
		keep := !d.cut && !d.closed()
		d.mu.Unlock()
		if keep {
			got, leaseErr = d.takeLease(got, at)
		}
	}

	d.mu.Lock()
	d.outstanding -= int(n)
	d.receiving--
	d.answers++
	release := d.cut || d.closed()
	switch {
	case err != nil:
		if attempt != "" && !d.closed() {
			// A receive that may have been taken by SQS: retry with the
			// same id, so a FIFO queue hands the same messages back
			// instead of holding their groups until the visibility ends.
			d.attemptIDs = append(d.attemptIDs, attemptID{attempt, sent})
		}
		if !d.closed() && !errors.Is(err, context.Canceled) {
			if isQueueGone(err) {
				d.stale.Store(true)
				d.b.forget(d.queue)
			}
			d.recvErr = d.callErr("ReceiveMessage", err, last.get())
		}
	case release:
	default:
		if leaseErr != nil && len(got) == 0 {
			// SQS took the messages back from us, or stopped answering:
			// the loop hears of it as of a failed receive.
			d.recvErr = leaseErr
		}
		full := len(got) == int(n)
		if wait == 0 {
			// A FIFO probe: it says whether other groups are open, not
			// whether the queue has a backlog.
			d.probeOK = full
			if !full {
				d.emptyProbe = at
			}
		} else {
			d.backlog = full
		}
		if len(got) > 0 {
			oldest := got[0].m.PublishedAt
			for _, p := range got[1:] {
				if p.m.PublishedAt.Before(oldest) {
					oldest = p.m.PublishedAt
				}
			}
			d.oldestSent = oldest
		}
		d.buf = append(d.buf, got...)
	}
	d.signal()
	d.mu.Unlock()
	if release && len(got) > 0 {
		d.release(got)
	}
}

// takeLease extends what a long poll brought, received at at with
// pollVisibility, to the Lease, and returns the messages it extended.
// Those it could not extend are left to come back after pollVisibility
// rather than handed to the loop, which would count a whole lease; err
// says why, when none could be.
func (d *sqsDriver) takeLease(got []pending, at time.Time) ([]pending, error) {
	rs := make([]*receipt, len(got))
	for i, p := range got {
		rs[i] = p.r
	}
	ctx, cancel := context.WithTimeout(context.Background(), pollVisibility)
	err := d.extend(ctx, rs, d.leaseNow())
	cancel()
	kept := got[:0]
	for _, p := range got {
		if !p.r.leaseStart.Equal(at) && !p.r.dead.Load() {
			kept = append(kept, p)
		}
	}
	if n := len(got) - len(kept); n > 0 {
		d.log.Warn("ferry/sqs: extending messages a long poll brought failed; they come back after a few seconds", "err", err, "count", n)
	}
	clear(got[len(kept):])
	return kept, err
}

// handOver moves up to max buffered messages to dst. Messages that waited
// in the buffer long enough for their visibility to be partly spent are
// extended first, so the loop, which counts a lease from the hand-over,
// extends them in time.
func (d *sqsDriver) handOver(dst []driver.Message, max int) []driver.Message {
	d.keepMu.Lock()
	defer d.keepMu.Unlock()
	d.mu.Lock()
	n := min(max, len(d.buf))
	taken := make([]pending, n)
	copy(taken, d.buf)
	clear(d.buf[:n])
	d.buf = d.buf[n:]
	if len(d.buf) == 0 {
		d.buf = nil
	}
	d.mu.Unlock()
	var aged []*receipt
	now := time.Now()
	lease := d.leaseNow()
	for _, p := range taken {
		if now.Sub(p.r.leaseStart) > lease/12 {
			aged = append(aged, p.r)
		}
	}
	if len(aged) > 0 {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if err := d.extend(ctx, aged, lease); err != nil {
			d.log.Warn("ferry/sqs: extending received messages before handing them over failed", "err", err, "count", len(aged))
		}
		cancel()
	}
	handed := 0
	for _, p := range taken {
		if p.r.dead.Load() {
			// Its visibility ran out in the buffer (another receive may
			// hold it now): not handed over, counted in LeasesLost.
			continue
		}
		dst = append(dst, p.m)
		handed++
	}
	d.mu.Lock()
	d.unsettled += handed
	d.mu.Unlock()
	return dst
}

// stop ends fetching: no receive is opened any more, the receives still
// open get a moment to answer, and what was received is handed over with
// err. Receives still open after that are not cut (SQS would keep a cut
// poll open and hand it the next messages, left invisible for the
// visibility timeout): they end by themselves, and what they bring is
// given back at once; Close waits for them.
func (d *sqsDriver) stop(dst []driver.Message, max int, err error) ([]driver.Message, error) {
	d.settleOpen(context.Background())
	return d.handOver(dst, max), err
}

// settleOpen marks the driver stopped, waits up to stopWait (or ctx) for
// the receives still open to answer, and marks it cut: what comes later is
// given back at once.
func (d *sqsDriver) settleOpen(ctx context.Context) {
	d.mu.Lock()
	if d.cut {
		d.mu.Unlock()
		return
	}
	d.stopped = true
	timer := time.NewTimer(stopWait)
wait:
	for d.receiving > 0 {
		wake := d.notify
		d.mu.Unlock()
		select {
		case <-wake:
		case <-timer.C:
			d.mu.Lock()
			break wait
		case <-ctx.Done():
			d.mu.Lock()
			break wait
		case <-d.done:
		}
		d.mu.Lock()
	}
	timer.Stop()
	d.cut = true
	d.mu.Unlock()
}

// Drain ends fetching when the loop stops: no receive is opened any more,
// the receives still open get a moment to answer (as when the last Fetch
// saw its context end), and what they and the earlier ones brought is
// handed over, as much as the room the last Fetch left. The loop runs it
// within its shutdown grace. What does not fit, and what receives bring
// later, is made visible again at once by Close.
func (d *sqsDriver) Drain(ctx context.Context, dst []driver.Message) ([]driver.Message, error) {
	d.settleOpen(ctx)
	d.mu.Lock()
	room := d.allowance
	d.mu.Unlock()
	if room <= 0 {
		return dst, nil
	}
	return d.handOver(dst, room), nil
}

// keeper extends the visibility of messages that wait in the buffer (the
// loop is not fetching: full, or paused by an open breaker) before a third
// of it is left.
func (d *sqsDriver) keeper() {
	defer d.wg.Done()
	lease := d.leaseNow()
	t := time.NewTicker(max(lease/6, 50*time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-d.done:
			return
		case <-t.C:
		}
		d.keepMu.Lock()
		d.mu.Lock()
		var due []*receipt
		now := time.Now()
		for _, p := range d.buf {
			if now.Sub(p.r.leaseStart) >= lease/3 && !p.r.dead.Load() {
				due = append(due, p.r)
			}
		}
		d.mu.Unlock()
		if len(due) > 0 {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			if err := d.extend(ctx, due, lease); err != nil {
				d.log.Warn("ferry/sqs: extending received messages failed", "err", err, "count", len(due))
			}
			cancel()
			d.mu.Lock()
			kept := d.buf[:0]
			for _, p := range d.buf {
				if !p.r.dead.Load() {
					kept = append(kept, p)
				}
			}
			clear(d.buf[len(kept):])
			d.buf = kept
			d.mu.Unlock()
		}
		d.keepMu.Unlock()
	}
}

// release makes received messages visible again at once: their consumer
// stopped before it could hand them over. Each still counts a receive.
func (d *sqsDriver) release(ps []pending) {
	ctx, cancel := context.WithTimeout(context.Background(), releaseTimeout)
	defer cancel()
	batch := make([]driver.Settlement, len(ps))
	for i, p := range ps {
		batch[i] = driver.Settlement{Handle: p.r, Action: driver.Return, NotAttempted: true}
	}
	if err := d.settle(ctx, batch); err != nil {
		d.log.Warn("ferry/sqs: giving back messages received as the consumer stopped failed; they come back after their visibility timeout", "err", err, "count", len(ps))
	}
	d.b.stats.released.Add(int64(len(ps)))
}

// Capabilities reports that SQS redelivers returned messages, and that
// Settle takes several calls at once.
func (d *sqsDriver) Capabilities() driver.Capabilities {
	// Deletes and returns of different messages are independent calls:
	// acks decided while a call is out go in another, once they fill one.
	return driver.Capabilities{Redelivers: true, Source: d.name, System: MessagingSystem, Settlers: settlers, SettleBatch: MaxBatch}
}

// Lease is the queue's visibility timeout, as the driver's first look-up
// of the queue found it; before that, [driver.MinLease], the shortest the
// loop keeps: a loop that reads it before its consumer reached SQS checks
// its leases often enough for any queue.
func (d *sqsDriver) Lease() time.Duration { return d.leaseNow() }

// As serves [consumer.Message.As]: a *types.Message target gets the message
// as ReceiveMessage returned it.
func (d *sqsDriver) As(handle, target any) bool {
	r, ok := handle.(*receipt)
	if !ok || r == nil {
		return false
	}
	switch t := target.(type) {
	case *types.Message:
		if t == nil {
			return false
		}
		*t = r.msg
		return true
	}
	return false
}

// Settle deletes acknowledged messages (DeleteMessageBatch) and changes the
// visibility of returned ones to their delay (ChangeMessageVisibilityBatch),
// ten entries a call, the calls made at once. A batch smaller than ten that
// follows the previous one within the settle window waits out the window
// first, so that under load the next batch gathers more. Entries SQS
// refused are retried once when SQS was at fault, and the rest reported in
// a *[driver.SettleError] by index. The loop may have up to settlers calls
// out at once (see Capabilities). On a FIFO queue, a Fetch that waits
// receives again as soon as a Settle is done: the settled messages'
// groups are open again (see fillFIFO).
func (d *sqsDriver) Settle(ctx context.Context, batch []driver.Settlement) error {
	if len(batch) == 0 {
		return nil
	}
	d.settleMu.Lock()
	last := d.lastSettle
	d.settleMu.Unlock()
	if w := d.b.cfg.settleWindow; w > 0 && len(batch) < MaxBatch {
		if since := time.Since(last); since < w {
			t := time.NewTimer(w - since)
			select {
			case <-t.C:
			case <-ctx.Done():
			case <-d.done:
			}
			t.Stop()
		}
	}
	d.settleMu.Lock()
	d.lastSettle = time.Now()
	d.settleMu.Unlock()
	err := d.settle(ctx, batch)
	d.mu.Lock()
	// Settled or not (a failed one the loop leaves to come back after its
	// lease), the loop holds these no more.
	d.unsettled = max(d.unsettled-len(batch), 0)
	if q := d.qi.Load(); q != nil && q.fifo {
		if d.unsettled > 0 {
			d.probeOK = true // the groups of these are open again
		}
		if d.fetchMax > 0 {
			// The groups these held are open: the Fetch that waits
			// receives again at once, without waking first.
			d.fill(d.fetchMax - d.outstanding)
		}
		d.signal()
	}
	d.mu.Unlock()
	return err
}

// visibility is the VisibilityTimeout, in seconds, that gives r a further
// dur from now: whole seconds rounded up, within what is left of the
// 12-hour limit since r was received. ok is false when nothing is left.
func (d *sqsDriver) visibility(r *receipt, dur time.Duration) (secs int32, ok bool) {
	left := d.maxVis - time.Since(r.receivedAt) - time.Second
	if left <= 0 {
		return 0, false
	}
	dur = min(dur, left)
	return int32(math.Ceil(dur.Seconds())), true
}

func (d *sqsDriver) settle(ctx context.Context, batch []driver.Settlement) error {
	var acks, rets []int
	for i := range batch {
		if batch[i].Action == driver.Ack {
			acks = append(acks, i)
		} else {
			rets = append(rets, i)
		}
	}
	var (
		mu     sync.Mutex
		failed []int
		errs   []error
	)
	fail := func(idx []int, err error) {
		mu.Lock()
		failed = append(failed, idx...)
		errs = append(errs, err)
		mu.Unlock()
	}
	var calls []func()
	for start := 0; start < len(acks); start += MaxBatch {
		chunk := acks[start:min(start+MaxBatch, len(acks))]
		calls = append(calls, func() { d.deleteChunk(ctx, batch, chunk, fail) })
	}
	for start := 0; start < len(rets); start += MaxBatch {
		chunk := rets[start:min(start+MaxBatch, len(rets))]
		calls = append(calls, func() { d.returnChunk(ctx, batch, chunk, fail) })
	}
	runAll(calls)
	if len(failed) == 0 {
		return nil
	}
	return &driver.SettleError{Failed: failed, Err: errors.Join(errs...)}
}

// runAll runs fns, at most batchCalls at once, and waits for them.
func runAll(fns []func()) {
	if len(fns) == 1 {
		fns[0]()
		return
	}
	var wg sync.WaitGroup
	sem := make(chan struct{}, batchCalls)
	for _, fn := range fns {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			fn()
		}()
	}
	wg.Wait()
}

func (d *sqsDriver) deleteChunk(ctx context.Context, batch []driver.Settlement, idx []int, fail func([]int, error)) {
	const op = "DeleteMessageBatch"
	todo := idx
	for try := 0; len(todo) > 0; try++ {
		entries := make([]types.DeleteMessageBatchRequestEntry, len(todo))
		for j, i := range todo {
			r, _ := batch[i].Handle.(*receipt)
			if r == nil {
				fail([]int{i}, fmt.Errorf("sqs: %s on %q: handle %T is not an SQS receipt", op, d.name, batch[i].Handle))
				continue
			}
			entries[j] = types.DeleteMessageBatchRequestEntry{Id: aws.String(strconv.Itoa(i)), ReceiptHandle: aws.String(r.handle)}
		}
		entries = compact(entries, func(e types.DeleteMessageBatchRequestEntry) bool { return e.Id != nil })
		if len(entries) == 0 {
			return
		}
		out, err := d.b.client.DeleteMessageBatch(ctx, &awssqs.DeleteMessageBatchInput{QueueUrl: aws.String(d.url()), Entries: entries})
		if err != nil {
			fail(ids(entries, func(e types.DeleteMessageBatchRequestEntry) *string { return e.Id }), d.callErr(op, err, nil))
			return
		}
		todo = d.entryFailures(op, out.Failed, try, fail)
	}
}

func (d *sqsDriver) returnChunk(ctx context.Context, batch []driver.Settlement, idx []int, fail func([]int, error)) {
	const op = "ChangeMessageVisibilityBatch"
	todo := idx
	for try := 0; len(todo) > 0; try++ {
		entries := make([]types.ChangeMessageVisibilityBatchRequestEntry, 0, len(todo))
		for _, i := range todo {
			s := &batch[i]
			r, _ := s.Handle.(*receipt)
			if r == nil {
				fail([]int{i}, fmt.Errorf("sqs: %s on %q: handle %T is not an SQS receipt", op, d.name, s.Handle))
				continue
			}
			secs, ok := d.visibility(r, s.Delay)
			if !ok {
				// Nothing left of the 12 hours: it comes back by itself now.
				continue
			}
			if secs == 0 && !s.NotAttempted {
				// A failed run never comes straight back: no hot loop of
				// zero-visibility returns.
				secs = 1
			}
			entries = append(entries, types.ChangeMessageVisibilityBatchRequestEntry{
				Id: aws.String(strconv.Itoa(i)), ReceiptHandle: aws.String(r.handle), VisibilityTimeout: secs,
			})
		}
		if len(entries) == 0 {
			return
		}
		out, err := d.b.client.ChangeMessageVisibilityBatch(ctx, &awssqs.ChangeMessageVisibilityBatchInput{QueueUrl: aws.String(d.url()), Entries: entries})
		if err != nil {
			fail(ids(entries, func(e types.ChangeMessageVisibilityBatchRequestEntry) *string { return e.Id }), d.callErr(op, err, nil))
			return
		}
		todo = d.entryFailures(op, out.Failed, try, fail)
	}
}

// entryFailures reports the failed entries of a batch call, by their ids
// (the batch indices), and returns those worth one more try: SQS's own
// fault, on the first try.
func (d *sqsDriver) entryFailures(op string, failed []types.BatchResultErrorEntry, try int, fail func([]int, error)) []int {
	var again []int
	for _, f := range failed {
		i, err := strconv.Atoi(aws.ToString(f.Id))
		if err != nil {
			continue
		}
		e := entryError(op, d.name, f)
		if !e.SenderFault && try == 0 {
			again = append(again, i)
			continue
		}
		fail([]int{i}, e)
	}
	return again
}

func ids[E any](entries []E, id func(E) *string) []int {
	out := make([]int, 0, len(entries))
	for _, e := range entries {
		if i, err := strconv.Atoi(aws.ToString(id(e))); err == nil {
			out = append(out, i)
		}
	}
	return out
}

func compact[E any](s []E, keep func(E) bool) []E {
	out := s[:0]
	for _, e := range s {
		if keep(e) {
			out = append(out, e)
		}
	}
	return out
}

// Extend gives each delivery a fresh visibility of dur from now
// (ChangeMessageVisibilityBatch, ten a call, the calls made at once), up to
// SQS's 12-hour limit since it was received; a delivery at the limit is no
// longer extended. A delivery whose receipt handle SQS no longer takes (its
// visibility ran out) ends its extension quietly and is counted in
// [Stats.LeasesLost]; other failures are returned.
func (d *sqsDriver) Extend(ctx context.Context, handles []any, dur time.Duration) error {
	rs := make([]*receipt, 0, len(handles))
	for _, h := range handles {
		if r, ok := h.(*receipt); ok && r != nil {
			rs = append(rs, r)
		}
	}
	return d.extend(ctx, rs, dur)
}

func (d *sqsDriver) extend(ctx context.Context, rs []*receipt, dur time.Duration) error {
	const op = "ChangeMessageVisibilityBatch"
	type entry struct {
		r    *receipt
		secs int32
	}
	var todo []entry
	for _, r := range rs {
		if r.dead.Load() || r.capped.Load() {
			continue
		}
		secs, ok := d.visibility(r, dur)
		if !ok {
			if r.capped.CompareAndSwap(false, true) {
				d.b.stats.visibilityCapped.Add(1)
				d.log.Warn("ferry/sqs: a message reached SQS's 12-hour visibility limit; it will be delivered again while its handler runs",
					"message_id", aws.ToString(r.msg.MessageId))
			}
			continue
		}
		todo = append(todo, entry{r, secs})
	}
	var (
		mu   sync.Mutex
		errs []error
	)
	now := time.Now()
	var calls []func()
	for start := 0; start < len(todo); start += MaxBatch {
		chunk := todo[start:min(start+MaxBatch, len(todo))]
		calls = append(calls, func() {
			entries := make([]types.ChangeMessageVisibilityBatchRequestEntry, len(chunk))
			for j, e := range chunk {
				entries[j] = types.ChangeMessageVisibilityBatchRequestEntry{
					Id: aws.String(strconv.Itoa(j)), ReceiptHandle: aws.String(e.r.handle), VisibilityTimeout: e.secs,
				}
			}
			out, err := d.b.client.ChangeMessageVisibilityBatch(ctx, &awssqs.ChangeMessageVisibilityBatchInput{QueueUrl: aws.String(d.url()), Entries: entries})
			if err != nil {
				mu.Lock()
				errs = append(errs, d.callErr(op, err, nil))
				mu.Unlock()
				return
			}
			failed := make(map[int]bool, len(out.Failed))
			for _, f := range out.Failed {
				j, err := strconv.Atoi(aws.ToString(f.Id))
				if err != nil || j < 0 || j >= len(chunk) {
					continue
				}
				failed[j] = true
				e := entryError(op, d.name, f)
				if e.visibilityLimit() {
					if chunk[j].r.capped.CompareAndSwap(false, true) {
						d.b.stats.visibilityCapped.Add(1)
						d.log.Warn("ferry/sqs: a message reached SQS's 12-hour visibility limit; it will be delivered again while its handler runs",
							"message_id", aws.ToString(chunk[j].r.msg.MessageId))
					}
					continue
				}
				if e.expiredHandle() {
					if chunk[j].r.dead.CompareAndSwap(false, true) {
						d.b.stats.leasesLost.Add(1)
						d.log.Debug("ferry/sqs: a message's visibility ran out before it could be extended; another receive may hold it",
							"message_id", aws.ToString(chunk[j].r.msg.MessageId), "code", e.Code)
					}
					continue
				}
				mu.Lock()
				errs = append(errs, e)
				mu.Unlock()
			}
			for j, e := range chunk {
				if !failed[j] {
					e.r.leaseStart = now
				}
			}
		})
	}
	runAll(calls)
	return errors.Join(errs...)
}

// Lag reports the queue's depth from GetQueueAttributes: Messages counts
// the visible and the delayed messages, InFlight those received and not yet
// deleted or visible again (by every consumer of the queue). OldestAge is
// an estimate from the messages this driver received last: how long ago
// the oldest of them was sent, while the queue still has visible messages;
// zero once it has none, or before anything was received.
func (d *sqsDriver) Lag(ctx context.Context) (driver.Lag, error) {
	q, err := d.info(ctx)
	if err != nil {
		return driver.Lag{}, err
	}
	last := &lastAttempt{}
	out, err := d.b.client.GetQueueAttributes(context.WithValue(ctx, lastAttemptKey{}, last), &awssqs.GetQueueAttributesInput{
		QueueUrl: aws.String(q.url),
		AttributeNames: []types.QueueAttributeName{
			types.QueueAttributeNameApproximateNumberOfMessages,
			types.QueueAttributeNameApproximateNumberOfMessagesNotVisible,
			types.QueueAttributeNameApproximateNumberOfMessagesDelayed,
		},
	}, recordAttempts)
	if err != nil {
		if isQueueGone(err) {
			d.stale.Store(true)
			d.b.forget(d.queue)
		}
		return driver.Lag{}, d.callErr("GetQueueAttributes", err, last.get())
	}
	num := func(n types.QueueAttributeName) int64 {
		v, _ := strconv.ParseInt(out.Attributes[string(n)], 10, 64)
		return v
	}
	visible := num(types.QueueAttributeNameApproximateNumberOfMessages)
	delayed := num(types.QueueAttributeNameApproximateNumberOfMessagesDelayed)
	l := driver.Lag{
		Messages: visible + delayed,
		Delayed:  delayed,
		InFlight: num(types.QueueAttributeNameApproximateNumberOfMessagesNotVisible),
		// SQS's counts are eventually consistent: right after a send or a
		// receive they may trail the queue for a moment.
		Approximate: true,
	}
	d.mu.Lock()
	oldest := d.oldestSent
	d.mu.Unlock()
	if visible > 0 && !oldest.IsZero() {
		l.OldestAge = max(time.Since(oldest), 0)
	}
	return l, nil
}

// Close ends the driver: no receive is opened any more, open receives are
// left to end by themselves (a long poll within its wait time; one cut
// would stay open in SQS and take the next messages), messages received
// and not handed over are made visible again at once, and later calls fail
// with ErrClosed. Messages the loop holds and did not settle come back
// after their visibility timeout.
func (d *sqsDriver) Close() error {
	d.closeOnce.Do(func() {
		d.mu.Lock()
		d.stopped = true
		close(d.done) // under d.mu: fill opens no receive after this
		d.mu.Unlock()
		// A long poll is cut: Run must return within its grace, and a
		// cut poll strands messages for pollVisibility only. Short
		// receives get closeWait to end by themselves.
		d.pollCancel()
		ended := make(chan struct{})
		go func() { d.wg.Wait(); close(ended) }()
		t := time.NewTimer(closeWait)
		select {
		case <-ended:
		case <-t.C:
			d.recvCancel()
			<-ended
		}
		t.Stop()
		d.recvCancel()
		d.mu.Lock()
		left := d.buf
		d.buf = nil
		d.mu.Unlock()
		if len(left) > 0 {
			d.release(left)
		}
		d.b.dropDriver(d)
	})
	return nil
}
