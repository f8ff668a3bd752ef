package ferrytest_test

import (
	"testing"

	"go.uber.org/goleak"
)

// Every consumer, driver and connection the kit starts is stopped by the
// time its test ends.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// Idle keep-alive connections of the AWS SDK's HTTP transport,
		// owned by the transport and shared by every client of the process.
		goleak.IgnoreTopFunction("net/http.(*persistConn).readLoop"),
		goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
	)
}
