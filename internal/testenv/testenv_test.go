package testenv

import (
	"fmt"
	"net"
	"regexp"
	"strings"
	"testing"
)

func TestDefaults(t *testing.T) {
	for _, name := range []string{EnvKafkaBrokers, EnvAMQPURL, EnvSQSEndpoint, EnvSQSRegion, EnvPostgresURL, EnvRedisAddr} {
		t.Setenv(name, "")
	}
	if got := KafkaBrokers(); len(got) != 1 || got[0] != "127.0.0.1:9092" {
		t.Errorf("KafkaBrokers() = %q", got)
	}
	checks := map[string]string{
		AMQPURL():     "amqp://guest:guest@127.0.0.1:5672/",
		SQSEndpoint(): "http://127.0.0.1:9324",
		SQSRegion():   "us-east-1",
		PostgresURL(): "postgres://ferry:ferry@127.0.0.1:5432/ferry?sslmode=disable",
		RedisAddr():   "127.0.0.1:6379",
	}
	for got, want := range checks {
		if got != want {
			t.Errorf("got %q, want %q", got, want)
		}
	}
	wantAddr := map[Service]string{
		Kafka: "127.0.0.1:9092", RabbitMQ: "127.0.0.1:5672", SQS: "127.0.0.1:9324",
		Postgres: "127.0.0.1:5432", Redis: "127.0.0.1:6379",
	}
	for _, s := range Services {
		got, err := Addr(s)
		if err != nil || got != wantAddr[s] {
			t.Errorf("Addr(%s) = %q, %v; want %q", s, got, err, wantAddr[s])
		}
	}
}

func TestEnvOverride(t *testing.T) {
	t.Setenv(EnvKafkaBrokers, " k1:1, k2:2 ,,")
	t.Setenv(EnvAMQPURL, "amqp://u:p@rabbit/vh")
	t.Setenv(EnvSQSEndpoint, "https://sqs.example")
	t.Setenv(EnvPostgresURL, "postgres://a:b@db:6543/x")
	t.Setenv(EnvRedisAddr, "cache:7000")
	if got := KafkaBrokers(); strings.Join(got, "|") != "k1:1|k2:2" {
		t.Errorf("KafkaBrokers() = %q", got)
	}
	wantAddr := map[Service]string{
		Kafka: "k1:1", RabbitMQ: "rabbit:5672", SQS: "sqs.example:443",
		Postgres: "db:6543", Redis: "cache:7000",
	}
	for _, s := range Services {
		got, err := Addr(s)
		if err != nil || got != wantAddr[s] {
			t.Errorf("Addr(%s) = %q, %v; want %q", s, got, err, wantAddr[s])
		}
	}
	if _, err := Addr("nope"); err == nil {
		t.Error("Addr of an unknown service: no error")
	}
	// A cluster's nodes: the first stands for them.
	t.Setenv(EnvAMQPURL, "amqp://u:p@r1:5691,r2:5692,r3:5693/")
	if got, err := Addr(RabbitMQ); err != nil || got != "r1:5691" {
		t.Errorf("Addr(rabbitmq) of a node list = %q, %v; want r1:5691", got, err)
	}
}

func TestRequireBrokers(t *testing.T) {
	for v, want := range map[string]bool{"": false, "0": false, "1": true, "true": true, "no": false} {
		t.Setenv(EnvRequireBrokers, v)
		if got := RequireBrokers(); got != want {
			t.Errorf("%s=%q: RequireBrokers() = %v", EnvRequireBrokers, v, got)
		}
	}
}

// recorder stands in for a testing.TB to see whether Require skips or fails.
type recorder struct {
	testing.TB
	skipped, failed string
}

func (r *recorder) Helper()                           {}
func (r *recorder) Skipf(format string, args ...any)  { r.skipped = fmt.Sprintf(format, args...) }
func (r *recorder) Fatalf(format string, args ...any) { r.failed = fmt.Sprintf(format, args...) }

func closedPort(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

func TestRequireUnreachable(t *testing.T) {
	t.Setenv(EnvRedisAddr, closedPort(t))

	t.Setenv(EnvRequireBrokers, "")
	r := &recorder{TB: t}
	Require(r, Redis)
	if r.failed != "" || !strings.Contains(r.skipped, "integration/brokers.sh up") {
		t.Errorf("without %s: skipped %q, failed %q", EnvRequireBrokers, r.skipped, r.failed)
	}

	t.Setenv(EnvRequireBrokers, "1")
	r = &recorder{TB: t}
	Require(r, Redis)
	if r.skipped != "" || !strings.Contains(r.failed, "make brokers") {
		t.Errorf("with %s=1: skipped %q, failed %q", EnvRequireBrokers, r.skipped, r.failed)
	}
}

func TestRequireReachable(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	t.Setenv(EnvRedisAddr, l.Addr().String())
	r := &recorder{TB: t}
	if got := RequireRedis(r); got != l.Addr().String() {
		t.Errorf("RequireRedis() = %q", got)
	}
	if r.skipped != "" || r.failed != "" {
		t.Errorf("reachable: skipped %q, failed %q", r.skipped, r.failed)
	}
}

func TestUniqueName(t *testing.T) {
	valid := regexp.MustCompile(`^ferry-[a-z0-9]+(-[a-z0-9]+)*$`)
	seen := map[string]bool{}
	for _, prefix := range []string{"", "orders", "Test/Some Thing_äö", strings.Repeat("x", 200), "---"} {
		for i := 0; i < 50; i++ {
			n := UniqueName(t, prefix)
			if !valid.MatchString(n) || len(n) > 60 {
				t.Fatalf("UniqueName(%q) = %q: not a valid name", prefix, n)
			}
			if seen[n] {
				t.Fatalf("UniqueName(%q) = %q twice", prefix, n)
			}
			seen[n] = true
		}
	}
	if n := UniqueName(t, ""); !strings.HasPrefix(n, "ferry-testuniquename-") {
		t.Errorf("UniqueName with the test's name = %q", n)
	}
}
