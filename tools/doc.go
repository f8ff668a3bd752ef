// Package tools is a module of its own for what only Ferry's developers
// need: staticcheck (a tool of this go.mod, run by make vet), the check that
// docs/METRICS.md and docs/alerts.yml say what Ferry registers (Prometheus'
// rule parser and the OpenTelemetry Prometheus exporter), and the check
// that docker-compose.yml starts what integration/brokers.sh starts
// (compose-go). Keeping them here keeps them out of the go.mod of
// github.com/ferrymq/ferry, and so out of every user's module graph and
// dependency scan. make tools-test runs its tests; make test runs that.
package tools
