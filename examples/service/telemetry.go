package main

import (
	"context"
	"errors"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/otlptranslator"
	"go.opentelemetry.io/otel/attribute"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// serviceName names the service in its metrics' target_info and its spans.
const serviceName = "ferry-example-service"

// telemetry is the service's OpenTelemetry: a MeterProvider read by the
// Prometheus exporter into a registry of the service's own, which /metrics
// serves, and a TracerProvider.
type telemetry struct {
	registry *prometheus.Registry
	meters   *sdkmetric.MeterProvider
	tracer   *sdktrace.TracerProvider
}

func newTelemetry() (*telemetry, error) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	// Prometheus names: dots become underscores, counters end in _total,
	// seconds in _seconds (ferry.consumer.oldest_age is
	// ferry_consumer_oldest_age_seconds), as docs/METRICS.md says.
	exp, err := otelprom.New(otelprom.WithRegisterer(reg),
		otelprom.WithTranslationStrategy(otlptranslator.UnderscoreEscapingWithSuffixes))
	if err != nil {
		return nil, err
	}
	res := resource.NewSchemaless(attribute.String("service.name", serviceName))
	return &telemetry{
		registry: reg,
		meters:   sdkmetric.NewMeterProvider(sdkmetric.WithReader(exp), sdkmetric.WithResource(res)),
		// Spans are made and their context travels with each message, so
		// the trace id in the logs joins an order's request to its
		// payment. A deployment exports them by adding its exporter here,
		// e.g. sdktrace.WithBatcher(an OTLP exporter).
		tracer: sdktrace.NewTracerProvider(sdktrace.WithResource(res)),
	}, nil
}

// metricsHandler serves the registry in the Prometheus text format.
func (t *telemetry) metricsHandler() http.Handler {
	return promhttp.HandlerFor(t.registry, promhttp.HandlerOpts{})
}

// shutdown flushes and stops both providers.
func (t *telemetry) shutdown(ctx context.Context) error {
	return errors.Join(t.tracer.Shutdown(ctx), t.meters.Shutdown(ctx))
}
