// Package brokerurl is the table of the URL schemes ferry.Open takes, which
// each adapter adds its own schemes to from its init, as database/sql
// drivers register themselves: a program links the SDK of a broker only
// when it imports that broker's package. It holds URLError (which the
// root package exports as ferry.URLError) and the helpers that more than
// one adapter's parser needs, so that neither the adapters nor the root
// package import each other.
package brokerurl

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"maps"
	"net/url"
	"os"
	"slices"
	"strconv"
	"sync"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/urlsecret"
)

// ErrBadURL matches every *URLError through errors.Is; the root package
// exports it as ferry.ErrBadURL.
var ErrBadURL = errors.New("ferry: bad broker URL")

// URLError says what is wrong with a broker URL. Its URL has any password
// replaced with "xxxxx", and neither its Reason nor its Err holds the
// password (ferry.Open scrubs Err of every spelling of it).
type URLError struct {
	URL    string
	Part   string // the part that is wrong: "scheme", "host", "query parameter region", ...
	Reason string
	Err    error // the underlying error, if any
}

func (e *URLError) Error() string {
	s := "ferry: broker URL " + strconv.Quote(e.URL) + ": " + e.Part + " " + e.Reason
	if e.Err != nil {
		s += ": " + urlsecret.RedactText(e.Err.Error())
	}
	return s
}

// Is reports whether target is ErrBadURL.
func (e *URLError) Is(target error) bool { return target == ErrBadURL }

// Unwrap returns the underlying error.
func (e *URLError) Unwrap() error { return e.Err }

// Opener opens the broker of one scheme, given its URL, the URL's query
// (holding only the scheme's Params: ferry.Open checks it first) and the
// URL as errors show it (password redacted).
type Opener func(ctx context.Context, u *url.URL, q url.Values, shown string) (consumer.Broker, error)

// Scheme is a kind of URL ferry.Open takes.
type Scheme struct {
	Open Opener
	// Package is the import path of the package that registers the
	// scheme, whose package doc has the section Section describing it:
	// its URL form Form and every query parameter in Params, each listed
	// as "name=...". The root package's doc_test.go checks all of them
	// against that package's doc.
	Package string
	Section string
	Form    string
	Params  []string
}

var (
	mu      sync.RWMutex
	schemes = map[string]Scheme{}
)

// Register adds a scheme: name is the URL's scheme, or a name of its own
// for a kind of URL that ferry.Open recognizes otherwise (sqs-queue-url).
// It panics when name is taken, as a second registration is a bug (two
// packages claiming one scheme).
func Register(name string, s Scheme) {
	mu.Lock()
	defer mu.Unlock()
	if _, dup := schemes[name]; dup {
		panic("brokerurl: scheme " + name + " registered twice")
	}
	schemes[name] = s
}

// Lookup returns the scheme registered as name.
func Lookup(name string) (Scheme, bool) {
	mu.RLock()
	defer mu.RUnlock()
	s, ok := schemes[name]
	return s, ok
}

// All returns a copy of the table: every scheme registered, by name.
func All() map[string]Scheme {
	mu.RLock()
	defer mu.RUnlock()
	return maps.Clone(schemes)
}

// Forms lists the URL form of every scheme registered, sorted by name.
func Forms() []string {
	all := All()
	forms := make([]string, 0, len(all))
	for _, n := range slices.Sorted(maps.Keys(all)) {
		forms = append(forms, all[n].Form)
	}
	return forms
}

// TLS builds the TLS configuration of the query parameters tls=true and
// ca_file=FILE, or returns nil when neither asks for TLS. A ca_file implies
// tls=true.
func TLS(q url.Values, shown string) (*tls.Config, error) {
	on := false
	if v := q.Get("tls"); v != "" {
		switch v {
		case "true":
			on = true
		case "false":
		default:
			return nil, &URLError{URL: shown, Part: "query parameter tls", Reason: "is " + v + ", not true or false"}
		}
	}
	file := q.Get("ca_file")
	if !on && file == "" {
		return nil, nil
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if file != "" {
		pem, err := os.ReadFile(file)
		if err != nil {
			return nil, &URLError{URL: shown, Part: "query parameter ca_file", Reason: "cannot be read", Err: err}
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, &URLError{URL: shown, Part: "query parameter ca_file", Reason: "holds no PEM certificate"}
		}
		cfg.RootCAs = pool
	}
	return cfg, nil
}
