package kafka_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl/scram"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
)

// This file holds the tests of issue 25 on Kafka: a consumer that cannot
// consume says so (its Health, a WARN line naming the source and the
// broker's address, its FetchErrors and the health metric), retries what
// may pass and stops on what cannot; and of issue 32 D4: Publish says why
// it could not get through.

// watched is a consumer under observation: what an operator sees of it.
type watched struct {
	t      *testing.T
	topic  string
	l      *consumer.Loop
	logs   *syncBuffer
	reader *sdkmetric.ManualReader

	mu   sync.Mutex
	seen map[string]bool // the bodies handled
}

// watch makes a consumer of topic on b that logs into a buffer (and the
// test's output) and reports metrics to a reader of its own.
func watch(t *testing.T, b *kafka.Broker, topic string, opts ...consumer.Option) *watched {
	t.Helper()
	w := &watched{t: t, topic: topic, logs: &syncBuffer{}, reader: sdkmetric.NewManualReader(), seen: make(map[string]bool)}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(w.reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	log := slog.New(slog.NewTextHandler(io.MultiWriter(w.logs, t.Output()), &slog.HandlerOptions{Level: slog.LevelInfo}))
	opts = append([]consumer.Option{
		consumer.WithName(testenv.UniqueName(t, "watched")), consumer.WithLogger(log), consumer.WithMeterProvider(mp),
		consumer.WithFetchBackoff(time.Second), consumer.WithHealthWindow(200*time.Millisecond, 3),
	}, opts...)
	l, err := b.NewConsumer(t.Context(), topic, opts...)
	if err != nil {
		t.Fatalf("NewConsumer: %v", err)
	}
	w.l = l
	return w
}

func (w *watched) handler() consumer.Handler {
	return consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
		w.mu.Lock()
		w.seen[string(m.Body)] = true
		w.mu.Unlock()
		return nil
	})
}

// handled waits up to d for the record whose body is body.
func (w *watched) handled(d time.Duration, body string) {
	w.t.Helper()
	testenv.WaitFor(w.t, d, "the record "+body, func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		return w.seen[body]
	})
}

// healthMetric is the last value of ferry.consumer.health, -1 when none.
func (w *watched) healthMetric() int64 {
	var rm metricdata.ResourceMetrics
	if err := w.reader.Collect(context.Background(), &rm); err != nil {
		w.t.Fatalf("collect: %v", err)
	}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if g, ok := m.Data.(metricdata.Gauge[int64]); ok && m.Name == consumer.MetricHealth && len(g.DataPoints) > 0 {
				return g.DataPoints[0].Value
			}
		}
	}
	return -1
}

// ready is what the readiness endpoint answers.
func (w *watched) ready() int {
	rec := httptest.NewRecorder()
	consumer.ReadinessHandler(w.l).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/healthz", nil))
	return rec.Code
}

// waitState waits up to d for the consumer's health state, and returns how
// long it took.
func (w *watched) waitState(d time.Duration, want consumer.HealthState) time.Duration {
	w.t.Helper()
	start := time.Now()
	testenv.WaitFor(w.t, d, "health "+string(want), func() bool { return w.l.Health().State == want })
	return time.Since(start)
}

// warnLine waits up to d for a WARN line holding every one of needles.
func (w *watched) warnLine(d time.Duration, needles ...string) string {
	w.t.Helper()
	var found string
	testenv.WaitFor(w.t, d, "a WARN line with "+strings.Join(needles, ", "), func() bool {
		for line := range strings.Lines(w.logs.String()) {
			if !strings.Contains(line, "level=WARN") {
				continue
			}
			all := true
			for _, n := range needles {
				all = all && strings.Contains(line, n)
			}
			if all {
				found = line
				return true
			}
		}
		return false
	})
	return found
}

// staysIn checks that the consumer's health stays want for d.
func (w *watched) staysIn(d time.Duration, want consumer.HealthState) {
	w.t.Helper()
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		if h := w.l.Health(); h.State != want {
			w.t.Fatalf("health went %s (%s), want it to stay %s", h.State, h.Reason, want)
		}
	}
}

