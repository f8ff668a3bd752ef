package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/examples/internal/exampletest"
	"github.com/ferrymq/ferry/ferrytest"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/outbox"
)

// The service on each real broker, with PostgreSQL: it pays every order
// placed through its API exactly once (duplicates published behind its
// back included), reports the consumer's metrics at /metrics, answers its
// probes, drains on SIGTERM with payments in flight, and a second run pays
// what the first left behind, once.
func TestServiceOnEachBrokerWithPostgreSQL(t *testing.T) {
	bin := exampletest.Build(t)
	for _, kind := range []ferrytest.Kind{ferrytest.Kafka, ferrytest.SQS, ferrytest.RabbitMQ} {
		t.Run(string(kind), func(t *testing.T) {
			b := ferrytest.Open(t, kind)
			src := b.Queue(t, "svc-orders", ferrytest.Partitions(3))
			dlq := b.Queue(t, "svc-orders-dlq")
			runService(t, bin, serviceRun{
				brokerURL: ferrytest.URL(kind), source: src.Name, destination: src.Destination, dlq: dlq.Destination,
				dbURL: postgresSchema(t), publishDuplicates: src.Publish,
			})
			if dead, err := dlq.DeadLetters(t.Context()); err != nil || len(dead) > 0 {
				t.Errorf("dead letters: %v (err %v), want none", dead, err)
			}
		})
	}
}

// The service's defaults: the in-process broker and SQLite in a temporary
// folder, which it removes when it stops.
func TestServiceOnTheMemoryBrokerWithSQLite(t *testing.T) {
	runService(t, exampletest.Build(t), serviceRun{brokerURL: "mem://", source: "orders", destination: "orders", dlq: "orders-dlq"})
}

// serviceRun is one run of runService.
type serviceRun struct {
	brokerURL, source, destination, dlq string
	dbURL                               string // "" for SQLite: no second run, nothing to read after exit
	// publishDuplicates, when set, publishes to the source behind the
	// service's back.
	publishDuplicates func(ctx context.Context, msgs ...consumer.Message) error
}

const (
	firstOrders = 20 // paid in the first part
	drainOrders = 10 // placed while the provider holds every charge, then SIGTERM
	duplicates  = 5  // events of the first orders published again
)

func orderID(i int) string { return fmt.Sprintf("o-%04d", i) }

