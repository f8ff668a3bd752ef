// Package drivertest is the conformance suite every driver.Driver passes,
// beneath the delivery loop: the memory broker's in its unit tests, and
// the Kafka, SQS and RabbitMQ drivers against real brokers, each from a
// drivertest_test.go of its own package. Where package consumertest holds
// a consumer.Consumer to its guarantees as a user sees them, this suite
// holds the driver to the contract the loop relies on (see package
// driver), calling Fetch, Settle, Extend, Drain and Close itself:
//
//   - Fetch returns published messages (ID, Body, Headers and Source set,
//     a Handle), never more than max, and keeps what dst held;
//   - Fetch with a context that ended, or ends while it waits, returns
//     promptly with an error wrapping the context's (with whatever it had
//     already received, which the caller then holds);
//   - an acked message never comes again, to this driver or a new one;
//   - a message returned with a delay comes back, not before the delay
//     (less the broker's granularity), its Deliveries raised and its
//     History carried where the broker does so; a return marked
//     NotAttempted does not raise the count where the broker keeps one;
//   - an Extender's extended delivery is not given to a second driver of
//     the source while a delivery it did not extend is;
//   - after a Revoker's revocation, and once the lanes' messages were
//     delivered again, settling a handle of a revoked lane neither panics
//     nor acks the message now delivered to someone else;
//   - a Drainer's Drain hands over what the broker pushed ahead, stops it
//     pushing more, and loses nothing;
//   - Fetch after Close fails with an error marked driver.Fatal, Close
//     twice is safe, and Close ends a Fetch waiting on an empty source
//     (the driver's first Fetch too).
//
// What the suite does not ask: that a driver fetches again after a Fetch
// whose context ended (the loop ends a Fetch's context only when it stops,
// and the SQS driver then stops receiving for good), nor that returns
// keep a lane's order (Kafka does not take messages back at all).
//
// Each clause needing an optional interface is skipped, saying which,
// when the driver does not implement it; one needing the harness's help
// (a revocation) is skipped when the harness cannot give it.
package drivertest

import (
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
)

// Harness connects the suite to one broker. The suite calls it from one
// goroutine per test. Everything it makes for a test is released with
// t.Cleanup; the suite closes the drivers it opens.
type Harness interface {
	// NewSource creates a fresh, empty queue or topic for one test and
	// returns its name. Two calls never return the same source.
	NewSource(t *testing.T, cfg SourceConfig) string

	// Publisher returns a Publisher that reaches the sources NewSource
	// makes.
	Publisher(t *testing.T) consumer.Publisher

	// Opener returns the Opener of drivers over source. Drivers opened
	// with the same driver.Config share the source's messages as members
	// of one consumer group do (the suite always passes a Name: the Kafka
	// group). A driver of a new source sees what was published to it
	// before the driver opened.
	Opener(t *testing.T, source string) driver.Opener

	// Capabilities says what the broker promises.
	Capabilities() Capabilities
}

// SourceConfig is what one test asks of its source.
type SourceConfig struct {
	// Lease asks for deliveries that hold a lease (visibility timeout) of
	// this length: Capabilities.Lease, asked for only when it is not zero.
	// Zero asks for the harness's default, which should be generous.
	Lease time.Duration
}

// Capabilities is what the broker promises, as far as the suite checks.
type Capabilities struct {
	// Redelivers is what the driver's Capabilities().Redelivers reports
	// on a source of NewSource: the suite checks the two agree, and checks
	// delayed returns only when it is true.
	Redelivers bool

	// Lease is the short lease the harness gives a source when asked
	// (SourceConfig.Lease); zero when deliveries hold no lease that runs
	// out. The extension clause needs it.
	Lease time.Duration

	// DelayGranularity is how much sooner than its delay a returned
	// message may come back (SQS counts visibility in whole seconds).
	DelayGranularity time.Duration

	// CountsDeliveries is true when a redelivered message's Deliveries is
	// higher than on its delivery before.
	CountsDeliveries bool

	// CarriesHistory is true when a returned message comes back with the
	// Settlement's History as its Known (memory, RabbitMQ delayed returns).
	CarriesHistory bool

	// NotAttemptedUncounted is true when a return marked NotAttempted
	// gives the message back without raising its Deliveries.
	NotAttemptedUncounted bool

	// KnownDefects maps the name of a clause (a subtest of Run) the driver
	// is known to fail to why; the clause is skipped saying so, so that a
	// defect waiting for its fix is visible without failing every run.
	KnownDefects map[string]string
}

// Revoking is implemented by harnesses that can make the broker take
// lanes away from a driver; the revocation clause is skipped without it.
type Revoking interface {
	// Revoke makes the broker revoke lanes of d, a driver of source opened
	// with cfg, that holds deliveries and is being fetched from. It may
	// return another driver of source, which the suite fetches from and
	// closes (Kafka: a second member joins d's group, opened with cfg, and
	// the rebalance takes partitions from d), or nil when the broker takes the lanes from d by itself
	// (RabbitMQ: d's connection is closed from the broker's side).
	Revoke(t *testing.T, source string, cfg driver.Config, d driver.Driver) driver.Driver
}
