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
// The URL forms, each described in a section below with every query
// parameter it takes:
//
//	mem://                          a new in-process broker (package memory)
//	mem://NAME                      the in-process broker NAME, shared within the process
//	kafka://HOST:PORT[,HOST:PORT]   Apache Kafka (package kafka)
//	sqs://                          Amazon SQS (package sqs)
//	sqs://HOST:PORT                 an SQS-compatible server: the host is the endpoint
//	https://sqs.REGION.amazonaws.com/ACCOUNT/QUEUE   an SQS queue URL
//	amqp://USER:PASSWORD@HOST:PORT/VHOST, amqps://...  RabbitMQ (package rabbit)
//
// A query parameter a scheme does not take is an error, as is a value a
// parameter cannot take. What a URL cannot carry (a TLS configuration of your own,
// a logger, franz-go or AWS options) stays a Go option of the broker's own
// package: build the Broker there when you need them.
//
// A URL that is wrong gets a *URLError naming the part that is wrong. A
// password in a URL never appears in an error or a log line: see
// [Redact].
//
// # Memory
//
//	mem://[NAME][?autocreate=false&dedup_window=DURATION]
//
// mem:// opens a new in-process broker with real queue semantics (package
// memory). mem://NAME opens the one named NAME, shared by every Open of that
// name in the process (a test double shared by a publisher and a consumer
// built apart), and closes it with the last of them. [Memory] returns the
// memory.Broker behind it. Query parameters:
//
//   - autocreate=false: queues must be created first (memory.Broker's
//     CreateQueue), as on SQS. Default true: a queue is made on first use.
//   - dedup_window=DURATION: how long a FIFO queue remembers the IDs of
//     published messages to drop duplicates, a duration such as 5m; 0
//     turns deduplication off. Default 5m, as on SQS.
//
// # Kafka
//
//	kafka://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...][?PARAMETERS]
//
// Apache Kafka (package kafka), through the seed brokers listed; each
// needs its port. A NewConsumer source is a topic. Query parameters:
//
//   - client_id=NAME: the client id the brokers see in their logs and
//     quotas. Default "ferry".
//   - group_protocol=classic|consumer: the consumer group protocol,
//     classic (the default) or consumer, the KIP-848 protocol of Kafka 4.
//   - tls=true|false: connect with TLS, trusting the system's roots (or
//     ca_file's). Default false.
//   - ca_file=FILE: a PEM file of the CA to trust instead of the system's;
//     implies tls=true.
//   - sasl=MECHANISM: authenticate with the URL's user and password, by
//     SCRAM-SHA-512, SCRAM-SHA-256 or PLAIN. A user without sasl is an
//     error; use TLS with it, or the password crosses the network in
//     clear (PLAIN) or the session is not private (SCRAM).
//
// # SQS
//
//	sqs://[KEY:SECRET@][HOST:PORT][?region=REGION&tls=false]
//	https://sqs.REGION.amazonaws.com/ACCOUNT/QUEUE
//
// Amazon SQS or a server that speaks its API (package sqs). A NewConsumer
// source, and a Publish destination, is a queue's name or URL.
//
// sqs:// without a host is Amazon SQS, in the region of the default AWS
// configuration (AWS_REGION, ~/.aws/config) or of the region parameter,
// with the default credential chain. With HOST:PORT, the host is the
// endpoint: an SQS-compatible server such as ElasticMQ or LocalStack at
// https://HOST:PORT, or http://HOST:PORT with tls=false. (There is no
// endpoint parameter: the host is it.) KEY:SECRET, when given, are static
// credentials (an access key id and its secret) instead of the default
// chain. Query parameters of sqs://:
//
//   - region=REGION: the AWS region to sign for, such as eu-west-1.
//     Default the AWS configuration's; one of the two is needed.
//   - tls=true|false: false speaks plain http to HOST:PORT. Default true.
//
// An SQS queue URL, https://sqs.REGION.amazonaws.com/ACCOUNT/QUEUE, opens
// Amazon SQS in that region with the default credential chain; it takes no
// query parameters.
//
// # RabbitMQ
//
//	amqp://USER:PASSWORD@HOST[:PORT]/VHOST
//	amqps://USER:PASSWORD@HOST[:PORT]/VHOST[?ca_file=FILE]
//
// RabbitMQ over AMQP 0-9-1 (package rabbit, through rabbit.Dial with
// rabbit.WithLazyConnect: it connects on first use, as Kafka and SQS do):
// amqps:// over TLS. The path is the vhost ("/" or
// none is the default vhost; %2F escapes a "/" in a vhost's name). A
// NewConsumer source is a queue, and a Publish destination the queue of
// that name, as on the other brokers; rabbit.ToExchange(exchange) names an
// exchange. Query parameters:
//
//   - ca_file=FILE: a PEM file of the CA to trust instead of the system's
//     (amqps only). The certificate must name HOST.
//
// # Passwords in URLs
//
// The user information of a URL runs from after "scheme://" to the last
// "@" before the host, so a password may hold any character once it is
// percent-encoded as url.UserPassword(user, password).String() encodes it.
// Open refuses, naming the part and never quoting it, a user or password
// holding a character that must be encoded (whitespace, a non-ASCII
// letter, "[", "]", a "%" that starts no escape), and a URL with a "/",
// "?" or "#" before its last "@": there url.Parse and that rule disagree
// on where the password ends (the password holds an unescaped "/", "?" or
// "#", or the path or query holds an unescaped "@"). An unescaped "@" or
// ":" inside the password is read as the rule says. rabbit.Dial and
// rabbit.Redact follow the same rule.
package ferry

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/urlsecret"
	"github.com/ferrymq/ferry/memory"
)

