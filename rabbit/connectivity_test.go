package rabbit_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/rabbit"
)

// What an operator sees of a consumer that cannot consume, on the real
// RabbitMQ: issue 25's "no silent failures". A transient cause (the broker
// unreachable, the queue missing, the connection lost) puts the consumer's
// health in "disconnected" with the cause in Health.Error, logs a WARN
// naming the queue and the broker (never a password) within seconds,
// counts FetchErrors, and is retried until the consumer consumes by
// itself; a refusal ends Run with a driver.Fatal error wrapping
// consumer.ErrRefused, and health says "stopped".

// warnWithin is how soon the WARN line must be out (the 10 s).
const warnWithin = 10 * time.Second

// waitHealth polls l's Health every few milliseconds until cond holds,
// failing t after d; it returns the Health that held.
func waitHealth(t *testing.T, l *consumer.Loop, d time.Duration, what string, cond func(consumer.Health) bool) consumer.Health {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		h := l.Health()
		if cond(h) {
			return h
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s; health %+v", d, what, h)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func isState(s consumer.HealthState) func(consumer.Health) bool {
	return func(h consumer.Health) bool { return h.State == s }
}

// consuming: the consumer has its link (not starting, disconnected or
// stopped).
func consuming(h consumer.Health) bool {
	switch h.State {
	case consumer.HealthStarting, consumer.HealthDisconnected, consumer.HealthStopped:
		return false
	}
	return h.Error == ""
}

// warnLine waits until logs holds a WARN line with every one of subs,
// failing t after d, and returns it.
func warnLine(t *testing.T, logs *logBuf, d time.Duration, subs ...string) string {
	t.Helper()
	var line string
	testenv.WaitFor(t, d, "a WARN line with "+strings.Join(subs, ", "), func() bool {
		for _, l := range strings.Split(logs.String(), "\n") {
			if strings.Contains(l, "level=WARN") && containsAll(l, subs...) {
				line = l
				return true
			}
		}
		return false
	})
	return line
}

// handled records the bodies a handler got.
func handled() (*seen, consumer.Handler) {
	var s seen
	return &s, consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
		s.add(string(m.Body))
		return nil
	})
}

