package sqs_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
)

// failOneEntryProxy passes requests to the test server, except the first
// DeleteMessageBatch: of that one it keeps the first entry back from the
// server and answers, with HTTP 200, that this entry failed through SQS's
// own fault (InternalError, SenderFault false), as SQS answers when one
// entry of a batch could not be done.
func failOneEntryProxy(t *testing.T) string {
	t.Helper()
	target, err := url.Parse(testenv.RequireSQS(t))
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		action := strings.TrimPrefix(r.Header.Get("X-Amz-Target"), "AmazonSQS.")
		var held map[string]any
		if action == "DeleteMessageBatch" {
			once.Do(func() {
				var in map[string]any
				if json.Unmarshal(body, &in) == nil {
					entries, _ := in["Entries"].([]any)
					if len(entries) > 1 {
						held, _ = entries[0].(map[string]any)
						in["Entries"] = entries[1:]
						body, _ = json.Marshal(in)
					}
				}
			})
		}
		req, _ := http.NewRequestWithContext(r.Context(), r.Method, target.String()+r.URL.Path, bytes.NewReader(body))
		req.Header = r.Header.Clone()
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		out, _ := io.ReadAll(resp.Body)
		if held != nil && resp.StatusCode == 200 {
			var res map[string]any
			if json.Unmarshal(out, &res) == nil {
				failed, _ := res["Failed"].([]any)
				res["Failed"] = append(failed, map[string]any{"Id": held["Id"], "Code": "InternalError", "Message": "injected", "SenderFault": false})
				out, _ = json.Marshal(res)
			}
		}
		for k, v := range resp.Header {
			if k != "Content-Length" {
				w.Header()[k] = v
			}
		}
		w.WriteHeader(resp.StatusCode)
		_, _ = w.Write(out)
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// TestBatchEntryFailedBySQSIsRetriedAlone: when SQS answers a
// DeleteMessageBatch with one entry failed through its own fault, the
// driver sends that entry alone once more, and Settle succeeds with every
// message deleted.
func TestBatchEntryFailedBySQSIsRetriedAlone(t *testing.T) {
	var cs calls
	c := newClient(t, nil)
	name, url := createQueue(t, c, "entry-retry", queueConfig{visibility: 30 * time.Second})
	pc := newClient(t, &cs, func(o *awssqs.Options) { o.BaseEndpoint = aws.String(failOneEntryProxy(t)) })
	b := newBroker(t, pc)
	if err := b.Publish(context.Background(), name, consumer.Message{Body: []byte("1")}, consumer.Message{Body: []byte("2")}, consumer.Message{Body: []byte("3")}); err != nil {
		t.Fatal(err)
	}
	drv, err := b.Driver(context.Background(), name, driver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer drv.Close()
	got := fetchN(t, drv, 3)
	var mu sync.Mutex
	var sizes []int
	cs.setHook(func(op string, in any) {
		if op == "DeleteMessageBatch" {
			mu.Lock()
			sizes = append(sizes, len(in.(*awssqs.DeleteMessageBatchInput).Entries))
			mu.Unlock()
		}
	})
	batch := make([]driver.Settlement, len(got))
	for i, m := range got {
		batch[i] = driver.Settlement{Handle: m.Handle, Action: driver.Ack}
	}
	if err := drv.Settle(context.Background(), batch); err != nil {
		t.Fatalf("Settle = %v, want nil after the failed entry was retried", err)
	}
	mu.Lock()
	if len(sizes) != 2 || sizes[0] != 3 || sizes[1] != 1 {
		t.Errorf("DeleteMessageBatch entries per call = %v, want [3 1]", sizes)
	}
	mu.Unlock()
	if v, f, _ := depth(t, c, url); v+f != 0 {
		t.Errorf("queue holds %d visible and %d in flight, want none", v, f)
	}
}