// Broker is what Open returns: consumer.Broker, the contract every
// adapter's *Broker keeps (a Publisher, and a source of delivery loops).
// What a broker does beyond it is found by type assertion: see
// consumer.Broker. The source of NewConsumer is a queue (memory, SQS,
// RabbitMQ) or a topic (Kafka).
type Broker = consumer.Broker

// ErrBadURL matches every *URLError through errors.Is.
var ErrBadURL = errors.New("ferry: bad broker URL")

// URLError says what is wrong with a broker URL. Its URL has any password
// replaced with "xxxxx", and neither its Reason nor its Err holds the
// password.
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

// opener opens the broker of one scheme, given its URL, the URL's query
// (holding only the scheme's parameters) and the URL as errors show it.
type opener func(ctx context.Context, u *url.URL, q url.Values, shown string) (Broker, error)

// scheme is a kind of URL Open takes.
type scheme struct {
	open opener
	// section is the heading of the package doc's section that describes
	// the scheme, form the URL form it gives there, and params the query
	// parameters the scheme takes, each listed in that section as
	// "name=..." (doc_test.go checks all three against the package doc).
	section string
	form    string
	params  []string
}

var (
	schemesMu sync.RWMutex
	schemes   = map[string]scheme{
		"mem": {open: openMem, section: "Memory", form: "mem://", params: []string{"autocreate", "dedup_window"}},
	}
)

// register adds a scheme: name is the URL's scheme, or a name of its own
// for a kind of URL that Open recognizes otherwise (sqs-queue-url).
func register(name string, s scheme) {
	schemesMu.Lock()
	defer schemesMu.Unlock()
	schemes[name] = s
}

// schemeForms lists the URL form of every scheme, for an error saying
// which URLs Open takes.
func schemeForms() string {
	schemesMu.RLock()
	defer schemesMu.RUnlock()
	forms := make([]string, 0, len(schemes))
	for _, n := range slices.Sorted(maps.Keys(schemes)) {
		forms = append(forms, schemes[n].form)
	}
	return strings.Join(forms, ", ")
}

