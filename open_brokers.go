package ferry

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net/http"
	"net/url"
	"os"
	"strings"

	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/credentials"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/kafka"
	"github.com/ferrymq/ferry/rabbit"
	"github.com/ferrymq/ferry/sqs"
)

// This file opens the real brokers: Kafka, SQS and RabbitMQ.

// The package doc's sections describe these schemes and their parameters
// (doc_test.go holds them to it).
func init() {
	register("kafka", scheme{open: openKafka, section: "Kafka", form: "kafka://",
		params: []string{"client_id", "group_protocol", "tls", "ca_file", "sasl"}})
	register("sqs", scheme{open: openSQS, section: "SQS", form: "sqs://", params: []string{"region", "tls"}})
	register("sqs-queue-url", scheme{open: openSQSQueueURL, section: "SQS", form: "https://sqs.REGION.amazonaws.com/ACCOUNT/QUEUE"})
	register("amqp", scheme{open: openRabbit, section: "RabbitMQ", form: "amqp://", params: []string{"ca_file"}})
	register("amqps", scheme{open: openRabbit, section: "RabbitMQ", form: "amqps://", params: []string{"ca_file"}})
}

// openKafka opens kafka://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...] (the
// package doc's section Kafka).
func openKafka(_ context.Context, u *url.URL, q url.Values, shown string) (Broker, error) {
	if u.Host == "" {
		return nil, &URLError{URL: shown, Part: "host", Reason: "is empty: name the seed brokers, kafka://HOST:PORT[,HOST:PORT]"}
	}
	seeds := strings.Split(u.Host, ",")
	for _, s := range seeds {
		if !strings.Contains(s, ":") {
			return nil, &URLError{URL: shown, Part: "host", Reason: "seed " + s + " has no port"}
		}
	}
	var opts []kafka.Option
	if v := q.Get("client_id"); v != "" {
		opts = append(opts, kafka.WithClientID(v))
	}
	switch v := q.Get("group_protocol"); v {
	case "", "classic":
	case "consumer":
		opts = append(opts, kafka.WithGroupProtocol(kafka.NextGen))
	default:
		return nil, &URLError{URL: shown, Part: "query parameter group_protocol", Reason: "is " + v + ", not classic or consumer"}
	}
	tlsCfg, err := tlsFrom(q, shown)
	if err != nil {
		return nil, err
	}
	if tlsCfg != nil {
		opts = append(opts, kafka.WithTLS(tlsCfg))
	}
	if mech := q.Get("sasl"); mech != "" {
		user := u.User.Username()
		pass, _ := u.User.Password()
		if user == "" {
			return nil, &URLError{URL: shown, Part: "user", Reason: "is missing: sasl needs kafka://USER:PASSWORD@HOST"}
		}
		switch strings.ToUpper(mech) {
		case "SCRAM-SHA-512":
			opts = append(opts, kafka.WithSASL(scram.Auth{User: user, Pass: pass}.AsSha512Mechanism()))
		case "SCRAM-SHA-256":
			opts = append(opts, kafka.WithSASL(scram.Auth{User: user, Pass: pass}.AsSha256Mechanism()))
		case "PLAIN":
			opts = append(opts, kafka.WithSASL(plain.Auth{User: user, Pass: pass}.AsMechanism()))
		default:
			return nil, &URLError{URL: shown, Part: "query parameter sasl", Reason: "is " + mech + ", not SCRAM-SHA-512, SCRAM-SHA-256 or PLAIN"}
		}
	} else if u.User != nil {
		return nil, &URLError{URL: shown, Part: "user", Reason: "is given without sasl=MECHANISM"}
	}
	b, err := kafka.New(seeds, opts...)
	if err != nil {
		return nil, &URLError{URL: shown, Part: "URL", Reason: "names a Kafka Ferry cannot use", Err: err}
	}
	return b, nil
}