func hostPort(t *testing.T, rawURL string) string {
	t.Helper()
	u, err := amqp.ParseURI(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	return net.JoinHostPort(u.Host, strconv.Itoa(u.Port))
}

// closedPort returns a loopback address nothing listens on (for now).
func closedPort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

// proxy forwards connections on addr to target until the test ends: the
// real RabbitMQ appearing at an address where nothing answered before.
func proxy(t *testing.T, addr, target string) {
	t.Helper()
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("listen on %s for the proxy: %v", addr, err)
	}
	var (
		mu    sync.Mutex
		conns []net.Conn
		wg    sync.WaitGroup
	)
	track := func(c net.Conn) {
		mu.Lock()
		conns = append(conns, c)
		mu.Unlock()
	}
	wg.Go(func() {
		for {
			in, err := l.Accept()
			if err != nil {
				return
			}
			out, err := net.Dial("tcp", target)
			if err != nil {
				in.Close()
				continue
			}
			track(in)
			track(out)
			wg.Go(func() { io.Copy(out, in); out.Close() })
			wg.Go(func() { io.Copy(in, out); in.Close() })
		}
	})
	t.Cleanup(func() {
		l.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
}

// A queue that does not exist is reported (consumer.ErrSourceNotFound, the
// queue and the broker named, health disconnected, a WARN, FetchErrors)
// and retried; once someone declares it, the consumer consumes by itself.
func TestMissingQueueIsReportedAndConsumedOnceDeclared(t *testing.T) {
	url := amqpURL(t)
	name := testenv.UniqueName(t, "missing")
	deleteLater(t, []string{name}, nil)
	logger, logs := capture(t)
	b := dial(t, rabbit.WithLogger(logger))

	d, err := openDriver(t, b, name, driver.Config{})
	must(t, err)
	err = d.Connect(testenv.Context(t, 10*time.Second))
	d.Close()
	if !errors.Is(err, consumer.ErrSourceNotFound) || driver.IsFatal(err) {
		t.Fatalf("Connect = %v, want an error wrapping consumer.ErrSourceNotFound, not fatal", err)
	}
	var ae *amqp.Error
	if !errors.As(err, &ae) || ae.Code != amqp.NotFound {
		t.Errorf("Connect = %v, want the broker's 404 within", err)
	}

	c, err := b.NewConsumer(t.Context(), name, consumer.WithLogger(logger), consumer.WithFetchBackoff(300*time.Millisecond))
	must(t, err)
	got, h := handled()
	start := time.Now()
	stop := runLoop(t, c, h)
	hl := waitHealth(t, c, driver.ReportWithin, "health disconnected", isState(consumer.HealthDisconnected))
	if !containsAll(hl.Error, consumer.ErrSourceNotFound.Error(), name, rabbit.Redact(url)) || !hl.Live || hl.Ready {
		t.Errorf("health %+v: want the cause (source not found), the queue and the broker in Error, live and not ready", hl)
	}
	line := warnLine(t, logs, warnWithin-time.Since(start), "ferry: cannot consume: the source does not exist", "source="+name, rabbit.Redact(url))
	testenv.WaitFor(t, 10*time.Second, "the consumer to retry", func() bool { return c.Stats().FetchErrors >= 2 })
	if c.Health().State != consumer.HealthDisconnected {
		t.Errorf("health %s while the queue is still missing", c.Health().State)
	}

	_, err = rawChannel(t).QueueDeclare(name, true, false, false, false, amqp.Table{"x-queue-type": "quorum"})
	must(t, err)
	must(t, b.Publish(testenv.Context(t, 10*time.Second), name, consumer.Message{Body: []byte("first")}))
	testenv.WaitFor(t, 30*time.Second, "the message published once the queue exists", func() bool { return got.has("first") })
	waitHealth(t, c, 10*time.Second, "health to say it consumes", consuming)
	must(t, stop())
	if strings.Contains(logs.String(), "guest:guest") {
		t.Error("the password appears in the logs")
	}
	t.Logf("WARN: %s", line)
}

// A consumer built while nothing answers at the broker's address (Dial
// with WithLazyConnect) reports consumer.ErrUnreachable with the address,
// and starts consuming when the broker appears there. Dial without the
// option fails at once, with the same kind of error.
func TestConsumerBuiltWhileTheBrokerIsUnreachableConsumesWhenItComesUp(t *testing.T) {
	real := hostPort(t, amqpURL(t))
	addr := closedPort(t)
	url := "amqp://guest:guest@" + addr + "/"
	name := testenv.UniqueName(t, "unreachable")
	deleteLater(t, []string{name}, nil)

	_, err := rabbit.Dial(url, rabbit.WithDialTimeout(2*time.Second))
	if !errors.Is(err, consumer.ErrUnreachable) || !strings.Contains(err.Error(), addr) {
		t.Fatalf("Dial of %s = %v, want an error wrapping consumer.ErrUnreachable naming the address", addr, err)
	}

	logger, logs := capture(t)
	b, err := rabbit.Dial(url, rabbit.WithLazyConnect(), rabbit.WithLogger(logger),
		rabbit.WithReconnectBackoff(50*time.Millisecond, 500*time.Millisecond),
		rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: name, DeadLetterExchange: name + ".dlx"}}}))
	must(t, err)
	t.Cleanup(func() { b.Close() })
	d, err := openDriver(t, b, name, driver.Config{})
	must(t, err)
	err = d.Connect(testenv.Context(t, 10*time.Second))
	d.Close()
	var oe *net.OpError
	if !errors.Is(err, consumer.ErrUnreachable) || driver.IsFatal(err) || !errors.As(err, &oe) || !containsAll(err.Error(), name, addr) {
		t.Fatalf("Connect = %v, want an error wrapping consumer.ErrUnreachable and the dial's, naming the queue and %s, not fatal", err, addr)
	}

	c, err := b.NewConsumer(t.Context(), name, consumer.WithLogger(logger), consumer.WithFetchBackoff(300*time.Millisecond))
	must(t, err)
	got, h := handled()
	start := time.Now()
	stop := runLoop(t, c, h)
	hl := waitHealth(t, c, driver.ReportWithin, "health disconnected", isState(consumer.HealthDisconnected))
	if !containsAll(hl.Error, consumer.ErrUnreachable.Error(), name, addr) || strings.Contains(hl.Error, "guest:guest") {
		t.Errorf("health error %q: want the cause, the queue and the address, and no password", hl.Error)
	}
	warnLine(t, logs, warnWithin-time.Since(start), "ferry: cannot consume: the broker is unreachable", "source="+name, addr)
	testenv.WaitFor(t, 10*time.Second, "the consumer to retry", func() bool { return c.Stats().FetchErrors >= 2 })

	proxy(t, addr, real)
	testenv.WaitFor(t, 30*time.Second, "a publish once the broker answers", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		return b.Publish(ctx, name, consumer.Message{Body: []byte("hello")}) == nil
	})
	testenv.WaitFor(t, 30*time.Second, "the message to be consumed", func() bool { return got.has("hello") })
	waitHealth(t, c, 10*time.Second, "health to say it consumes", consuming)
	must(t, stop())
	if strings.Contains(logs.String(), "guest:guest") {
		t.Error("the password appears in the logs")
	}
}

