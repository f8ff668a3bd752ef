// Package docscheck_test checks that the documents in docs/ say what the code
// does: the alerting rules parse as Prometheus parses them and name only
// metrics and labels Ferry registers, and the metrics table lists every
// metric Ferry registers, with its kind and unit, and nothing else.
package docscheck_test

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/memory"
	"github.com/ferrymq/ferry/outbox"
	"github.com/ferrymq/ferry/outbox/sqliteoutbox"
)

// docsDir is the repository's docs/ folder, whose documents this package
// checks.
var docsDir = filepath.Join("..", "..", "docs")

// registerEverything registers every metric Ferry has with mp: a consumer
// loop while it runs, the Standard stack, idempotency and an outbox relay
// while it runs. It returns once a collection has seen them all.
func registerEverything(t *testing.T, mp *sdkmetric.MeterProvider, collect func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	quiet := slog.New(slog.DiscardHandler)

	b, err := memory.New(memory.WithMeterProvider(mp))
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	stack, err := consumer.Standard(b, "orders-dlq", consumer.StandardDeadLetter(consumer.DeadLetterLogger(quiet)),
		consumer.StandardRateLimit(1000))
	if err != nil {
		t.Fatal(err)
	}
	// The loop registers the stack's and idempotency's metrics on its own
	// MeterProvider: nothing else is wired.
	dedup, err := idempotency.New(idempotency.NewMemoryStore(), "billing")
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Publish(ctx, "orders", consumer.Message{Body: []byte("one message, so that the histograms have a run")}); err != nil {
		t.Fatal(err)
	}

	loop, err := b.NewConsumer(t.Context(), "orders", consumer.WithName("billing"), consumer.WithMeterProvider(mp), consumer.WithLogger(quiet))
	if err != nil {
		t.Fatal(err)
	}
	loopDone := make(chan error, 1)
	go func() {
		loopDone <- loop.Run(ctx, consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }), stack.Wrap, dedup.Wrap))
	}()

	db, err := sqliteoutbox.Open(filepath.Join(t.TempDir(), "outbox.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if err := sqliteoutbox.Migrate(ctx, db); err != nil {
		t.Fatal(err)
	}
	st, err := sqliteoutbox.NewStore(db)
	if err != nil {
		t.Fatal(err)
	}
	relay, err := outbox.NewRelay(st, b, outbox.WithName("orders-relay"), outbox.WithMeterProvider(mp), outbox.WithLogger(quiet))
	if err != nil {
		t.Fatal(err)
	}
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(ctx) }()

	time.Sleep(300 * time.Millisecond) // both Runs have registered their instruments
	collect()
	cancel()
	if err := <-loopDone; err != nil {
		t.Fatal(err)
	}
	if err := <-relayDone; err != nil {
		t.Fatal(err)
	}
}

// The alerting rules parse as Prometheus parses them, and every metric and
// label they name is one Ferry registers, under the name the OpenTelemetry
// Prometheus exporter gives it.
func TestAlertRulesNameOnlyWhatFerryRegisters(t *testing.T) {
	registry := prometheus.NewRegistry()
	exporter, err := otelprom.New(otelprom.WithRegisterer(registry), otelprom.WithoutScopeInfo(), otelprom.WithoutTargetInfo())
	if err != nil {
		t.Fatal(err)
	}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter))
	defer mp.Shutdown(context.Background())

	labels := map[string]map[string]bool{} // metric name → its label names
	registerEverything(t, mp, func() {
		families, err := registry.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range families {
			ls := map[string]bool{}
			for _, m := range f.GetMetric() {
				for _, l := range m.GetLabel() {
					ls[l.GetName()] = true
				}
			}
			labels[f.GetName()] = ls
		}
	})
	if len(labels) < 20 {
		t.Fatalf("only %d metrics gathered: %v", len(labels), labels)
	}
	for name, attrs := range needsABroker { // as the exporter names them
		ls := map[string]bool{}
		for _, a := range attrs {
			ls[strings.ReplaceAll(a, ".", "_")] = true
		}
		labels[strings.ReplaceAll(name, ".", "_")] = ls
	}

	p := parser.NewParser(parser.Options{})
	groups, errs := rulefmt.ParseFile(filepath.Join(docsDir, "alerts.yml"), false, model.UTF8Validation, p, slog.New(slog.DiscardHandler))
	if len(errs) > 0 {
		t.Fatalf("alerts.yml does not parse: %v", errs)
	}
	rules := 0
	for _, g := range groups.Groups {
		for _, r := range g.Rules {
			rules++
			expr, err := p.ParseExpr(r.Expr)
			if err != nil {
				t.Fatalf("%s: %v", r.Alert, err)
			}
			parser.Inspect(expr, func(node parser.Node, _ []parser.Node) error {
				switch n := node.(type) {
				case *parser.VectorSelector:
					ls, ok := labels[n.Name]
					if !ok {
						t.Errorf("rule %s names metric %s, which Ferry does not register (it has %v)", r.Alert, n.Name, keys(labels))
						return nil
					}
					for _, m := range n.LabelMatchers {
						if m.Name != model.MetricNameLabel && !ls[m.Name] {
							t.Errorf("rule %s matches label %s, which %s does not have", r.Alert, m.Name, n.Name)
						}
					}
				case *parser.AggregateExpr:
					for _, l := range n.Grouping {
						found := false
						for _, ls := range labels {
							found = found || ls[l]
						}
						if !found {
							t.Errorf("rule %s groups by label %s, which no Ferry metric has", r.Alert, l)
						}
					}
				}
				return nil
			})
		}
	}
	if rules < 5 {
		t.Fatalf("alerts.yml has %d rules", rules)
	}
}