// tlsFrom builds the TLS configuration of tls=true and ca_file=FILE.
func tlsFrom(q url.Values, shown string) (*tls.Config, error) {
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

// openSQS opens sqs://[KEY:SECRET@][HOST:PORT] (the package doc's section
// SQS): the host, when there is one, is the endpoint.
func openSQS(ctx context.Context, u *url.URL, q url.Values, shown string) (Broker, error) {
	if u.Path != "" && u.Path != "/" {
		return nil, &URLError{URL: shown, Part: "path", Reason: "must be empty: queues are named to NewConsumer and Publish"}
	}
	endpoint := ""
	if u.Host != "" {
		scheme := "https"
		switch q.Get("tls") {
		case "", "true":
		case "false":
			scheme = "http"
		default:
			return nil, &URLError{URL: shown, Part: "query parameter tls", Reason: "is " + q.Get("tls") + ", not true or false"}
		}
		endpoint = scheme + "://" + u.Host
	}
	return newSQS(ctx, shown, q.Get("region"), endpoint, u.User)
}

// openSQSQueueURL opens the SQS of a queue URL,
// https://sqs.REGION.amazonaws.com/ACCOUNT/QUEUE: its region is the
// URL's, and NewConsumer and Publish take the queue's name or URL.
func openSQSQueueURL(ctx context.Context, u *url.URL, _ url.Values, shown string) (Broker, error) {
	region := strings.TrimSuffix(strings.TrimPrefix(strings.ToLower(u.Hostname()), "sqs."), ".amazonaws.com")
	return newSQS(ctx, shown, region, "", nil)
}

func newSQS(ctx context.Context, shown, region, endpoint string, user *url.Userinfo) (Broker, error) {
	var loads []func(*config.LoadOptions) error
	if region != "" {
		loads = append(loads, config.WithRegion(region))
	}
	if user != nil {
		secret, _ := user.Password()
		loads = append(loads, config.WithCredentialsProvider(credentials.NewStaticCredentialsProvider(user.Username(), secret, "")))
	}
	cfg, err := config.LoadDefaultConfig(ctx, loads...)
	if err != nil {
		return nil, &URLError{URL: shown, Part: "AWS configuration", Reason: "does not load", Err: err}
	}
	if cfg.Region == "" {
		return nil, &URLError{URL: shown, Part: "query parameter region", Reason: "is missing, and the AWS configuration names none"}
	}
	client := awssqs.NewFromConfig(cfg, func(o *awssqs.Options) {
		if endpoint != "" {
			o.BaseEndpoint = aws.String(endpoint)
		}
		// Enough idle connections for a consumer's receives and batch
		// calls (see package sqs).
		o.HTTPClient = awshttp.NewBuildableClient().WithTransportOptions(func(tr *http.Transport) {
			tr.MaxIdleConnsPerHost = 100
		})
	})
	b, err := sqs.New(client)
	if err != nil {
		return nil, &URLError{URL: shown, Part: "URL", Reason: "names an SQS Ferry cannot use", Err: err}
	}
	return b, nil
}

// openRabbit opens amqp:// and amqps:// URLs with rabbit.Dial (the package
// doc's section RabbitMQ). Like Kafka's and SQS's, the Broker needs no
// broker to be built (rabbit.WithLazyConnect): a consumer started while
// RabbitMQ is down says so and consumes when it comes up, and a Publish
// connects, or fails saying why.
func openRabbit(_ context.Context, u *url.URL, q url.Values, shown string) (Broker, error) {
	opts := []rabbit.Option{rabbit.WithLazyConnect()}
	if q.Get("ca_file") != "" {
		if strings.ToLower(u.Scheme) != "amqps" {
			return nil, &URLError{URL: shown, Part: "query parameter ca_file", Reason: "needs amqps://"}
		}
		cfg, err := tlsFrom(q, shown)
		if err != nil {
			return nil, err
		}
		cfg.ServerName = u.Hostname()
		opts = append(opts, rabbit.WithTLS(cfg))
	}
	plain := *u
	plain.RawQuery = ""
	b, err := rabbit.Dial(plain.String(), opts...)
	if err != nil {
		var ce *consumer.ConfigError
		if errors.As(err, &ce) {
			return nil, &URLError{URL: shown, Part: "URL", Reason: "is not one RabbitMQ takes", Err: err}
		}
		return nil, err
	}
	return b, nil
}
