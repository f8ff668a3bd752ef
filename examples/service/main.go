// Command service is Ferry in a production-shaped service, configured by
// its environment as a container is: an order API whose orders reach
// billing through the transactional outbox, and a billing consumer that
// pays each order exactly once through the transactional inbox.
//
//   - ferry.Open picks the broker from FERRY_BROKER_URL: the same binary
//     runs on Kafka, SQS, RabbitMQ or the in-process broker.
//   - POST /orders writes the order and its OrderPlaced event in one
//     transaction (outbox/pgoutbox, or outbox/sqliteoutbox without
//     PostgreSQL); a relay publishes the committed events.
//   - Billing runs consumer.Standard (retry, circuit breaker, dead letter,
//     timeout, recover) around the transactional inbox
//     (idempotency/pgstore, or idempotency/sqlitestore): the payment row
//     and the event's key commit together, so an event delivered twice is
//     paid once. The charge itself goes first, outside any transaction,
//     to FERRY_PAYMENTS_URL when it is set, with the event id as its
//     Idempotency-Key, so the provider charges once too.
//   - OpenTelemetry: the SDK's MeterProvider, read by the Prometheus
//     exporter and served at /metrics, and a TracerProvider whose trace
//     follows an order from the request that placed it, through the outbox
//     and the broker, into its payment (trace_id in the log lines).
//   - /livez and /readyz for the orchestrator's probes (see healthRoutes).
//   - SIGTERM, how a container is stopped (or SIGINT): readiness fails, the
//     consumer drains (what it fetched runs and is acked), the relay and
//     the HTTP server stop, and the process exits 0.
//
// It logs JSON lines (log/slog) to standard error. Configuration:
//
//	FERRY_BROKER_URL    the broker, as ferry.Open takes it (required):
//	                    kafka://…, sqs://…, amqp://…, mem://
//	FERRY_SOURCE        the queue or topic billing consumes (required)
//	FERRY_DLQ           where billing dead-letters (required)
//	FERRY_DESTINATION   where the outbox publishes order events; default
//	                    FERRY_SOURCE (on RabbitMQ a queue, or
//	                    amq.exchange/EXCHANGE for an exchange bound to the
//	                    source)
//	FERRY_DB_URL        PostgreSQL (postgres://…; ?search_path=… picks a
//	                    schema); unset, SQLite in a temporary folder,
//	                    removed at exit
//	FERRY_HTTP_ADDR     the HTTP listen address; default 127.0.0.1:8080
//	FERRY_CONSUMER      the consumer's name (Kafka: its group); default billing
//	FERRY_PAYMENTS_URL  the payment provider's charge endpoint; unset, a
//	                    payment is only recorded
//
// Bad configuration exits 2, naming the variable; a failure exits 1. From
// the examples folder, on the in-process broker:
//
//	FERRY_BROKER_URL=mem:// FERRY_SOURCE=orders FERRY_DLQ=orders-dlq go run ./service
//	curl -d '{"order_id":"o-1","amount_cents":1250}' 127.0.0.1:8080/orders
//	curl 127.0.0.1:8080/orders/o-1
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ferrymq/ferry"
	_ "github.com/ferrymq/ferry/brokers" // FERRY_BROKER_URL may name any broker; a service on one imports only its package, such as _ ".../kafka"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/outbox"
)

// config is the service's configuration, read from the environment.
type config struct {
	BrokerURL   string
	Source      string
	DLQ         string
	Destination string
	DBURL       string
	HTTPAddr    string
	Consumer    string
	PaymentsURL string
}

// configError names the environment variable that is wrong.
type configError struct {
	Var, Reason string
}

func (e *configError) Error() string { return e.Var + " " + e.Reason }

// configFrom reads the configuration from getenv.
func configFrom(getenv func(string) string) (config, error) {
	c := config{
		BrokerURL:   strings.TrimSpace(getenv("FERRY_BROKER_URL")),
		Source:      strings.TrimSpace(getenv("FERRY_SOURCE")),
		DLQ:         strings.TrimSpace(getenv("FERRY_DLQ")),
		Destination: strings.TrimSpace(getenv("FERRY_DESTINATION")),
		DBURL:       strings.TrimSpace(getenv("FERRY_DB_URL")),
		HTTPAddr:    strings.TrimSpace(getenv("FERRY_HTTP_ADDR")),
		Consumer:    strings.TrimSpace(getenv("FERRY_CONSUMER")),
		PaymentsURL: strings.TrimSpace(getenv("FERRY_PAYMENTS_URL")),
	}
	for _, req := range []struct{ name, value string }{
		{"FERRY_BROKER_URL", c.BrokerURL}, {"FERRY_SOURCE", c.Source}, {"FERRY_DLQ", c.DLQ},
	} {
		if req.value == "" {
			return c, &configError{req.name, "is not set"}
		}
	}
	if c.Destination == "" {
		c.Destination = c.Source
	}
	if c.HTTPAddr == "" {
		c.HTTPAddr = "127.0.0.1:8080"
	}
	if _, _, err := net.SplitHostPort(c.HTTPAddr); err != nil {
		return c, &configError{"FERRY_HTTP_ADDR", fmt.Sprintf("is not HOST:PORT (%q)", c.HTTPAddr)}
	}
	if c.Consumer == "" {
		c.Consumer = "billing"
	}
	if c.DBURL != "" && !strings.HasPrefix(c.DBURL, "postgres://") && !strings.HasPrefix(c.DBURL, "postgresql://") {
		return c, &configError{"FERRY_DB_URL", "is not a postgres:// URL (leave it unset for SQLite)"}
	}
	if c.PaymentsURL != "" {
		if u, err := url.Parse(c.PaymentsURL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return c, &configError{"FERRY_PAYMENTS_URL", "is not an http:// or https:// URL"}
		}
	}
	return c, nil
}

