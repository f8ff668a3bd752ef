// Package ferry opens any broker Ferry runs on from a URL, as Go CDK opens
// its topics and subscriptions: one line of configuration picks the broker,
// and the code that publishes and consumes stays the same.
//
//	b, err := ferry.Open(ctx, os.Getenv("BROKER_URL")) // mem://, kafka://, sqs://, amqp://, amqps://
//	if err != nil {
//		return err
//	}
//	defer b.Close()
//	err = b.Publish(ctx, "orders", consumer.Message{Key: "o-1", Body: body})
//	c, err := b.NewConsumer(ctx, "orders", consumer.WithName("billing"))
//
// The URL forms, each described on [Open]:
//
//	mem://                        a new in-process broker (package memory)
//	mem://NAME                    the in-process broker NAME, shared within the process
//	kafka://HOST:PORT[,HOST:PORT] Apache Kafka (package kafka)
//	sqs://[?region=R&endpoint=E]  Amazon SQS or a compatible server (package sqs)
//	https://sqs.REGION.amazonaws.com/ACCOUNT/QUEUE   an SQS queue URL
//	amqp://USER:PASS@HOST:PORT/VHOST, amqps://...    RabbitMQ (package rabbit)
//
// What a URL cannot carry (a TLS configuration of your own, a logger,
// franz-go or AWS options) stays a Go option of the broker's own package:
// build the Broker there when you need them. A URL that is wrong gets a
// *URLError naming the part that is wrong; a password in a URL never
// appears in an error or a log line.
package ferry

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/memory"
)

// Broker is what Open returns: a Publisher, and a source of consumers. The
// source of NewConsumer is a queue (memory, SQS, RabbitMQ) or a topic
// (Kafka).
type Broker interface {
	consumer.Publisher
	// NewConsumer returns a consumer loop over source.
	NewConsumer(ctx context.Context, source string, opts ...consumer.Option) (*consumer.Loop, error)
	// Close releases the broker's connections.
	Close() error
}

// ErrBadURL matches every *URLError through errors.Is.
var ErrBadURL = errors.New("ferry: bad broker URL")

// URLError says what is wrong with a broker URL. Its URL has any password
// replaced with "xxxxx".
type URLError struct {
	URL    string
	Part   string // the part that is wrong: "scheme", "host", "query parameter region", ...
	Reason string
	Err    error // the underlying error, if any
}

func (e *URLError) Error() string {
	s := "ferry: broker URL " + strconv.Quote(e.URL) + ": " + e.Part + " " + e.Reason
	if e.Err != nil {
		s += ": " + Redact(e.Err.Error())
	}
	return s
}

// Is reports whether target is ErrBadURL.
func (e *URLError) Is(target error) bool { return target == ErrBadURL }

// Unwrap returns the underlying error.
func (e *URLError) Unwrap() error { return e.Err }

// passwordInURL finds the password of a URL's user information, for the
// URLs url.Parse refuses too.
var passwordInURL = regexp.MustCompile(`(://[^:/@\s]*:)[^@\s]*@`)

// Redact replaces the password of every URL in s with "xxxxx".
func Redact(s string) string {
	return passwordInURL.ReplaceAllString(s, "${1}xxxxx@")
}

// opener opens the broker of one scheme.
type opener func(ctx context.Context, u *url.URL, raw string) (Broker, error)

var (
	openersMu sync.RWMutex
	openers   = map[string]opener{"mem": openMem}
)

// register adds the opener of a scheme.
func register(scheme string, o opener) {
	openersMu.Lock()
	defer openersMu.Unlock()
	openers[scheme] = o
}

// Open opens the broker a URL names.
//
// mem:// opens a new in-process broker; mem://NAME opens the one named
// NAME, shared by every Open of that name in the process (as a test double
// shared by a publisher and a consumer built apart). Query parameters:
// autocreate=false (queues must be created first, as on SQS), dedup_window
// (a duration such as 5m; 0 turns FIFO deduplication off).
func Open(ctx context.Context, rawURL string) (Broker, error) {
	shown := Redact(rawURL)
	if rawURL == "" {
		return nil, &URLError{URL: shown, Part: "URL", Reason: "is empty"}
	}
	u, err := url.Parse(rawURL)
	if err != nil {
		// Not url.Parse's message: it may quote any part of the URL,
		// the password included (an unescaped '/' in it ends the host).
		return nil, &URLError{URL: shown, Part: "URL", Reason: "does not parse as a URL (escape special characters in the user and password)"}
	}
	scheme := strings.ToLower(u.Scheme)
	if scheme == "https" || scheme == "http" {
		if isSQSQueueURL(u) {
			scheme = "sqs-queue-url"
		}
	}
	openersMu.RLock()
	o := openers[scheme]
	openersMu.RUnlock()
	if o == nil {
		return nil, &URLError{URL: shown, Part: "scheme", Reason: fmt.Sprintf("%q is not one Ferry opens (%s)", u.Scheme, strings.Join(schemes(), ", "))}
	}
	return o(ctx, u, shown)
}

