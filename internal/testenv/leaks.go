package testenv

import "go.uber.org/goleak"

// LeakOptions are the goroutines goleak.VerifyTestMain ignores in every
// package whose tests talk to SQS: the idle keep-alive connections of the
// AWS SDK's HTTP transport, owned by the transport and shared by every
// client of the process. Anything else still running when a package's
// tests end is a leak.
func LeakOptions() []goleak.Option {
	return []goleak.Option{
		goleak.IgnoreTopFunction("net/http.(*persistConn).readLoop"),
		goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
	}
}