// assertDisconnected checks all that an operator sees of a consumer that
// cannot consume, caused by an error wrapping want.
func (w *watched) assertDisconnected(want error, addr string, contains ...string) {
	w.t.Helper()
	w.waitState(10*time.Second, consumer.HealthDisconnected)
	h := w.l.Health()
	if h.Source != w.topic {
		w.t.Errorf("Health.Source = %q, want the topic %q", h.Source, w.topic)
	}
	for _, s := range append([]string{want.Error(), addr}, contains...) {
		if !strings.Contains(h.Error, s) {
			w.t.Errorf("Health.Error = %q, want it to say %q", h.Error, s)
		}
	}
	if !h.Live || h.Ready {
		w.t.Errorf("Health live=%v ready=%v, want alive and not ready", h.Live, h.Ready)
	}
	w.warnLine(10*time.Second, "source="+w.topic, addr, want.Error())
	if n := w.l.Stats().FetchErrors; n == 0 {
		w.t.Error("Stats.FetchErrors = 0, want the failures counted")
	}
	if v := w.healthMetric(); v != 7 {
		w.t.Errorf("%s = %d, want 7 (disconnected)", consumer.MetricHealth, v)
	}
	if code := w.ready(); code != http.StatusServiceUnavailable {
		w.t.Errorf("readiness answers %d, want 503", code)
	}
}

// closedAddr is a local address nothing listens on.
func closedAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return addr
}

// proxy forwards TCP connections from its address to target, until cut.
type proxy struct {
	t      *testing.T
	addr   string
	target string

	mu     sync.Mutex
	ln     net.Listener
	conns  map[net.Conn]struct{}
	wg     sync.WaitGroup
	silent atomic.Bool
}

// newProxy listens on addr ("" for any free port) and forwards to target.
func newProxy(t *testing.T, addr, target string) *proxy {
	t.Helper()
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	p := &proxy{t: t, target: target, conns: make(map[net.Conn]struct{})}
	p.listen(addr)
	t.Cleanup(func() { p.cut(); p.wg.Wait() })
	return p
}

func (p *proxy) listen(addr string) {
	p.t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		p.t.Fatalf("proxy: %v", err)
	}
	p.mu.Lock()
	p.ln, p.addr = ln, ln.Addr().String()
	p.mu.Unlock()
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", p.target)
			if err != nil {
				_ = c.Close()
				continue
			}
			if !p.track(c, up) {
				return
			}
			for _, dir := range [][2]net.Conn{{c, up}, {up, c}} {
				p.wg.Add(1)
				go func() {
					defer p.wg.Done()
					p.copy(dir[0], dir[1])
					_ = dir[0].Close()
					_ = dir[1].Close()
				}()
			}
		}
	}()
}

func (p *proxy) track(cs ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln == nil {
		for _, c := range cs {
			_ = c.Close()
		}
		return false
	}
	for _, c := range cs {
		p.conns[c] = struct{}{}
	}
	return true
}

// cut closes the listener and every connection: the network is gone, and
// dials are refused.
func (p *proxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln != nil {
		_ = p.ln.Close()
		p.ln = nil
	}
	for c := range p.conns {
		_ = c.Close()
		delete(p.conns, c)
	}
}

// silence makes the network silent: connections stay open and dials
// connect, and nothing goes through either way.
func (p *proxy) silence() { p.silent.Store(true) }

