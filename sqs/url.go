package sqs

import (
	"context"
	"net/http"
	"net/url"
	"strings"

	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	awsconfig "github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/credentials"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/brokerurl"
)

// This file opens sqs:// URLs and SQS queue URLs for ferry.Open. It
// registers them from init, so that ferry.Open opens SQS in a program that
// imports this package, and a program that does not links neither the AWS
// SDK nor this package (the package doc's section Opening from a URL
// describes the forms, and the root package's doc_test.go holds the
// section to Params).
func init() {
	brokerurl.Register("sqs", brokerurl.Scheme{Open: openURL, Package: "github.com/ferrymq/ferry/sqs",
		Section: "Opening from a URL", Form: "sqs://", Params: []string{"region", "tls"}})
	// ferry.Open tells a queue URL from other https URLs by its host
	// (ferry's isSQSQueueURL) and looks it up under this name.
	brokerurl.Register("sqs-queue-url", brokerurl.Scheme{Open: openQueueURL, Package: "github.com/ferrymq/ferry/sqs",
		Section: "Opening from a URL", Form: "https://sqs.REGION.amazonaws.com/ACCOUNT/QUEUE"})
}

// openURL opens sqs://[KEY:SECRET@][HOST:PORT]: the host, when there is
// one, is the endpoint.
func openURL(ctx context.Context, u *url.URL, q url.Values, shown string) (consumer.Broker, error) {
	if u.Path != "" && u.Path != "/" {
		return nil, &brokerurl.URLError{URL: shown, Part: "path", Reason: "must be empty: queues are named to NewConsumer and Publish"}
	}
	endpoint := ""
	if u.Host != "" {
		scheme := "https"
		switch q.Get("tls") {
		case "", "true":
		case "false":
			scheme = "http"
		default:
			return nil, &brokerurl.URLError{URL: shown, Part: "query parameter tls", Reason: "is " + q.Get("tls") + ", not true or false"}
		}
		endpoint = scheme + "://" + u.Host
	}
	return openClient(ctx, shown, q.Get("region"), endpoint, u.User)
}

// openQueueURL opens the SQS of a queue URL,
// https://sqs.REGION.amazonaws.com/ACCOUNT/QUEUE: its region is the
// URL's, and NewConsumer and Publish take the queue's name or URL.
func openQueueURL(ctx context.Context, u *url.URL, _ url.Values, shown string) (consumer.Broker, error) {
	region := strings.TrimSuffix(strings.TrimPrefix(strings.ToLower(u.Hostname()), "sqs."), ".amazonaws.com")
	return openClient(ctx, shown, region, "", nil)
}

// openClient builds the SQS client a URL describes and the Broker over it.
func openClient(ctx context.Context, shown, region, endpoint string, user *url.Userinfo) (consumer.Broker, error) {
	var loads []func(*awsconfig.LoadOptions) error
	if region != "" {
		loads = append(loads, awsconfig.WithRegion(region))
	}
	if user != nil {
		secret, _ := user.Password()
		loads = append(loads, awsconfig.WithCredentialsProvider(credentials.NewStaticCredentialsProvider(user.Username(), secret, "")))
	}
	cfg, err := awsconfig.LoadDefaultConfig(ctx, loads...)
	if err != nil {
		return nil, &brokerurl.URLError{URL: shown, Part: "AWS configuration", Reason: "does not load", Err: err}
	}
	if cfg.Region == "" {
		return nil, &brokerurl.URLError{URL: shown, Part: "query parameter region", Reason: "is missing, and the AWS configuration names none"}
	}
	client := awssqs.NewFromConfig(cfg, func(o *awssqs.Options) {
		if endpoint != "" {
			o.BaseEndpoint = aws.String(endpoint)
		}
		// Enough idle connections for a consumer's receives and batch
		// calls (the package doc's section Using it).
		o.HTTPClient = awshttp.NewBuildableClient().WithTransportOptions(func(tr *http.Transport) {
			tr.MaxIdleConnsPerHost = 100
		})
	})
	b, err := New(client)
	if err != nil {
		return nil, &brokerurl.URLError{URL: shown, Part: "URL", Reason: "names an SQS Ferry cannot use", Err: err}
	}
	return b, nil
}
