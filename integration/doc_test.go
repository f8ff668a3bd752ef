// Package integration_test holds the smoke tests of the real brokers: one
// round trip per broker with its raw client, and the broker behaviours the
// adapters depend on. Start the brokers with `make brokers` (or
// integration/brokers.sh up, or docker compose up --wait); without them these
// tests skip, unless FERRY_REQUIRE_BROKERS=1.
package integration_test

import (
	"context"
	"testing"
	"time"
)

// ctxFor returns a context that ends after d or when the test ends.
func ctxFor(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}