// instrument is what the metrics table says of a metric, and what Ferry
// registers: its kind (counter, gauge, histogram) and its unit.
type instrument struct{ kind, unit string }

// kindOf names the kind of instrument that collected data of d's type.
func kindOf(d metricdata.Aggregation) string {
	switch d := d.(type) {
	case metricdata.Sum[int64]:
		if d.IsMonotonic {
			return "counter"
		}
		return "updowncounter"
	case metricdata.Sum[float64]:
		if d.IsMonotonic {
			return "counter"
		}
		return "updowncounter"
	case metricdata.Gauge[int64], metricdata.Gauge[float64]:
		return "gauge"
	case metricdata.Histogram[int64], metricdata.Histogram[float64]:
		return "histogram"
	}
	return fmt.Sprintf("%T", d)
}

// tableRow matches a row of the metrics table: | `name` | kind | unit | ...
var tableRow = regexp.MustCompile("(?m)^\\| `([a-z_.]+)` \\| ([a-z]+) \\| ([^|]*?) \\|")

// needsABroker are the metrics that only an adapter's Broker registers, at
// work against its broker, which registerEverything does not run, with
// their attributes: each is checked, with its unit and attributes, by its
// package's tests against the real broker.
var needsABroker = map[string][]string{
	// rabbit: TestDelayedMessagesOfADeletedQueueDoNotBlockOthers
	"ferry.rabbit.delay.orphans": {"messaging.system", "messaging.destination.name", "server.address", "server.port", "ferry.rabbit.vhost"},
}

// tableMismatches lists every way the metrics table differs from what is
// registered: a metric missing from either, or listed with another kind or
// unit.
func tableMismatches(table string, registered map[string]instrument) []string {
	var bad []string
	listed := map[string]instrument{}
	for _, m := range tableRow.FindAllStringSubmatch(table, -1) {
		listed[m[1]] = instrument{kind: m[2], unit: strings.TrimSpace(m[3])}
	}
	for _, name := range slices.Sorted(maps.Keys(registered)) {
		got, want := listed[name], registered[name]
		switch {
		case got == (instrument{}):
			bad = append(bad, fmt.Sprintf("%s is registered (a %s in %s) but not in the table", name, want.kind, want.unit))
		case got.kind != want.kind:
			bad = append(bad, fmt.Sprintf("%s: the table says %s, Ferry registers a %s", name, got.kind, want.kind))
		case got.unit != want.unit:
			bad = append(bad, fmt.Sprintf("%s: the table gives the unit %q, Ferry registers %q", name, got.unit, want.unit))
		}
	}
	for _, name := range slices.Sorted(maps.Keys(listed)) {
		if _, ok := registered[name]; !ok && needsABroker[name] == nil {
			bad = append(bad, fmt.Sprintf("%s is in the table but Ferry does not register it", name))
		}
	}
	return bad
}

// registeredInstruments registers every metric Ferry has and returns each
// one's kind and unit, as a reader collects them.
func registeredInstruments(t *testing.T) map[string]instrument {
	t.Helper()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	registered := map[string]instrument{}
	registerEverything(t, mp, func() {
		var rm metricdata.ResourceMetrics
		if err := reader.Collect(context.Background(), &rm); err != nil {
			t.Fatal(err)
		}
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				registered[m.Name] = instrument{kind: kindOf(m.Data), unit: m.Unit}
			}
		}
	})
	if len(registered) < 20 {
		t.Fatalf("only %d metrics collected: %v", len(registered), registered)
	}
	return registered
}

// docs/METRICS.md lists every metric Ferry registers, by its OpenTelemetry
// name, with the kind and the unit Ferry registers it with, and no other.
func TestTheMetricsTableListsEveryMetric(t *testing.T) {
	table, err := os.ReadFile(filepath.Join(docsDir, "METRICS.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range tableMismatches(string(table), registeredInstruments(t)) {
		t.Error("METRICS.md: " + m)
	}
}

// The check above fails a table with a wrong unit, a wrong kind, a metric
// missing, or one too many.
func TestTheMetricsTableCheckCatchesDrift(t *testing.T) {
	orig, err := os.ReadFile(filepath.Join(docsDir, "METRICS.md"))
	if err != nil {
		t.Fatal(err)
	}
	registered := registeredInstruments(t)
	row := "| `ferry.breaker.opened` | counter | {opening} |"
	cases := []struct{ name, old, new, want string }{
		{"wrong unit", row, "| `ferry.breaker.opened` | counter | {message} |", `the table gives the unit "{message}", Ferry registers "{opening}"`},
		{"wrong kind", row, "| `ferry.breaker.opened` | gauge | {opening} |", "the table says gauge"},
		{"metric missing", row, "| `ferry.breaker.openings` | counter | {opening} |", "ferry.breaker.opened is registered"},
	}
	for _, c := range cases {
		if !strings.Contains(string(orig), c.old) {
			t.Fatalf("METRICS.md has no %q", c.old)
		}
		bad := tableMismatches(strings.Replace(string(orig), c.old, c.new, 1), registered)
		if !slices.ContainsFunc(bad, func(m string) bool { return strings.Contains(m, c.want) }) {
			t.Errorf("%s: no mismatch naming %q among %q", c.name, c.want, bad)
		}
	}
	if bad := tableMismatches(string(orig)+"| `ferry.extra` | gauge | {x} | not a metric |\n", registered); !slices.ContainsFunc(bad, func(m string) bool {
		return strings.Contains(m, "ferry.extra is in the table")
	}) {
		t.Errorf("one too many: %q", bad)
	}
}

func keys(m map[string]map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
