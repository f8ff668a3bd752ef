package sqs_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/aws/smithy-go"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
	ferrysqs "github.com/ferrymq/ferry/sqs"
)

// TestPublishToAMissingQueueFails: Publish to a queue that does not exist
// fails with an error naming the queue that errors.As matches with SQS's
// typed error.
func TestPublishToAMissingQueueFails(t *testing.T) {
	c := newClient(t, nil)
	b := newBroker(t, c)
	const name = "ferry-no-such-queue-7d1f"
	err := b.Publish(context.Background(), name, consumer.Message{Body: []byte("x")})
	var noQueue *types.QueueDoesNotExist
	if !errors.As(err, &noQueue) || !strings.Contains(err.Error(), name) {
		t.Errorf("Publish to a missing queue = %v, want an error naming it that matches *types.QueueDoesNotExist", err)
	}
}

// TestQueueDeletedWhileRunningIsReportedUntilRecreated: when the queue is
// deleted under a running consumer, the consumer says that its source
// does not exist (health disconnected with an error wrapping
// consumer.ErrSourceNotFound, a WARN naming the queue) and retries; Run
// does not end. Once a queue of that name is created again, it consumes
// from it by itself.
func TestQueueDeletedWhileRunningIsReportedUntilRecreated(t *testing.T) {
	c := newClient(t, nil)
	// ElasticMQ answers a long poll on a deleted queue only when its wait
	// ends: a short one keeps the test short.
	b := newBroker(t, c, ferrysqs.WithWaitTime(time.Second))
	name, url := createQueue(t, c, "deleted", queueConfig{})
	w := watch(t, b, name)
	w.consumes(t, c, url, 20*time.Second, false)
	if _, err := c.DeleteQueue(context.Background(), &awssqs.DeleteQueueInput{QueueUrl: aws.String(url)}); err != nil {
		t.Fatal(err)
	}
	w.disconnected(t, 10*time.Second, name, consumer.ErrSourceNotFound.Error())
	w.warned(t, 10*time.Second, name, consumer.ErrSourceNotFound.Error())
	_, url = createNamedQueue(t, c, name, queueConfig{})
	w.consumes(t, c, url, 20*time.Second, true)
}

// refusingProxy passes requests to the test server, except the actions in
// refuse, which it answers as SQS answers a refused request: the AWS JSON
// protocol's error body with the given status and error type.
func refusingProxy(t *testing.T, refuse map[string]bool, status int, errType, msg string) string {
	t.Helper()
	target, err := url.Parse(testenv.RequireSQS(t))
	if err != nil {
		t.Fatal(err)
	}
	rp := httputil.NewSingleHostReverseProxy(target)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		action := strings.TrimPrefix(r.Header.Get("X-Amz-Target"), "AmazonSQS.")
		if refuse[action] {
			w.Header().Set("Content-Type", "application/x-amz-json-1.0")
			w.Header().Set("x-amzn-query-error", errType+";Sender")
			w.WriteHeader(status)
			_, _ = w.Write([]byte(`{"__type":"com.amazon.coral.service#` + errType + `","message":"` + msg + `"}`))
			return
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// TestRefusedCredentialsAndDeniedActionsAreFatal: SQS refusing the
// consumer's credentials or signature, or denying it an action it needs,
// ends Run with a fatal error wrapping consumer.ErrRefused, naming the
// queue and the cause, matched by its API error code; the health then
// says stopped, with that error. The refusal comes from a proxy in front
// of ElasticMQ, which checks no credentials and no permissions itself; the
// queue is real. (TestRefusalCodesAreFatal checks every code.)
func TestRefusedCredentialsAndDeniedActionsAreFatal(t *testing.T) {
	for _, tc := range []struct {
		name, action, code, msg string
		status                  int
	}{
		{"BadCredentials", "ReceiveMessage", "UnrecognizedClientException", "The security token included in the request is invalid.", 400},
		{"BadKeyID", "GetQueueUrl", "InvalidClientTokenId", "The security token included in the request is invalid.", 403},
		{"BadSignature", "GetQueueAttributes", "SignatureDoesNotMatch", "The request signature we calculated does not match the signature you provided.", 403},
		{"AccessDenied", "ReceiveMessage", "AccessDeniedException", "User is not authorized to perform: sqs:receivemessage", 403},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newClient(t, nil)
			name, _ := createQueue(t, c, "refused", queueConfig{})
			proxy := refusingProxy(t, map[string]bool{tc.action: true}, tc.status, tc.code, tc.msg)
			pc := newClient(t, nil, func(o *awssqs.Options) { o.BaseEndpoint = aws.String(proxy) })
			b := newBroker(t, pc)
			l, err := b.NewConsumer(context.Background(), name)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			err = l.Run(ctx, consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }))
			var api smithy.APIError
			if !driver.IsFatal(err) || !errors.Is(err, consumer.ErrRefused) || !errors.As(err, &api) || api.ErrorCode() != tc.code || !strings.Contains(err.Error(), name) {
				t.Fatalf("Run = %v, want a fatal error wrapping consumer.ErrRefused naming %s with code %s", err, name, tc.code)
			}
			if ctx.Err() != nil {
				t.Error("Run ended only when its context did")
			}
			if h := l.Health(); h.State != consumer.HealthStopped || h.Error != err.Error() || h.Live {
				t.Errorf("health after the refusal: %+v, want stopped with Run's error, not live", h)
			}
		})
	}
}