// copy forwards what src sends to dst until either fails, dropping it
// while the proxy is silent.
func (p *proxy) copy(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && !p.silent.Load() {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// restore listens again, on the same address.
func (p *proxy) restore() { p.listen(p.addr) }

// dialer sends every connection a client makes, whatever broker it is
// for, through the proxy.
func (p *proxy) dialer() kgo.Opt {
	return kgo.Dialer(func(ctx context.Context, network, _ string) (net.Conn, error) {
		p.mu.Lock()
		addr := p.addr
		p.mu.Unlock()
		var d net.Dialer
		return d.DialContext(ctx, network, addr)
	})
}

// publishOne publishes one record of body to topic through a broker of
// its own.
func publishOne(t *testing.T, topic, body string) {
	t.Helper()
	b := newBroker(t)
	if err := b.Publish(testenv.Context(t, 30*time.Second), topic, consumer.Message{Key: "k", Body: []byte(body)}); err != nil {
		t.Fatalf("publish: %v", err)
	}
}

// TestConsumerOfMissingTopicSaysSoAndStartsOnceItIsMade: a consumer of a
// topic that does not exist is disconnected with an error wrapping
// consumer.ErrSourceNotFound that names the topic, says so in a WARN line
// and in its counters and metric, retries, and consumes once the topic is
// made, by itself.
func TestConsumerOfMissingTopicSaysSoAndStartsOnceItIsMade(t *testing.T) {
	b := newBroker(t)
	topic := testenv.UniqueName(t, "missing")
	t.Cleanup(func() { _ = b.DeleteTopic(context.Background(), topic) })

	d, err := b.Driver(t.Context(), topic, driver.Config{Name: topic + "-probe"})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	err = d.(driver.Connector).Connect(testenv.Context(t, 2*driver.ReportWithin))
	took := time.Since(start)
	_ = d.Close()
	if !errors.Is(err, consumer.ErrSourceNotFound) || driver.IsFatal(err) || !strings.Contains(err.Error(), topic) {
		t.Errorf("Connect = %v, want a retryable error wrapping consumer.ErrSourceNotFound that names the topic", err)
	}
	if took > driver.ReportWithin {
		t.Errorf("Connect took %s, want at most %s", took, driver.ReportWithin)
	}

	w := watch(t, b, topic)
	runConsumer(t, w.l, w.handler())
	w.assertDisconnected(consumer.ErrSourceNotFound, "127.0.0.1:9092", topic)
	w.staysIn(driver.ReportWithin, consumer.HealthDisconnected)
	failures := w.l.Stats().FetchErrors
	testenv.WaitFor(t, 10*time.Second, "another attempt", func() bool { return w.l.Stats().FetchErrors > failures })

	if err := b.CreateTopic(testenv.Context(t, 30*time.Second), topic, kafka.TopicConfig{Partitions: 1}); err != nil {
		t.Fatal(err)
	}
	publishOne(t, topic, "made")
	w.handled(30*time.Second, "made")
	if h := w.l.Health(); h.State == consumer.HealthDisconnected || h.Error != "" {
		t.Errorf("Health after the topic was made: %s (%q)", h.State, h.Error)
	}
	if !strings.Contains(w.logs.String(), "consuming again") {
		t.Error("no log line says the consumer consumes again")
	}
}

// TestConsumerOfUnreachableClusterSaysSoAndRetries: with the cluster
// unreachable (a closed port, a host that does not resolve), New and
// NewConsumer succeed, Connect fails within driver.ReportWithin with an
// error wrapping consumer.ErrUnreachable that names the address and the
// dial error, and Run reports it and retries: once the cluster answers at
// that address, the consumer consumes.
func TestConsumerOfUnreachableClusterSaysSoAndRetries(t *testing.T) {
	topic := newTopic(t, newBroker(t), "unreachable", 1)
	for _, tc := range []struct {
		name, addr, dialErr string
	}{
		{"closed port", closedAddr(t), "connection refused"},
		{"unknown host", "ferry-no-such-host.invalid:9092", "no such host"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := kafka.New([]string{tc.addr}, kafka.WithLogger(testLogger(t)))
			if err != nil {
				t.Fatalf("New with the cluster down: %v", err)
			}
			t.Cleanup(func() { _ = b.Close() })

			d, err := b.Driver(t.Context(), topic, driver.Config{Name: topic + "-probe"})
			if err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			err = d.(driver.Connector).Connect(testenv.Context(t, 2*driver.ReportWithin))
			took := time.Since(start)
			_ = d.Close()
			if !errors.Is(err, consumer.ErrUnreachable) || driver.IsFatal(err) ||
				!strings.Contains(err.Error(), tc.addr) || !strings.Contains(err.Error(), tc.dialErr) {
				t.Errorf("Connect = %v, want a retryable error wrapping consumer.ErrUnreachable with %s and %q", err, tc.addr, tc.dialErr)
			}
			if took > driver.ReportWithin {
				t.Errorf("Connect took %s, want at most %s", took, driver.ReportWithin)
			}

			w := watch(t, b, topic)
			runConsumer(t, w.l, w.handler())
			w.assertDisconnected(consumer.ErrUnreachable, tc.addr, tc.dialErr)
			w.staysIn(driver.ReportWithin, consumer.HealthDisconnected)
			if tc.name != "closed port" {
				return
			}
			// The cluster comes up at that address.
			newProxy(t, tc.addr, testenv.KafkaBrokers()[0])
			publishOne(t, topic, "up")
			w.handled(30*time.Second, "up")
			w.waitState(10*time.Second, consumer.HealthSteady)
		})
	}
}

// TestConsumerReportsLostConnectionAndResumes: every connection of the
// consumer goes through a proxy; when the proxy cuts them and refuses new
// ones (the network is gone: the shared broker cannot be restarted here),
// the consumer is disconnected within driver.ReportWithin with an error
// wrapping consumer.ErrUnreachable that names the broker, and when the
// network is back it consumes again by itself.
func TestConsumerReportsLostConnectionAndResumes(t *testing.T) {
	topic := newTopic(t, newBroker(t), "lost", 2)
	p := newProxy(t, "", testenv.KafkaBrokers()[0])
	b := newBroker(t, kafka.WithClientOpts(p.dialer()))
	w := watch(t, b, topic)
	runConsumer(t, w.l, w.handler())
	publishOne(t, topic, "before")
	w.handled(60*time.Second, "before")
	w.waitState(10*time.Second, consumer.HealthSteady)

	p.cut()
	if took := w.waitState(2*driver.ReportWithin, consumer.HealthDisconnected); took > driver.ReportWithin {
		t.Errorf("disconnected %s after the cut, want within %s", took, driver.ReportWithin)
	}
	w.assertDisconnected(consumer.ErrUnreachable, "127.0.0.1:9092")
	w.staysIn(2*driver.ReportWithin, consumer.HealthDisconnected)

	p.restore()
	publishOne(t, topic, "after")
	w.handled(60*time.Second, "after")
	w.waitState(10*time.Second, consumer.HealthSteady)
	if !strings.Contains(w.logs.String(), "consuming again") {
		t.Error("no log line says the consumer consumes again")
	}
}

// stopped runs w's consumer until Run returns (within d) and returns its
// error.
func (w *watched) stopped(d time.Duration) error {
	w.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- w.l.Run(ctx, w.handler()) }()
	select {
	case err := <-done:
		return err
	case <-time.After(d):
		cancel()
		<-done
		w.t.Fatalf("Run did not return within %s", d)
		return nil
	}
}