func main() {
	log := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	slog.SetDefault(log) // for what logs without being given a logger
	cfg, err := configFrom(os.Getenv)
	if err != nil {
		log.Error("bad configuration", "err", err)
		os.Exit(2)
	}
	// SIGTERM is how an orchestrator stops a container; SIGINT is Ctrl-C.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg, log); err != nil {
		log.Error("service failed", "err", ferry.Redact(err.Error()))
		os.Exit(1)
	}
}

// run runs the service until ctx ends, then shuts it down in order: not
// ready, the consumer drained, the relay stopped, the HTTP server closed.
func run(ctx context.Context, cfg config, log *slog.Logger) (err error) {
	tel, err := newTelemetry()
	if err != nil {
		return err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		err = errors.Join(err, tel.shutdown(sctx))
	}()

	b, err := ferry.Open(ctx, cfg.BrokerURL)
	if err != nil {
		return err // a *ferry.URLError names the part, never the password
	}
	defer b.Close()
	pub, err := consumer.TracePublisher(b, tel.tracer)
	if err != nil {
		return err
	}

	st, err := openStore(ctx, cfg.DBURL)
	if err != nil {
		return err
	}
	defer st.close()
	log.Info("starting", "broker", ferry.Redact(cfg.BrokerURL), "source", cfg.Source, "dlq", cfg.DLQ,
		"database", st.describe(), "http", cfg.HTTPAddr, "consumer", cfg.Consumer)

	relay, err := outbox.NewRelay(st.outbox, pub, outbox.WithLogger(log), outbox.WithMeterProvider(tel.meters))
	if err != nil {
		return err
	}
	stack, err := consumer.Standard(pub, cfg.DLQ)
	if err != nil {
		return err
	}
	// The loop registers the stack's metrics, and the inbox's, on its own
	// MeterProvider (consumer.WithMeterProvider below).
	bill := newBilling(st, cfg.PaymentsURL, log)
	record, err := st.inbox(cfg.Consumer, bill.record)
	if err != nil {
		return err
	}
	pay := bill.handler(record)
	loop, err := b.NewConsumer(ctx, cfg.Source,
		consumer.WithName(cfg.Consumer),
		consumer.WithLogger(log),
		consumer.WithMeterProvider(tel.meters),
		consumer.WithTracerProvider(tel.tracer))
	if err != nil {
		return err
	}

	var state lifecycle
	mux := http.NewServeMux()
	orderRoutes(mux, st, tel.tracer, cfg.Destination, log)
	healthRoutes(mux, loop, &state)
	mux.Handle("GET /metrics", tel.metricsHandler())
	ln, err := net.Listen("tcp", cfg.HTTPAddr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}

	// Everything below runs until ctx ends; each part has its own context,
	// so the shutdown can stop them one after the other.
	var wg sync.WaitGroup
	serveErr := make(chan error, 1)
	wg.Go(func() {
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			serveErr <- err
		}
	})
	relayCtx, stopRelay := context.WithCancel(context.WithoutCancel(ctx))
	defer stopRelay()
	wg.Go(func() {
		if err := relay.Run(relayCtx); err != nil && relayCtx.Err() == nil {
			log.Error("outbox relay stopped", "err", err)
		}
	})
	cleanCtx, stopCleaning := context.WithCancel(context.WithoutCancel(ctx))
	defer stopCleaning()
	wg.Go(func() { _ = idempotency.CleanEvery(cleanCtx, st.keys, time.Hour, log) })
	consumeCtx, stopConsuming := context.WithCancel(context.WithoutCancel(ctx))
	defer stopConsuming()
	loopErr := make(chan error, 1)
	go func() {
		loopErr <- loop.Run(consumeCtx, consumer.Chain(pay, stack.Wrap))
	}()
	log.Info("ready")

	var failure error
	loopDone := false
	select {
	case <-ctx.Done():
		log.Info("shutting down", "cause", context.Cause(ctx).Error())
	case err := <-loopErr:
		// Run returns before its context ends only when it gives up.
		loopDone, failure = true, fmt.Errorf("consumer: %w", err)
	case failure = <-serveErr:
	}

	// The order matters: stop being ready first, so no new work is routed
	// here; then drain the consumer (what it fetched runs and is acked,
	// within its shutdown grace); then the relay; the HTTP server last, so
	// the probes answer during the drain.
	state.draining.Store(true)
	stopConsuming()
	if !loopDone {
		if err := <-loopErr; err != nil {
			failure = errors.Join(failure, fmt.Errorf("consumer: %w", err))
		} else {
			s := loop.Stats()
			log.Info("consumer drained", "acked", s.Acked, "returned", s.Returned, "failed", s.Failed,
				"dead_lettered", stack.DeadLetter.Count())
		}
	}
	stopRelay()
	stopCleaning()
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		failure = errors.Join(failure, fmt.Errorf("http: %w", err))
	}
	wg.Wait()
	if failure == nil {
		log.Info("stopped")
	}
	return failure
}

// lifecycle is what the probes need to know of the service's state.
type lifecycle struct {
	draining atomic.Bool // the shutdown began
}