// A connection closed under a consumer (rabbitmqctl close_connection: the
// node stays up) is reported within driver.ReportWithin (disconnected,
// consumer.ErrUnreachable in Health.Error, a WARN, FetchErrors); the
// consumer reconnects by itself and says so even with nothing to consume,
// then consumes what comes.
func TestConnectionClosedUnderTheConsumerIsReportedAndResumes(t *testing.T) {
	url := amqpURL(t)
	ctl(t, "status")
	name := testenv.UniqueName(t, "closed")
	deleteLater(t, []string{name}, nil)
	logger, logs := capture(t)
	// A reconnect of at least half a second, so that the disconnection
	// lasts long enough to be seen between two looks at the health.
	b := dial(t, rabbit.WithLogger(logger), rabbit.WithConnectionName(name), rabbit.WithReconnectBackoff(time.Second, 2*time.Second),
		rabbit.WithTopology(rabbit.Topology{Queues: []rabbit.Queue{{Name: name, DeadLetterExchange: name + ".dlx"}}}))
	c, err := b.NewConsumer(t.Context(), name, consumer.WithLogger(logger), consumer.WithFetchBackoff(200*time.Millisecond))
	must(t, err)
	got, h := handled()
	stop := runLoop(t, c, h)
	must(t, b.Publish(testenv.Context(t, 10*time.Second), name, consumer.Message{Body: []byte("before")}))
	testenv.WaitFor(t, 20*time.Second, "the first message", func() bool { return got.has("before") })
	waitHealth(t, c, 10*time.Second, "health to say it consumes", consuming)

	var (
		mu     sync.Mutex
		downAt time.Time
		downH  consumer.Health
	)
	watchCtx, endWatch := context.WithCancel(context.Background())
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		for watchCtx.Err() == nil {
			if h := c.Health(); h.State == consumer.HealthDisconnected {
				mu.Lock()
				if downAt.IsZero() {
					downAt, downH = time.Now(), h
				}
				mu.Unlock()
			}
			time.Sleep(time.Millisecond)
		}
	}()
	t.Cleanup(func() { endWatch(); <-watched })

	closed := 0
	for _, line := range strings.Split(ctl(t, "list_connections", "pid", "client_properties"), "\n") {
		if strings.Contains(line, name+" consume") {
			ctl(t, "close_connection", strings.Fields(line)[0], "ferry test: connection closed under the consumer")
			closed++
		}
	}
	closedAt := time.Now()
	if closed != 1 {
		t.Fatalf("closed %d consuming connections, want 1", closed)
	}
	testenv.WaitFor(t, driver.ReportWithin, "health disconnected", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return !downAt.IsZero()
	})
	mu.Lock()
	if late := downAt.Sub(closedAt); late > driver.ReportWithin {
		t.Errorf("disconnected %s after the connection was closed, want within %s", late, driver.ReportWithin)
	}
	if !containsAll(downH.Error, consumer.ErrUnreachable.Error(), name, rabbit.Redact(url), "CONNECTION_FORCED") || !downH.Live {
		t.Errorf("health while disconnected %+v: want the cause, the queue and the broker in Error, and live", downH)
	}
	mu.Unlock()
	warnLine(t, logs, warnWithin, "ferry: cannot consume: the broker is unreachable", "source="+name)
	if c.Stats().FetchErrors == 0 {
		t.Error("no fetch error counted")
	}

	// Back by itself, with nothing published meanwhile.
	waitHealth(t, c, 20*time.Second, "health to say it consumes again", consuming)
	must(t, b.Publish(testenv.Context(t, 10*time.Second), name, consumer.Message{Body: []byte("after")}))
	testenv.WaitFor(t, 20*time.Second, "a message published after the reconnect", func() bool { return got.has("after") })
	if !strings.Contains(logs.String(), "ferry: consuming again") {
		t.Error("the reconnection was not logged")
	}
	must(t, stop())
}

