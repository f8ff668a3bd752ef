package kafka

import (
	"context"
	"errors"
	"net/url"
	"strings"

	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/brokerurl"
)

// This file opens kafka:// URLs for ferry.Open. It registers the scheme
// from init, so that ferry.Open opens Kafka in a program that imports this
// package, and a program that does not links neither franz-go nor this
// package (the package doc's section Opening from a URL describes the
// form, and the root package's doc_test.go holds the section to Params).
func init() {
	brokerurl.Register("kafka", brokerurl.Scheme{Open: openURL, Package: "github.com/ferrymq/ferry/kafka",
		Section: "Opening from a URL", Form: "kafka://",
		Params: []string{"client_id", "group_protocol", "instance_id", "tls", "ca_file", "sasl"}})
}

// openURL opens kafka://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...].
func openURL(_ context.Context, u *url.URL, q url.Values, shown string) (consumer.Broker, error) {
	if u.Host == "" {
		return nil, &brokerurl.URLError{URL: shown, Part: "host", Reason: "is empty: name the seed brokers, kafka://HOST:PORT[,HOST:PORT]"}
	}
	seeds := strings.Split(u.Host, ",")
	for _, s := range seeds {
		if !strings.Contains(s, ":") {
			return nil, &brokerurl.URLError{URL: shown, Part: "host", Reason: "seed " + s + " has no port"}
		}
	}
	var opts []Option
	if v := q.Get("client_id"); v != "" {
		opts = append(opts, WithClientID(v))
	}
	switch v := q.Get("group_protocol"); v {
	case "", "classic":
	case "consumer":
		opts = append(opts, WithGroupProtocol(NextGen))
	case "share":
		opts = append(opts, WithGroupProtocol(Share))
	default:
		return nil, &brokerurl.URLError{URL: shown, Part: "query parameter group_protocol", Reason: "is " + v + ", not classic, consumer or share"}
	}
	if q.Has("instance_id") {
		o := WithInstanceID(q.Get("instance_id"))
		var ce *consumer.ConfigError
		if err := o(&config{}); errors.As(err, &ce) {
			return nil, &brokerurl.URLError{URL: shown, Part: "query parameter instance_id", Reason: ce.Reason}
		}
		opts = append(opts, o)
	}
	tlsCfg, err := brokerurl.TLS(q, shown)
	if err != nil {
		return nil, err
	}
	if tlsCfg != nil {
		opts = append(opts, WithTLS(tlsCfg))
	}
	if mech := q.Get("sasl"); mech != "" {
		user := u.User.Username()
		pass, _ := u.User.Password()
		if user == "" {
			return nil, &brokerurl.URLError{URL: shown, Part: "user", Reason: "is missing: sasl needs kafka://USER:PASSWORD@HOST"}
		}
		switch strings.ToUpper(mech) {
		case "SCRAM-SHA-512":
			opts = append(opts, WithSASL(scram.Auth{User: user, Pass: pass}.AsSha512Mechanism()))
		case "SCRAM-SHA-256":
			opts = append(opts, WithSASL(scram.Auth{User: user, Pass: pass}.AsSha256Mechanism()))
		case "PLAIN":
			opts = append(opts, WithSASL(plain.Auth{User: user, Pass: pass}.AsMechanism()))
		default:
			return nil, &brokerurl.URLError{URL: shown, Part: "query parameter sasl", Reason: "is " + mech + ", not SCRAM-SHA-512, SCRAM-SHA-256 or PLAIN"}
		}
	} else if u.User != nil {
		return nil, &brokerurl.URLError{URL: shown, Part: "user", Reason: "is given without sasl=MECHANISM"}
	}
	b, err := New(seeds, opts...)
	if err != nil {
		return nil, &brokerurl.URLError{URL: shown, Part: "URL", Reason: "names a Kafka Ferry cannot use", Err: err}
	}
	return b, nil
}
