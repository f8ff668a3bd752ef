// Package ferry opens any broker Ferry runs on from a URL, as Go CDK opens
// its topics and subscriptions: one line of configuration picks the broker,
// and the code that publishes and consumes stays the same.
//
//	import (
//		"github.com/ferrymq/ferry"
//		_ "github.com/ferrymq/ferry/brokers" // every broker; or only the one you run on, such as _ "github.com/ferrymq/ferry/kafka"
//	)
//
//	b, err := ferry.Open(ctx, os.Getenv("BROKER_URL")) // mem://, kafka://, sqs://, amqp://, amqps://
//	if err != nil {
//		return err
//	}
//	defer b.Close()
//	err = b.Publish(ctx, "orders", consumer.Message{Key: "o-1", Body: body})
//	c, err := b.NewConsumer(ctx, "orders", consumer.WithName("billing"))
//
// The URL forms, and the package that opens each (the section Opening from
// a URL of its doc gives every query parameter it takes):
//
//	mem://                          a new in-process broker (package memory)
//	mem://NAME                      the in-process broker NAME, shared within the process
//	kafka://HOST:PORT[,HOST:PORT]   Apache Kafka (package kafka)
//	sqs://                          Amazon SQS (package sqs)
//	sqs://HOST:PORT                 an SQS-compatible server: the host is the endpoint
//	https://sqs.REGION.amazonaws.com/ACCOUNT/QUEUE   an SQS queue URL (package sqs)
//	amqp://USER:PASSWORD@HOST:PORT[,HOST:PORT]/VHOST, amqps://...  RabbitMQ (package rabbit)
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
// # Linking the brokers
//
// This package opens mem:// itself. Every other scheme is registered by
// its broker's package when the program imports it, as database/sql
// drivers are, so that a program links only the SDKs it uses: a service
// that imports package kafka (or blank-imports it for Open) links
// franz-go, and neither the AWS SDK nor amqp091-go. Package
// [github.com/ferrymq/ferry/brokers] imports all of them, for a program
// that takes any broker's URL. Open of a URL whose package the program
// does not import fails with a *URLError saying which to import:
//
//	kafka://                   import _ "github.com/ferrymq/ferry/kafka"
//	sqs://, an SQS queue URL   import _ "github.com/ferrymq/ferry/sqs"
//	amqp://, amqps://          import _ "github.com/ferrymq/ferry/rabbit"
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
	"github.com/ferrymq/ferry/internal/brokerurl"
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
var ErrBadURL = brokerurl.ErrBadURL

// URLError says what is wrong with a broker URL: its fields are URL (with
// any password replaced with "xxxxx"), Part (the part that is wrong:
// "scheme", "host", "query parameter region", ...), Reason, and Err (the
// underlying error, if any). Neither its Reason nor its Err holds the
// password. It is errors.Is ErrBadURL.
//
// The adapters' parsers return it too, from a package of Ferry's own that
// both they and this one import: this name is the one to use.
type URLError = brokerurl.URLError

// adapters names, for each scheme an adapter registers, the package that
// registers it and the scheme's URL form, so that Open can say which
// import a URL needs in a program that does not link that package.
var adapters = map[string]struct{ pkg, form string }{
	"kafka":         {"github.com/ferrymq/ferry/kafka", "kafka://"},
	"sqs":           {"github.com/ferrymq/ferry/sqs", "sqs://"},
	"sqs-queue-url": {"github.com/ferrymq/ferry/sqs", "an SQS queue URL"},
	"amqp":          {"github.com/ferrymq/ferry/rabbit", "amqp://"},
	"amqps":         {"github.com/ferrymq/ferry/rabbit", "amqps://"},
}

// The package doc's section Memory describes mem:// and its parameters
// (doc_test.go holds it to them); each adapter registers its own schemes
// from its init.
func init() {
	brokerurl.Register("mem", brokerurl.Scheme{Open: openMem, Package: "github.com/ferrymq/ferry",
		Section: "Memory", Form: "mem://", Params: []string{"autocreate", "dedup_window"}})
}

// schemeForms lists the URL form of every scheme this program links, for
// an error saying which URLs Open takes.
func schemeForms() string { return strings.Join(brokerurl.Forms(), ", ") }

// Open opens the broker a URL names: mem://, kafka://, sqs://, an SQS queue
// URL, amqp:// or amqps://. Each is opened by the package of its broker,
// which the program must import (package brokers imports them all): the
// package doc says which, and where each form's query parameters are
// described.
//
// A URL that is wrong fails with a *URLError (errors.Is ErrBadURL) naming
// the part that is wrong; so does one whose broker's package the program
// does not import, saying which to import. Open needs no broker to be up:
// every broker connects on first use, so that a consumer started while
// its broker is down says so (its Health, a WARN line) and consumes once
// the broker comes, and a Publish fails saying why it cannot get through.
// No error Open returns holds the URL's password, in any spelling of it.
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
	s, ok := brokerurl.Lookup(name)
	if !ok {
		if a, known := adapters[name]; known {
			return nil, &URLError{URL: shown, Part: "scheme", Reason: fmt.Sprintf("%s needs import _ %q (or %q for every broker) in the program", a.form, a.pkg, "github.com/ferrymq/ferry/brokers")}
		}
		return nil, &URLError{URL: shown, Part: "scheme", Reason: fmt.Sprintf("%q is not one Ferry opens (%s)", u.Scheme, schemeForms())}
	}
	q, err := query(u, shown, s.Params)
	if err != nil {
		return nil, err
	}
	return s.Open(ctx, u, q, shown)
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
