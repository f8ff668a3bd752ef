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

// TestMissingQueueIsFatal: a consumer of a queue that does not exist fails
// at construction with an error marked fatal, naming the queue, that
// errors.As matches with SQS's typed error.
func TestMissingQueueIsFatal(t *testing.T) {
	c := newClient(t, nil)
	b := newBroker(t, c)
	const name = "ferry-no-such-queue-7d1f"
	_, err := b.NewConsumer(context.Background(), name)
	var noQueue *types.QueueDoesNotExist
	if !driver.IsFatal(err) || !errors.As(err, &noQueue) || !strings.Contains(err.Error(), name) {
		t.Fatalf("NewConsumer of a missing queue = %v, want a fatal error naming it that matches *types.QueueDoesNotExist", err)
	}
	err = b.Publish(context.Background(), name, consumer.Message{Body: []byte("x")})
	if !errors.As(err, &noQueue) {
		t.Errorf("Publish to a missing queue = %v, want an error matching *types.QueueDoesNotExist", err)
	}
}

// TestQueueDeletedWhileRunningEndsRun: when the queue is deleted under a
// running consumer, Run ends with a fatal error that names the queue.
func TestQueueDeletedWhileRunningEndsRun(t *testing.T) {
	c := newClient(t, nil)
	b := newBroker(t, c, ferrysqs.WithWaitTime(time.Second)) // ElasticMQ answers a long poll on a deleted queue only when it ends
	name, url := createQueue(t, c, "deleted", queueConfig{})
	l, err := b.NewConsumer(context.Background(), name, consumer.WithFetchBackoff(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		done <- l.Run(context.Background(), consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }))
	}()
	time.Sleep(300 * time.Millisecond)
	if _, err := c.DeleteQueue(context.Background(), &awssqs.DeleteQueueInput{QueueUrl: aws.String(url)}); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if !driver.IsFatal(err) || !strings.Contains(err.Error(), name) {
			t.Fatalf("Run = %v, want a fatal error naming %s", err, name)
		}
		var noQueue *types.QueueDoesNotExist
		if !errors.As(err, &noQueue) {
			t.Logf("Run's error %v is not typed QueueDoesNotExist (matched by its code)", err)
		}
	case <-time.After(40 * time.Second):
		t.Fatal("Run did not end after its queue was deleted")
	}
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
// consumer's credentials, or denying it ReceiveMessage, ends Run with a
// fatal error naming the queue and the cause, matched by its API error
// code. The refusal comes from a proxy in front of ElasticMQ, which checks
// no credentials and no permissions itself; the queue is real.
func TestRefusedCredentialsAndDeniedActionsAreFatal(t *testing.T) {
	for _, tc := range []struct {
		name, code, msg string
		status          int
	}{
		{"BadCredentials", "UnrecognizedClientException", "The security token included in the request is invalid.", 400},
		{"AccessDenied", "AccessDeniedException", "User is not authorized to perform: sqs:receivemessage", 403},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newClient(t, nil)
			name, _ := createQueue(t, c, "refused", queueConfig{})
			proxy := refusingProxy(t, map[string]bool{"ReceiveMessage": true}, tc.status, tc.code, tc.msg)
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
			if !driver.IsFatal(err) || !errors.As(err, &api) || api.ErrorCode() != tc.code || !strings.Contains(err.Error(), name) {
				t.Fatalf("Run = %v, want a fatal error naming %s with code %s", err, name, tc.code)
			}
			if ctx.Err() != nil {
				t.Error("Run ended only when its context did")
			}
		})
	}
}
