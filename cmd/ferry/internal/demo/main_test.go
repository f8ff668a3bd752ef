package demo

import (
	"testing"

	"go.uber.org/goleak"
)

// Every goroutine a run starts (relay, consumers, producer, killer, status)
// has stopped when Run returns.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// Idle keep-alive connections of the AWS SDK's HTTP transport (a run
		// on SQS), owned by the transport, which no Close reaches.
		goleak.IgnoreTopFunction("net/http.(*persistConn).readLoop"),
		goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
	)
}