func runService(t *testing.T, bin string, r serviceRun) {
	ctx := t.Context()
	pay := newProvider()
	t.Cleanup(pay.Close)
	name := "billing-" + randomHex()
	env := []string{
		"FERRY_BROKER_URL=" + r.brokerURL, "FERRY_SOURCE=" + r.source, "FERRY_DESTINATION=" + r.destination,
		"FERRY_DLQ=" + r.dlq, "FERRY_DB_URL=" + r.dbURL, "FERRY_CONSUMER=" + name, "FERRY_PAYMENTS_URL=" + pay.URL,
	}
	svc := startService(t, bin, env)

	// Orders through the API, and duplicates of some of their events.
	for i := 1; i <= firstOrders; i++ {
		svc.placeOrder(t, orderID(i), int64(1000+i))
	}
	consumed := float64(firstOrders)
	if r.publishDuplicates != nil {
		var dups []consumer.Message
		for i := 1; i <= duplicates; i++ {
			body, _ := json.Marshal(OrderPlaced{OrderID: orderID(i), AmountCents: int64(1000 + i)})
			dups = append(dups, consumer.Message{Key: orderID(i), Body: body,
				Headers: map[string]string{outbox.EventIDHeader: eventID(orderID(i))}})
		}
		if err := r.publishDuplicates(ctx, dups...); err != nil {
			t.Fatal(err)
		}
		consumed += duplicates
	}
	svc.waitPaid(t, 1, firstOrders)
	// The duplicates come after their originals on Kafka (same partition),
	// not necessarily elsewhere: wait until the consumer acked them all.
	waitUntil(t, 60*time.Second, "every message acked", func() bool {
		return svc.metric(t, "ferry_consumer_acked_total", name) >= consumed
	})
	for i := 1; i <= firstOrders; i++ {
		if n := svc.payments(t, orderID(i)); n != 1 {
			t.Errorf("%s paid %d times, want once", orderID(i), n)
		}
	}
	pay.checkKeys(t, firstOrders)

	// The consumer's metrics, at /metrics in the Prometheus text format.
	for metric, check := range map[string]func(float64) bool{
		"messaging_client_consumed_messages_total": func(v float64) bool { return v >= consumed },
		"ferry_consumer_acked_total":               func(v float64) bool { return v >= consumed },
		"ferry_consumer_failed_total":              func(v float64) bool { return v == 0 },
		"ferry_consumer_lag":                       func(v float64) bool { return v >= 0 },
		"ferry_consumer_health":                    func(v float64) bool { return v == 0 },
		"ferry_deadletter_messages_total":          func(v float64) bool { return v == 0 },
		"ferry_breaker_state":                      func(v float64) bool { return v == 0 },
	} {
		if v := svc.metric(t, metric, name); !check(v) {
			t.Errorf("/metrics: %s = %v", metric, v)
		}
	}
	if v := svc.metric(t, "ferry_outbox_published_total", ""); v < firstOrders {
		t.Errorf("/metrics: ferry_outbox_published_total = %v, want at least %d", v, firstOrders)
	}
	for _, probe := range []string{"/livez", "/readyz"} {
		if code, body := svc.get(t, probe); code != http.StatusOK {
			t.Errorf("GET %s: %d %s, want 200", probe, code, body)
		}
	}
	if _, body := svc.get(t, "/readyz"); !strings.Contains(body, `"consumer":"`+name+`"`) {
		t.Errorf("GET /readyz does not show the consumer's health: %s", body)
	}
	svc.checkTrace(t, orderID(firstOrders))

	// SIGTERM with payments in flight: the probes say not ready (yet
	// alive), the payments finish, the consumer drains, the service exits 0.
	pay.hold()
	for i := firstOrders + 1; i <= firstOrders+drainOrders; i++ {
		svc.placeOrder(t, orderID(i), int64(1000+i))
	}
	waitUntil(t, 60*time.Second, "a charge to reach the provider", func() bool { return len(pay.held()) > 0 })
	time.Sleep(200 * time.Millisecond) // let the consumer's workers fill up
	inFlight := pay.held()
	svc.p.Signal(syscall.SIGTERM)
	waitUntil(t, 10*time.Second, "/readyz to fail after SIGTERM", func() bool {
		code, _ := svc.get(t, "/readyz")
		return code == http.StatusServiceUnavailable
	})
	if code, body := svc.get(t, "/livez"); code != http.StatusOK {
		t.Errorf("GET /livez while draining: %d %s, want 200", code, body)
	}
	pay.release()
	if err := svc.p.Wait(60 * time.Second); err != nil {
		t.Fatalf("after SIGTERM the service exited with %v, want status 0", err)
	}
	logs := svc.logs(t)
	for _, msg := range []string{"shutting down", "consumer drained", "stopped"} {
		if len(find(logs, msg)) != 1 {
			t.Errorf("the log has %d %q lines, want one", len(find(logs, msg)), msg)
		}
	}
	paidLogged := map[string]int{}
	for _, l := range find(logs, "order paid") {
		paidLogged[fmt.Sprint(l["order_id"])]++
	}
	for _, key := range inFlight {
		if id := strings.TrimPrefix(key, "order-placed/"); paidLogged[id] != 1 {
			t.Errorf("%s, charging when SIGTERM came, was paid %d times before the service exited, want once", id, paidLogged[id])
		}
	}
	t.Logf("%d charges in flight at SIGTERM, all paid during the drain", len(inFlight))
	if r.dbURL == "" {
		return
	}

	// A second run pays what the first left behind (not yet published, or
	// not yet fetched), and nothing twice.
	svc = startService(t, bin, env)
	svc.waitPaid(t, 1, firstOrders+drainOrders)
	for i := 1; i <= firstOrders+drainOrders; i++ {
		if n := svc.payments(t, orderID(i)); n != 1 {
			t.Errorf("after the restart %s is paid %d times, want once", orderID(i), n)
		}
	}
	pay.checkKeys(t, firstOrders+drainOrders)
	svc.p.Signal(syscall.SIGTERM)
	if err := svc.p.Wait(60 * time.Second); err != nil {
		t.Fatalf("after SIGTERM the second run exited with %v, want status 0", err)
	}

	// What the database holds, read past the service: one payment per order.
	conn, err := pgx.Connect(ctx, r.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var orders, payments, paidOrders int
	err = conn.QueryRow(ctx, `SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM payments), (SELECT count(DISTINCT order_id) FROM payments)`).
		Scan(&orders, &payments, &paidOrders)
	if err != nil {
		t.Fatal(err)
	}
	if want := firstOrders + drainOrders; orders != want || payments != want || paidOrders != want {
		t.Errorf("PostgreSQL holds %d orders, %d payments of %d orders; want %d of each", orders, payments, paidOrders, want)
	}
}

// service is a running service process.
type service struct {
	p    *exampletest.Process
	base string // http://HOST:PORT
}

// startService starts the service with env on a free port and waits until
// /readyz answers 200.
func startService(t *testing.T, bin string, env []string) *service {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	s := &service{p: exampletest.Start(t, bin, append(env, "FERRY_HTTP_ADDR="+addr)), base: "http://" + addr}
	waitUntil(t, 60*time.Second, "/readyz to answer 200", func() bool {
		code, _ := s.get(t, "/readyz")
		return code == http.StatusOK
	})
	return s
}

var client = &http.Client{Timeout: 10 * time.Second}

// get returns the status and body of GET path; status 0 when the request
// failed.
func (s *service) get(t *testing.T, path string) (int, string) {
	t.Helper()
	resp, err := client.Get(s.base + path)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func (s *service) placeOrder(t *testing.T, id string, cents int64) {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"order_id": id, "amount_cents": cents})
	resp, err := client.Post(s.base+"/orders", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("POST /orders %s: %s %s", body, resp.Status, b)
	}
}