// assertRefused checks that Run ended with a fatal error wrapping
// consumer.ErrRefused (and each of also), holding every one of contains,
// and that the consumer says it stopped.
func (w *watched) assertRefused(err error, also []error, contains ...string) {
	w.t.Helper()
	if !errors.Is(err, consumer.ErrRefused) || !driver.IsFatal(err) {
		w.t.Errorf("Run = %v, want a fatal error wrapping consumer.ErrRefused", err)
	}
	for _, e := range also {
		if !errors.Is(err, e) {
			w.t.Errorf("Run = %v, want it to wrap %v", err, e)
		}
	}
	for _, s := range contains {
		if err != nil && !strings.Contains(err.Error(), s) {
			w.t.Errorf("Run = %v, want it to say %q", err, s)
		}
	}
	h := w.l.Health()
	if h.State != consumer.HealthStopped || h.Live || h.Error == "" {
		w.t.Errorf("Health = %s live=%v error=%q, want stopped, not alive, with the error", h.State, h.Live, h.Error)
	}
	if v := w.healthMetric(); v != -1 && v != 9 {
		w.t.Errorf("%s = %d after Run returned", consumer.MetricHealth, v)
	}
}

// TestWrongPasswordStopsTheConsumer: with a wrong SCRAM password, Run
// returns within seconds a fatal error wrapping consumer.ErrRefused and
// kafka.ErrAuthentication, the consumer's health is stopped, and the
// password is in no error and no log line.
func TestWrongPasswordStopsTheConsumer(t *testing.T) {
	const wrong = "not-the-password-5e1c"
	var blogs syncBuffer
	b := saslBroker(t, wrong, &blogs)
	w := watch(t, b, "ferry-sasl-any")
	start := time.Now()
	err := w.stopped(30 * time.Second)
	if took := time.Since(start); took > driver.ReportWithin {
		t.Errorf("Run took %s to fail, want at most %s", took, driver.ReportWithin)
	}
	w.assertRefused(err, []error{kafka.ErrAuthentication}, "127.0.0.1:9094")
	for _, s := range []string{err.Error(), w.l.Health().Error, w.logs.String(), blogs.String()} {
		if strings.Contains(s, wrong) {
			t.Errorf("the password appears in %q", s)
		}
	}
}

// tlsConfig trusts the test brokers' CA.
func tlsConfig(t *testing.T) *tls.Config {
	t.Helper()
	_, caFile := testenv.RequireKafkaSASL(t)
	pem, err := os.ReadFile(caFile)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		t.Fatalf("no certificate in %s", caFile)
	}
	return &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
}

