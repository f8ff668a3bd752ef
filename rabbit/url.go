package rabbit

import (
	"context"
	"errors"
	"net/url"
	"strings"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/brokerurl"
)

// This file opens amqp:// and amqps:// URLs for ferry.Open. It registers
// the schemes from init, so that ferry.Open opens RabbitMQ in a program
// that imports this package, and a program that does not links neither
// amqp091-go nor this package (the package doc's section Opening from a
// URL describes the forms, and the root package's doc_test.go holds the
// section to Params).
func init() {
	for _, name := range []string{"amqp", "amqps"} {
		brokerurl.Register(name, brokerurl.Scheme{Open: openURL, Package: "github.com/ferrymq/ferry/rabbit",
			Section: "Opening from a URL", Form: name + "://", Params: []string{"ca_file"}})
	}
}

// openURL opens amqp:// and amqps:// URLs with Dial. Like Kafka's and
// SQS's, the Broker needs no broker to be built ([WithLazyConnect]): a
// consumer started while RabbitMQ is down says so and consumes when it
// comes up, and a Publish connects, or fails saying why.
func openURL(_ context.Context, u *url.URL, q url.Values, shown string) (consumer.Broker, error) {
	opts := []Option{WithLazyConnect()}
	if q.Get("ca_file") != "" {
		if strings.ToLower(u.Scheme) != "amqps" {
			return nil, &brokerurl.URLError{URL: shown, Part: "query parameter ca_file", Reason: "needs amqps://"}
		}
		cfg, err := brokerurl.TLS(q, shown)
		if err != nil {
			return nil, err
		}
		if !strings.Contains(u.Host, ",") {
			cfg.ServerName = u.Hostname()
		} // with several nodes, each connection names its own node
		opts = append(opts, WithTLS(cfg))
	}
	plain := *u
	plain.RawQuery = ""
	b, err := Dial(plain.String(), opts...)
	if err != nil {
		var ce *consumer.ConfigError
		if errors.As(err, &ce) {
			return nil, &brokerurl.URLError{URL: shown, Part: "URL", Reason: "is not one RabbitMQ takes", Err: err}
		}
		return nil, err
	}
	return b, nil
}