// payments is how many payments GET /orders/ID shows.
func (s *service) payments(t *testing.T, id string) int {
	t.Helper()
	code, body := s.get(t, "/orders/"+id)
	if code != http.StatusOK {
		t.Fatalf("GET /orders/%s: %d %s", id, code, body)
	}
	var o struct{ Payments int }
	if err := json.Unmarshal([]byte(body), &o); err != nil {
		t.Fatalf("GET /orders/%s: %v: %s", id, err, body)
	}
	return o.Payments
}

// waitPaid waits until orders from to to are paid.
func (s *service) waitPaid(t *testing.T, from, to int) {
	t.Helper()
	waitUntil(t, 90*time.Second, fmt.Sprintf("orders %s to %s to be paid", orderID(from), orderID(to)), func() bool {
		for i := from; i <= to; i++ {
			if s.payments(t, orderID(i)) == 0 {
				return false
			}
		}
		return true
	})
}

// metric scrapes /metrics and returns the sum of the samples of name,
// those of consumer group group when group is not "".
func (s *service) metric(t *testing.T, name, group string) float64 {
	t.Helper()
	resp, err := client.Get(s.base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("/metrics is not Prometheus text: %v", err)
	}
	f, ok := families[name]
	if !ok {
		t.Fatalf("/metrics has no %s", name)
	}
	sum, n := 0.0, 0
	for _, m := range f.GetMetric() {
		if group != "" && label(m, "messaging_consumer_group_name") != group {
			continue
		}
		n++
		switch {
		case m.Counter != nil:
			sum += m.Counter.GetValue()
		case m.Gauge != nil:
			sum += m.Gauge.GetValue()
		}
	}
	if n == 0 {
		t.Fatalf("/metrics has no %s of consumer %q", name, group)
	}
	return sum
}

func label(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// logs returns the service's log lines, decoded.
func (s *service) logs(t *testing.T) []map[string]any {
	t.Helper()
	var out []map[string]any
	for line := range strings.Lines(s.p.Stderr()) {
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Errorf("a log line is not JSON: %q", line)
			continue
		}
		out = append(out, m)
	}
	return out
}

// find returns the log lines of message msg.
func find(logs []map[string]any, msg string) []map[string]any {
	var out []map[string]any
	for _, l := range logs {
		if l["msg"] == msg {
			out = append(out, l)
		}
	}
	return out
}

// checkTrace checks that the order's payment ran in the trace of the
// request that placed it: the trace context went through the outbox and
// the broker.
func (s *service) checkTrace(t *testing.T, id string) {
	t.Helper()
	traceOf := func(msg string) string {
		for _, l := range find(s.logs(t), msg) {
			if l["order_id"] == id {
				return fmt.Sprint(l["trace_id"])
			}
		}
		return ""
	}
	placed, paid := traceOf("order placed"), traceOf("order paid")
	if placed == "" || placed == strings.Repeat("0", 32) || placed != paid {
		t.Errorf("%s was placed in trace %q and paid in trace %q, want one trace", id, placed, paid)
	}
}

