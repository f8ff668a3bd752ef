// Package docs_test checks that the documents in docs/ say what the code
// does: the alerting rules parse as Prometheus parses them and name only
// metrics and labels Ferry registers, and the metrics table lists every
// metric Ferry registers, and nothing else.
package docs_test

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/memory"
	"github.com/ferrymq/ferry/outbox"
	"github.com/ferrymq/ferry/outbox/sqliteoutbox"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// registerEverything registers every metric Ferry has with mp: a consumer
// loop while it runs, the Standard stack, idempotency and an outbox relay
// while it runs. It returns once a collection has seen them all.
func registerEverything(t *testing.T, mp *sdkmetric.MeterProvider, collect func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	quiet := slog.New(slog.DiscardHandler)

	b, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	stack, err := consumer.Standard(b, "orders-dlq", consumer.StandardDeadLetter(consumer.DeadLetterLogger(quiet)))
	if err != nil {
		t.Fatal(err)
	}
	reg, err := stack.RegisterMetrics(mp, "billing")
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Unregister()
	dedup, err := idempotency.New(idempotency.NewMemoryStore(), "billing")
	if err != nil {
		t.Fatal(err)
	}
	dreg, err := dedup.RegisterMetrics(mp, "billing")
	if err != nil {
		t.Fatal(err)
	}
	defer dreg.Unregister()

	loop, err := b.NewConsumer("orders", consumer.WithName("billing"), consumer.WithMeterProvider(mp), consumer.WithLogger(quiet))
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

	p := parser.NewParser(parser.Options{})
	groups, errs := rulefmt.ParseFile("alerts.yml", false, model.UTF8Validation, p, slog.New(slog.DiscardHandler))
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

// docs/METRICS.md lists every metric Ferry registers, by its OpenTelemetry
// name, and no other.
func TestTheMetricsTableListsEveryMetric(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	var registered []string
	registerEverything(t, mp, func() {
		var rm metricdata.ResourceMetrics
		if err := reader.Collect(context.Background(), &rm); err != nil {
			t.Fatal(err)
		}
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				registered = append(registered, m.Name)
			}
		}
	})
	table, err := os.ReadFile("METRICS.md")
	if err != nil {
		t.Fatal(err)
	}
	var listed []string
	for _, m := range regexp.MustCompile("(?m)^\\| `([a-z_.]+)` \\|").FindAllStringSubmatch(string(table), -1) {
		listed = append(listed, m[1])
	}
	sort.Strings(registered)
	registered = slices.Compact(registered)
	sort.Strings(listed)
	if !slices.Equal(registered, listed) {
		t.Fatalf("METRICS.md lists\n  %s\nFerry registers\n  %s", strings.Join(listed, "\n  "), strings.Join(registered, "\n  "))
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