// TestTLSMismatchIsRefusedAtOnce: a TLS client at the plaintext listener,
// and a plaintext client at the SASL_SSL listener, fail Publish within
// seconds, and end Run with a fatal error wrapping consumer.ErrRefused,
// each saying which side speaks TLS.
func TestTLSMismatchIsRefusedAtOnce(t *testing.T) {
	saslSeeds, _ := testenv.RequireKafkaSASL(t)
	for _, tc := range []struct {
		name  string
		seeds []string
		opts  []kafka.Option
		says  string
	}{
		{"TLS client, plaintext listener", testenv.KafkaBrokers(), []kafka.Option{kafka.WithTLS(tlsConfig(t))},
			"the client speaks TLS, but the listener at " + testenv.KafkaBrokers()[0] + " does not"},
		{"plaintext client, TLS listener", saslSeeds,
			[]kafka.Option{kafka.WithSASL(scram.Auth{User: testenv.KafkaSCRAMUser, Pass: testenv.KafkaSCRAMPassword}.AsSha512Mechanism())},
			"the listener at " + saslSeeds[0] + " speaks TLS, but the client does not"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := kafka.New(tc.seeds, append([]kafka.Option{kafka.WithLogger(testLogger(t))}, tc.opts...)...)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = b.Close() })
			start := time.Now()
			err = b.Publish(testenv.Context(t, 30*time.Second), "ferry-tls-any", consumer.Message{Body: []byte("x")})
			if took := time.Since(start); took > driver.ReportWithin {
				t.Errorf("Publish took %s to fail, want seconds", took)
			}
			if !errors.Is(err, consumer.ErrRefused) || errors.Is(err, context.DeadlineExceeded) || err == nil || !strings.Contains(err.Error(), tc.says) {
				t.Errorf("Publish = %v, want an error wrapping consumer.ErrRefused that says %q", err, tc.says)
			}
			t.Logf("Publish: %v", err)

			w := watch(t, b, "ferry-tls-any")
			start = time.Now()
			err = w.stopped(30 * time.Second)
			if took := time.Since(start); took > driver.ReportWithin {
				t.Errorf("Run took %s to fail, want at most %s", took, driver.ReportWithin)
			}
			w.assertRefused(err, nil, tc.says)
		})
	}
}

// TestPublishAtItsDeadlineSaysWhatTheClientSaw: with the cluster
// unreachable, Publish fails at its deadline with an error that still
// matches context.DeadlineExceeded, and says what the client last saw:
// the address and the dial error (consumer.ErrUnreachable).
func TestPublishAtItsDeadlineSaysWhatTheClientSaw(t *testing.T) {
	for _, tc := range []struct {
		name, addr, dialErr string
	}{
		{"closed port", closedAddr(t), "connection refused"},
		{"unknown host", "ferry-no-such-host.invalid:9092", "no such host"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := kafka.New([]string{tc.addr}, kafka.WithLogger(testLogger(t)))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = b.Close() })
			start := time.Now()
			err = b.Publish(testenv.Context(t, 3*time.Second), "p7-none", consumer.Message{Body: []byte("x")})
			took := time.Since(start)
			if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, consumer.ErrUnreachable) {
				t.Errorf("Publish = %v, want an error matching context.DeadlineExceeded and consumer.ErrUnreachable", err)
			}
			for _, s := range []string{`"p7-none"`, tc.addr, tc.dialErr} {
				if err != nil && !strings.Contains(err.Error(), s) {
					t.Errorf("Publish = %v, want it to say %q", err, s)
				}
			}
			if took > 5*time.Second {
				t.Errorf("Publish took %s with a 3s deadline", took)
			}
			t.Logf("Publish after %s: %v", took.Round(time.Millisecond), err)
		})
	}
}

// TestNewConsumerRequiresAName: on Kafka the consumer's name is its group
// id, so a consumer built without consumer.WithName fails with a
// *consumer.ConfigError naming the field; a name given, even "ferry", is
// taken.
func TestNewConsumerRequiresAName(t *testing.T) {
	b, err := kafka.New([]string{closedAddr(t)}, kafka.WithLogger(testLogger(t)))
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	_, err = b.NewConsumer(t.Context(), "orders", consumer.WithConcurrency(2))
	var ce *consumer.ConfigError
	if !errors.As(err, &ce) || ce.Field != "Name" || !errors.Is(err, consumer.ErrInvalidConfig) {
		t.Fatalf("NewConsumer without a name = %v, want a *consumer.ConfigError for Name", err)
	}
	l, err := b.NewConsumer(t.Context(), "orders", consumer.WithName("ferry"))
	if err != nil || l.Name() != "ferry" {
		t.Fatalf("NewConsumer(WithName(\"ferry\")) = %v, %v", l, err)
	}
}