func waitUntil(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// provider is a payment provider: it charges once per Idempotency-Key,
// counts the calls, and on hold keeps every charge waiting until release.
type provider struct {
	*httptest.Server
	mu      sync.Mutex
	count   map[string]int
	gate    chan struct{} // non-nil while held
	waiting map[string]bool
}

func newProvider() *provider {
	p := &provider{count: map[string]int{}, waiting: map[string]bool{}}
	p.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		if r.Method != http.MethodPost || key == "" {
			http.Error(w, "POST with an Idempotency-Key", http.StatusBadRequest)
			return
		}
		p.mu.Lock()
		p.count[key]++
		gate := p.gate
		if gate != nil {
			p.waiting[key] = true
		}
		p.mu.Unlock()
		if gate != nil {
			select {
			case <-gate:
			case <-r.Context().Done():
				return
			}
		}
		w.WriteHeader(http.StatusOK)
	}))
	return p
}

// Close lets every held charge go, then closes the server.
func (p *provider) Close() {
	p.mu.Lock()
	if p.gate != nil {
		close(p.gate)
		p.gate = nil
	}
	p.mu.Unlock()
	p.Server.Close()
}

// checkKeys checks that the provider was asked to charge with the event ids
// of orders 1 to n as keys, and with nothing else.
func (p *provider) checkKeys(t *testing.T, n int) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	for i := 1; i <= n; i++ {
		if p.count[eventID(orderID(i))] == 0 {
			t.Errorf("the provider was never asked to charge %s with the key %q", orderID(i), eventID(orderID(i)))
		}
	}
	for key := range p.count {
		var i int
		if _, err := fmt.Sscanf(key, "order-placed/o-%04d", &i); err != nil || i < 1 || i > n {
			t.Errorf("the provider was asked to charge with the key %q, not an order's event id", key)
		}
	}
}

func (p *provider) hold() {
	p.mu.Lock()
	p.gate = make(chan struct{})
	p.mu.Unlock()
}

// held returns the keys of the charges waiting.
func (p *provider) held() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var keys []string
	for k := range p.waiting {
		keys = append(keys, k)
	}
	return keys
}

func (p *provider) release() {
	p.mu.Lock()
	close(p.gate)
	p.gate = nil
	p.waiting = map[string]bool{}
	p.mu.Unlock()
}

// postgresSchema makes a schema for one run in the test PostgreSQL,
// dropped when the test ends, and returns the URL that selects it.
func postgresSchema(t *testing.T) string {
	t.Helper()
	base := testenv.RequirePostgres(t)
	schema := "ferry_service_" + randomHex()
	conn, err := pgx.Connect(t.Context(), base)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(t.Context(), "CREATE SCHEMA "+schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, base)
		if err != nil {
			t.Errorf("drop schema %s: %v", schema, err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE"); err != nil {
			t.Errorf("drop schema %s: %v", schema, err)
		}
	})
	u, err := url.Parse(base)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	return u.String()
}

func randomHex() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// Bad configuration names the variable that is wrong.
func TestConfigNamesTheVariableThatIsWrong(t *testing.T) {
	good := map[string]string{"FERRY_BROKER_URL": "mem://", "FERRY_SOURCE": "orders", "FERRY_DLQ": "orders-dlq"}
	for _, c := range []struct{ name, set, value string }{
		{"FERRY_BROKER_URL", "FERRY_BROKER_URL", ""},
		{"FERRY_SOURCE", "FERRY_SOURCE", " "},
		{"FERRY_DLQ", "FERRY_DLQ", ""},
		{"FERRY_HTTP_ADDR", "FERRY_HTTP_ADDR", "8080"},
		{"FERRY_DB_URL", "FERRY_DB_URL", "mysql://x"},
		{"FERRY_PAYMENTS_URL", "FERRY_PAYMENTS_URL", "ftp://x"},
	} {
		env := maps.Clone(good)
		env[c.set] = c.value
		_, err := configFrom(func(k string) string { return env[k] })
		if err == nil || !strings.HasPrefix(err.Error(), c.name+" ") {
			t.Errorf("%s=%q: error %v, want one naming %s", c.set, c.value, err, c.name)
		}
	}
	cfg, err := configFrom(func(k string) string { return good[k] })
	if err != nil {
		t.Fatal(err)
	}
	if cfg.HTTPAddr != "127.0.0.1:8080" || cfg.Destination != "orders" || cfg.Consumer != "billing" || cfg.DBURL != "" {
		t.Errorf("defaults: %+v", cfg)
	}
}