// A refusal no retry can fix (credentials, the vhost, a TLS handshake that
// fails) ends Run at once with a driver.Fatal error wrapping
// consumer.ErrRefused and the client's own error; health is stopped, not
// live, with the cause; no password is shown anywhere. Dial without
// WithLazyConnect fails with the same kind of error.
func TestRefusalsEndRunWithErrRefused(t *testing.T) {
	base := amqpURL(t)
	u, err := amqp.ParseURI(base)
	must(t, err)
	const wrongPassword = "Wrong-Secret-77"
	tlsUntrusted := rabbit.WithTLS(&tls.Config{RootCAs: x509.NewCertPool()})
	for _, tc := range []struct {
		name, url, password string
		opts                []rabbit.Option
		tls                 bool
		want                func(error) bool
	}{
		{name: "wrong password", url: "amqp://" + u.Username + ":" + wrongPassword + "@" + hostPort(t, base) + "/", password: wrongPassword,
			want: func(err error) bool { return errors.Is(err, amqp.ErrCredentials) }},
		{name: "vhost refused", url: strings.TrimSuffix(envOr("FERRY_AMQP_TENANT_URL", defaultTenantURL), "/ferry-tenant") + "/", password: tenantPassword,
			want: func(err error) bool {
				var ae *amqp.Error
				return errors.As(err, &ae) && (ae.Code == amqp.NotAllowed || errors.Is(err, amqp.ErrVhost))
			}},
		{name: "certificate not trusted", url: envOr("FERRY_AMQPS_URL", defaultAMQPSURL), opts: []rabbit.Option{tlsUntrusted}, tls: true,
			want: func(err error) bool { var ua x509.UnknownAuthorityError; return errors.As(err, &ua) }},
		{name: "TLS to the plaintext listener", url: "amqps://guest:guest@" + hostPort(t, base) + "/", opts: []rabbit.Option{tlsUntrusted},
			want: func(err error) bool { var rh tls.RecordHeaderError; return errors.As(err, &rh) }},
		{name: "plaintext to the TLS listener", url: strings.Replace(envOr("FERRY_AMQPS_URL", defaultAMQPSURL), "amqps://", "amqp://", 1), tls: true,
			want: func(err error) bool { var ae *amqp.Error; return errors.As(err, &ae) && ae.Code == amqp.FrameError }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.tls {
				tu, _ := amqp.ParseURI(tc.url)
				if c, err := net.DialTimeout("tcp", net.JoinHostPort(tu.Host, strconv.Itoa(tu.Port)), 2*time.Second); err != nil {
					unavailable(t, "no amqps listener at %s: %v (integration/brokers.sh up adds it)", rabbit.Redact(tc.url), err)
				} else {
					c.Close()
				}
			}
			pw := tc.password
			if pw == "" {
				pw = "guest:guest"
			}
			_, err := rabbit.Dial(tc.url, append(tc.opts, rabbit.WithDialTimeout(5*time.Second))...)
			if !errors.Is(err, consumer.ErrRefused) || !tc.want(err) || strings.Contains(err.Error(), pw) {
				t.Errorf("Dial = %v, want the client's error wrapped with consumer.ErrRefused, without the password", err)
			}

			logger, logs := capture(t)
			b, err := rabbit.Dial(tc.url, append(tc.opts, rabbit.WithLazyConnect(), rabbit.WithLogger(logger), rabbit.WithDialTimeout(5*time.Second))...)
			must(t, err)
			t.Cleanup(func() { b.Close() })
			name := testenv.UniqueName(t, "refused")
			c, err := b.NewConsumer(t.Context(), name, consumer.WithLogger(logger))
			must(t, err)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			_, h := handled()
			start := time.Now()
			err = c.Run(ctx, h)
			if ctx.Err() != nil {
				t.Fatalf("Run returned only when its context ended: %v", err)
			}
			if !driver.IsFatal(err) || !errors.Is(err, consumer.ErrRefused) || !tc.want(err) {
				t.Fatalf("Run = %v, want a driver.Fatal error wrapping consumer.ErrRefused and the client's", err)
			}
			if took := time.Since(start); took > 2*driver.ReportWithin {
				t.Errorf("Run took %s to give up", took)
			}
			hl := c.Health()
			if hl.State != consumer.HealthStopped || hl.Live || hl.Ready || !containsAll(hl.Error, consumer.ErrRefused.Error(), name) {
				t.Errorf("health %+v: want stopped, not live, with the refusal and the queue in Error", hl)
			}
			if strings.Contains(err.Error(), pw) || strings.Contains(logs.String(), pw) || strings.Contains(hl.Error, pw) {
				t.Error("the password appears in the error, the health or the logs")
			}
			t.Logf("Run: %v", err)
		})
	}
}