// TestConsumerOfDeletedTopicSaysSo: a topic deleted while it is consumed
// makes the consumer disconnected with an error wrapping
// consumer.ErrSourceNotFound; once it is made again, the consumer
// consumes the new topic (which franz-go alone would not).
func TestConsumerOfDeletedTopicSaysSo(t *testing.T) {
	b := newBroker(t)
	topic := newTopic(t, b, "deleted", 1)
	w := watch(t, b, topic)
	runConsumer(t, w.l, w.handler())
	publishOne(t, topic, "before")
	w.handled(60*time.Second, "before")
	w.waitState(10*time.Second, consumer.HealthSteady)
	if err := b.DeleteTopic(testenv.Context(t, 30*time.Second), topic); err != nil {
		t.Fatal(err)
	}
	if took := w.waitState(2*driver.ReportWithin, consumer.HealthDisconnected); took > driver.ReportWithin {
		t.Errorf("disconnected %s after the topic was deleted, want within %s", took, driver.ReportWithin)
	}
	w.assertDisconnected(consumer.ErrSourceNotFound, "127.0.0.1:9092", topic)
	w.staysIn(2*driver.ReportWithin, consumer.HealthDisconnected)
	if err := b.CreateTopic(testenv.Context(t, 30*time.Second), topic, kafka.TopicConfig{Partitions: 1}); err != nil {
		t.Fatal(err)
	}
	// Kafka keeps the group's committed offset (1) by the topic's name:
	// the new topic is consumed from there.
	publishOne(t, topic, "again-0")
	publishOne(t, topic, "again-1")
	w.handled(60*time.Second, "again-1")
	w.waitState(10*time.Second, consumer.HealthSteady)
}

// TestUntrustedCertificateIsRefused: a broker certificate the client does
// not trust fails Publish and ends Run within seconds with an error
// wrapping kafka.ErrAuthentication and consumer.ErrRefused.
func TestUntrustedCertificateIsRefused(t *testing.T) {
	seeds, _ := testenv.RequireKafkaSASL(t)
	b, err := kafka.New(seeds, kafka.WithLogger(testLogger(t)),
		kafka.WithTLS(&tls.Config{RootCAs: x509.NewCertPool(), MinVersion: tls.VersionTLS12}),
		kafka.WithSASL(scram.Auth{User: testenv.KafkaSCRAMUser, Pass: testenv.KafkaSCRAMPassword}.AsSha512Mechanism()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	start := time.Now()
	err = b.Publish(testenv.Context(t, 30*time.Second), "ferry-tls-any", consumer.Message{Body: []byte("x")})
	if took := time.Since(start); took > driver.ReportWithin || !errors.Is(err, kafka.ErrAuthentication) || !errors.Is(err, consumer.ErrRefused) {
		t.Errorf("Publish = %v after %s, want an error wrapping kafka.ErrAuthentication and consumer.ErrRefused within seconds", err, took)
	}
	w := watch(t, b, "ferry-tls-any")
	w.assertRefused(w.stopped(30*time.Second), []error{kafka.ErrAuthentication}, "certificate")
}

// TestMismatchWithADialerOfYourOwnIsUnreachable: with a kgo.Dialer of the
// user's, the Broker does not dial and cannot tell a TLS listener from an
// outage: Connect reports the listener unreachable, with franz-go's
// diagnosis, and retries.
func TestMismatchWithADialerOfYourOwnIsUnreachable(t *testing.T) {
	seeds, _ := testenv.RequireKafkaSASL(t)
	b, err := kafka.New(seeds, kafka.WithLogger(testLogger(t)), kafka.WithClientOpts(kgo.Dialer((&net.Dialer{}).DialContext)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	d, err := b.Driver(t.Context(), "ferry-tls-any", driver.Config{Name: "ferry-tls-any-probe"})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	err = d.(driver.Connector).Connect(testenv.Context(t, 2*driver.ReportWithin))
	if !errors.Is(err, consumer.ErrUnreachable) || driver.IsFatal(err) || !strings.Contains(err.Error(), "tls") {
		t.Errorf("Connect = %v, want a retryable error wrapping consumer.ErrUnreachable with franz-go's diagnosis", err)
	}
}