// Open opens the broker a URL names: mem://, kafka://, sqs://, an SQS queue
// URL, amqp:// or amqps://. The package doc describes each form and every
// query parameter it takes.
//
// A URL that is wrong fails with a *URLError (errors.Is ErrBadURL) naming
// the part that is wrong. Open needs no broker to be up: every broker
// connects on first use, so that a consumer started while its broker is
// down says so (its Health, a WARN line) and consumes once the broker
// comes, and a Publish fails saying why it cannot get through. No error
// Open returns holds the URL's password, in any spelling of it.
func Open(ctx context.Context, rawURL string) (Broker, error) {
	b, err := open(ctx, rawURL)
	if err != nil {
		return nil, withoutPassword(err, rawURL)
	}
	return b, nil
}

func open(ctx context.Context, rawURL string) (Broker, error) {
	shown := urlsecret.Redact(rawURL)
	if rawURL == "" {
		return nil, &URLError{URL: shown, Part: "URL", Reason: "is empty"}
	}
	if !urlsecret.HasScheme(rawURL) {
		return nil, &URLError{URL: shown, Part: "scheme", Reason: "is missing: a broker URL starts with its scheme, as in " + schemeForms()}
	}
	if err := urlsecret.Check(rawURL); err != nil {
		return nil, &URLError{URL: shown, Part: "user and password", Reason: err.Error()}
	}
	u, err := url.Parse(rawURL)
	if err != nil {
		// Only the cause, not url.Parse's message: that quotes the URL
		// whole, password included. The user information is known to be
		// well formed here, so the cause is in the host, port or path.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return nil, &URLError{URL: shown, Part: "URL", Reason: "does not parse", Err: err}
	}
	name := strings.ToLower(u.Scheme)
	if (name == "https" || name == "http") && isSQSQueueURL(u) {
		name = "sqs-queue-url"
	}
	schemesMu.RLock()
	s, ok := schemes[name]
	schemesMu.RUnlock()
	if !ok {
		return nil, &URLError{URL: shown, Part: "scheme", Reason: fmt.Sprintf("%q is not one Ferry opens (%s)", u.Scheme, schemeForms())}
	}
	q, err := query(u, shown, s.params)
	if err != nil {
		return nil, err
	}
	return s.open(ctx, u, q, shown)
}

// isSQSQueueURL reports whether u looks like an SQS queue URL:
// https://sqs.REGION.amazonaws.com/ACCOUNT/QUEUE.
func isSQSQueueURL(u *url.URL) bool {
	host := strings.ToLower(u.Hostname())
	return strings.HasPrefix(host, "sqs.") && strings.HasSuffix(host, ".amazonaws.com") && strings.Count(strings.Trim(u.Path, "/"), "/") == 1
}

// query checks that u's query holds only the parameters allowed, and
// returns it.
func query(u *url.URL, shown string, allowed []string) (url.Values, error) {
	q, err := url.ParseQuery(u.RawQuery)
	if err != nil {
		return nil, &URLError{URL: shown, Part: "query", Reason: "does not parse", Err: err}
	}
	for _, k := range slices.Sorted(maps.Keys(q)) {
		if !slices.Contains(allowed, k) {
			takes := "none"
			if len(allowed) > 0 {
				takes = strings.Join(allowed, ", ")
			}
			return nil, &URLError{URL: shown, Part: "query parameter " + k, Reason: fmt.Sprintf("is not one this broker takes (it takes %s)", takes)}
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

func openMem(_ context.Context, u *url.URL, q url.Values, shown string) (Broker, error) {
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
		return b, nil
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
	return &memShared{Broker: s.b, name: name, s: s}, nil
}

// memShared is one Open of a named memory broker.
type memShared struct {
	*memory.Broker
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
	case *memory.Broker:
		return m, true
	case *memShared:
		return m.Broker, true
	}
	return nil, false
}
