// Package integration_test holds the smoke tests of the real brokers: one
// round trip per broker with its raw client, and the broker behaviours the
// adapters depend on. Start the brokers with `make brokers` (or
// integration/brokers.sh up, or docker compose up --wait); without them these
// tests skip, unless FERRY_REQUIRE_BROKERS=1.
package integration_test