func schemes() []string {
	openersMu.RLock()
	defer openersMu.RUnlock()
	out := []string{}
	for s := range openers {
		if s != "sqs-queue-url" {
			out = append(out, s)
		}
	}
	slices.Sort(out)
	return out
}

// isSQSQueueURL reports whether u looks like an SQS queue URL:
// https://sqs.REGION.amazonaws.com/ACCOUNT/QUEUE.
func isSQSQueueURL(u *url.URL) bool {
	host := strings.ToLower(u.Hostname())
	return strings.HasPrefix(host, "sqs.") && strings.HasSuffix(host, ".amazonaws.com") && strings.Count(strings.Trim(u.Path, "/"), "/") == 1
}

// query checks that u's query holds only the parameters named, and returns
// it.
func query(u *url.URL, shown string, allowed ...string) (url.Values, error) {
	q := u.Query()
	for k := range q {
		ok := false
		for _, a := range allowed {
			ok = ok || k == a
		}
		if !ok {
			return nil, &URLError{URL: shown, Part: "query parameter " + k, Reason: fmt.Sprintf("is not one this broker takes (%s)", strings.Join(allowed, ", "))}
		}
	}
	return q, nil
}

var (
	sharedMemMu sync.Mutex
	sharedMem   = map[string]*sharedMemBroker{}
)

// sharedMemBroker is a named memory broker, closed when the last Broker
// opened on it is closed.
type sharedMemBroker struct {
	b     *memory.Broker
	users int
}

func openMem(_ context.Context, u *url.URL, shown string) (Broker, error) {
	q, err := query(u, shown, "autocreate", "dedup_window")
	if err != nil {
		return nil, err
	}
	var opts []memory.Option
	if v := q.Get("autocreate"); v != "" {
		on, err := strconv.ParseBool(v)
		if err != nil {
			return nil, &URLError{URL: shown, Part: "query parameter autocreate", Reason: "is not true or false", Err: err}
		}
		opts = append(opts, memory.WithAutoCreate(on))
	}
	if v := q.Get("dedup_window"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			return nil, &URLError{URL: shown, Part: "query parameter dedup_window", Reason: "is not a duration such as 5m", Err: err}
		}
		opts = append(opts, memory.WithDedupWindow(d))
	}
	if u.Path != "" && u.Path != "/" {
		return nil, &URLError{URL: shown, Part: "path", Reason: "must be empty (mem://NAME names a shared broker)"}
	}
	name := u.Host
	if name == "" {
		b, err := memory.New(opts...)
		if err != nil {
			return nil, &URLError{URL: shown, Part: "query", Reason: "is invalid", Err: err}
		}
		return memBroker{Broker: b}, nil
	}
	sharedMemMu.Lock()
	defer sharedMemMu.Unlock()
	s := sharedMem[name]
	if s == nil {
		b, err := memory.New(opts...)
		if err != nil {
			return nil, &URLError{URL: shown, Part: "query", Reason: "is invalid", Err: err}
		}
		s = &sharedMemBroker{b: b}
		sharedMem[name] = s
	}
	s.users++
	return &memShared{memBroker: memBroker{Broker: s.b}, name: name, s: s}, nil
}

// memBroker is a memory.Broker as a Broker.
type memBroker struct{ *memory.Broker }

func (m memBroker) NewConsumer(_ context.Context, queue string, opts ...consumer.Option) (*consumer.Loop, error) {
	return m.Broker.NewConsumer(queue, opts...)
}

// memShared is one Open of a named memory broker.
type memShared struct {
	memBroker
	name   string
	s      *sharedMemBroker
	closed sync.Once
}

// Close closes the named broker when it was the last Open of it.
func (m *memShared) Close() error {
	var err error
	m.closed.Do(func() {
		sharedMemMu.Lock()
		defer sharedMemMu.Unlock()
		m.s.users--
		if m.s.users == 0 {
			delete(sharedMem, m.name)
			err = m.s.b.Close()
		}
	})
	return err
}

// Memory returns the memory.Broker behind a Broker opened with mem://, for
// what only the memory broker has (CreateQueue, Stats, Messages).
func Memory(b Broker) (*memory.Broker, bool) {
	switch m := b.(type) {
	case memBroker:
		return m.Broker, true
	case *memShared:
		return m.Broker, true
	}
	return nil, false
}
