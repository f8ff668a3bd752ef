package main

import (
	"strings"
	"testing"
	"time"

	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"

	"github.com/ferrymq/ferry/examples/internal/exampletest"
	"github.com/ferrymq/ferry/internal/testenv"
)

// The example pays every order it placed, on the SQS-compatible server.
func TestExamplePaysEveryOrder(t *testing.T) {
	endpoint := testenv.RequireSQS(t)
	out := exampletest.Run(t, 90*time.Second, "-endpoint", endpoint, "-region", testenv.SQSRegion(), "-orders", "5", "-timeout", "60s")
	for _, want := range []string{"order service: placed o-0005", "billing: paid o-0005", "billing: paid 5 of 5 orders"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q", want)
		}
	}
}

// SIGTERM mid-run (how a container is stopped) stops the example cleanly:
// the payments in flight finish, the consumer drains, and it exits 0.
func TestExampleDrainsOnSIGTERM(t *testing.T) {
	endpoint := testenv.RequireSQS(t)
	exampletest.CheckDrainsOnSIGTERM(t, exampletest.Build(t), "-endpoint", endpoint, "-region", testenv.SQSRegion(), "-orders", "100", "-pay-time", "300ms", "-timeout", "90s")
}

// The client keeps the idle connections package sqs asks for: more than the
// SDK's default of 10, which a consumer's receives and batch calls exceed.
func TestClientKeepsIdleConnectionsForTheConsumer(t *testing.T) {
	client, err := newClient(t.Context(), "http://127.0.0.1:9324", "us-east-1")
	if err != nil {
		t.Fatal(err)
	}
	hc, ok := client.Options().HTTPClient.(*awshttp.BuildableClient)
	if !ok {
		t.Fatalf("HTTPClient is a %T, want the SDK's BuildableClient", client.Options().HTTPClient)
	}
	if got := hc.GetTransport().MaxIdleConnsPerHost; got < 100 {
		t.Errorf("MaxIdleConnsPerHost = %d, want at least 100", got)
	}
}
