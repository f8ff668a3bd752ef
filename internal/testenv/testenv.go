// Package testenv tells tests where the real brokers are and decides what a
// test does when one is not there.
//
// Addresses come from environment variables whose defaults match both ways of
// starting the brokers: integration/brokers.sh (native) and docker-compose.yml.
//
//	FERRY_KAFKA_BROKERS   127.0.0.1:9092 (comma-separated list)
//	FERRY_KAFKA_SASL_BROKERS 127.0.0.1:9094 (the SASL_SSL listener, SCRAM-SHA-512)
//	FERRY_KAFKA_CA        the CA of that listener (default: kafka/tls/ca.pem in
//	                      FERRY_BROKERS_DIR, or in .brokers at the repository root)
//	FERRY_AMQP_URL        amqp://guest:guest@127.0.0.1:5672/
//	FERRY_SQS_ENDPOINT    http://127.0.0.1:9324
//	FERRY_SQS_REGION      us-east-1
//	FERRY_POSTGRES_URL    postgres://ferry:ferry@127.0.0.1:5432/ferry?sslmode=disable
//	FERRY_REDIS_ADDR      127.0.0.1:6379
//
// A test asks for a broker with one of the Require functions. When the broker
// does not answer, the test is skipped with a message naming the command that
// starts the brokers, unless FERRY_REQUIRE_BROKERS=1 (as in CI), in which case
// the test fails.
package testenv

import (
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry/internal/brokerkind"
)

// Names of the environment variables read by this package.
const (
	// EnvRequireBrokers, set to 1 (or true), turns an unreachable broker
	// from a skipped test into a failed one.
	EnvRequireBrokers = "FERRY_REQUIRE_BROKERS"
	// EnvKafkaBrokers is a comma-separated list of Kafka bootstrap addresses.
	EnvKafkaBrokers = "FERRY_KAFKA_BROKERS"
	// EnvKafkaSASLBrokers is a comma-separated list of the bootstrap
	// addresses of Kafka's SASL_SSL listener.
	EnvKafkaSASLBrokers = "FERRY_KAFKA_SASL_BROKERS"
	// EnvKafkaCA is the PEM file of the CA that signed the certificate of
	// Kafka's SASL_SSL listener.
	EnvKafkaCA = "FERRY_KAFKA_CA"
	// EnvBrokersDir is the state folder of integration/brokers.sh.
	EnvBrokersDir = "FERRY_BROKERS_DIR"
	// EnvAMQPURL is the AMQP 0-9-1 URL of RabbitMQ.
	EnvAMQPURL = "FERRY_AMQP_URL"
	// EnvSQSEndpoint is the base URL of the SQS-compatible server.
	EnvSQSEndpoint = "FERRY_SQS_ENDPOINT"
	// EnvSQSRegion is the AWS region that SQS clients sign requests for.
	EnvSQSRegion = "FERRY_SQS_REGION"
	// EnvPostgresURL is the PostgreSQL connection URL.
	EnvPostgresURL = "FERRY_POSTGRES_URL"
	// EnvRedisAddr is the host:port of Redis.
	EnvRedisAddr = "FERRY_REDIS_ADDR"
)

// Default addresses, shared by integration/brokers.sh and docker-compose.yml.
const (
	// DefaultKafkaBrokers is the default of FERRY_KAFKA_BROKERS.
	DefaultKafkaBrokers = "127.0.0.1:9092"
	// DefaultKafkaSASLBrokers is the default of FERRY_KAFKA_SASL_BROKERS.
	DefaultKafkaSASLBrokers = "127.0.0.1:9094"
	// DefaultAMQPURL is the default of FERRY_AMQP_URL.
	DefaultAMQPURL = "amqp://guest:guest@127.0.0.1:5672/"
	// DefaultSQSEndpoint is the default of FERRY_SQS_ENDPOINT.
	DefaultSQSEndpoint = "http://127.0.0.1:9324"
	// DefaultSQSRegion is the default of FERRY_SQS_REGION.
	DefaultSQSRegion = "us-east-1"
	// DefaultPostgresURL is the default of FERRY_POSTGRES_URL.
	DefaultPostgresURL = "postgres://ferry:ferry@127.0.0.1:5432/ferry?sslmode=disable"
	// DefaultRedisAddr is the default of FERRY_REDIS_ADDR.
	DefaultRedisAddr = "127.0.0.1:6379"
)

// StartCommand is the command that starts the brokers; it is named in the
// message of a skipped or failed test.
const StartCommand = "make brokers (integration/brokers.sh up), or with Docker: docker compose up --wait"

// SQSAccessKey and SQSSecretKey are static credentials for the SQS-compatible
// test server, which accepts any.
const (
	// SQSAccessKey is the access key id test SQS clients sign with.
	SQSAccessKey = "ferry"
	// SQSSecretKey is the secret key test SQS clients sign with.
	SQSSecretKey = "ferry"
)

// KafkaSCRAMUser and KafkaSCRAMPassword are the SCRAM-SHA-512 credentials
// of Kafka's SASL_SSL listener, created by integration/brokers.sh (test
// credentials, not a secret).
const (
	// KafkaSCRAMUser is the SCRAM user of the SASL_SSL listener.
	KafkaSCRAMUser = "ferry"
	// KafkaSCRAMPassword is its password.
	KafkaSCRAMPassword = "ferry-scram-test"
)

// Service names a broker the tests can ask for: the brokers of
// package brokerkind, with their names, and the databases.
type Service string

// The services started by integration/brokers.sh and docker-compose.yml.
const (
	// Kafka is Apache Kafka.
	Kafka Service = brokerkind.Kafka
	// RabbitMQ is RabbitMQ, spoken to over AMQP 0-9-1.
	RabbitMQ Service = brokerkind.RabbitMQ
	// SQS is the SQS-compatible server (ElasticMQ).
	SQS Service = brokerkind.SQS
	// Postgres is PostgreSQL.
	Postgres Service = "postgres"
	// Redis is Redis.
	Redis Service = "redis"
)

// Services lists every service, in the order brokers.sh reports them.
var Services = []Service{RabbitMQ, Kafka, SQS, Postgres, Redis}

func env(name, def string) string {
	if v := strings.TrimSpace(os.Getenv(name)); v != "" {
		return v
	}
	return def
}

// KafkaBrokers returns the Kafka bootstrap addresses (FERRY_KAFKA_BROKERS).
func KafkaBrokers() []string {
	var out []string
	for _, b := range strings.Split(env(EnvKafkaBrokers, DefaultKafkaBrokers), ",") {
		if b = strings.TrimSpace(b); b != "" {
			out = append(out, b)
		}
	}
	if len(out) == 0 {
		out = []string{DefaultKafkaBrokers}
	}
	return out
}

// KafkaSASLBrokers returns the bootstrap addresses of Kafka's SASL_SSL
// listener (FERRY_KAFKA_SASL_BROKERS).
func KafkaSASLBrokers() []string {
	var out []string
	for _, b := range strings.Split(env(EnvKafkaSASLBrokers, DefaultKafkaSASLBrokers), ",") {
		if b = strings.TrimSpace(b); b != "" {
			out = append(out, b)
		}
	}
	if len(out) == 0 {
		out = []string{DefaultKafkaSASLBrokers}
	}
	return out
}

// KafkaCAFile returns the PEM file of the CA of Kafka's SASL_SSL listener:
// FERRY_KAFKA_CA, or kafka/tls/ca.pem in the brokers' state folder
// (FERRY_BROKERS_DIR, by default .brokers at the repository root).
func KafkaCAFile() string {
	if v := env(EnvKafkaCA, ""); v != "" {
		return v
	}
	dir := env(EnvBrokersDir, "")
	if dir == "" {
		_, file, _, ok := runtime.Caller(0)
		if !ok {
			return ""
		}
		dir = filepath.Join(filepath.Dir(file), "..", "..", ".brokers")
	}
	return filepath.Join(dir, "kafka", "tls", "ca.pem")
}

// RequireKafkaSASL requires Kafka's SASL_SSL listener and its CA file, and
// returns the listener's addresses and the CA file.
func RequireKafkaSASL(t testing.TB) (brokers []string, caFile string) {
	t.Helper()
	Require(t, Kafka)
	brokers, caFile = KafkaSASLBrokers(), KafkaCAFile()
	var err error
	if c, derr := net.DialTimeout("tcp", brokers[0], DialTimeout); derr != nil {
		err = derr
	} else {
		c.Close()
		_, err = os.Stat(caFile)
	}
	if err != nil {
		msg := fmt.Sprintf("the Kafka SASL_SSL listener is not usable (%v); start the brokers with %s", err, StartCommand)
		if RequireBrokers() {
			t.Fatalf("%s (%s=1 makes this a failure)", msg, EnvRequireBrokers)
		}
		t.Skipf("%s, or set %s=1 to fail instead of skipping", msg, EnvRequireBrokers)
	}
	return brokers, caFile
}

// AMQPURL returns the RabbitMQ AMQP URL (FERRY_AMQP_URL).
func AMQPURL() string { return env(EnvAMQPURL, DefaultAMQPURL) }

// SQSEndpoint returns the base URL of the SQS-compatible server
// (FERRY_SQS_ENDPOINT).
func SQSEndpoint() string { return env(EnvSQSEndpoint, DefaultSQSEndpoint) }

// SQSRegion returns the region SQS clients should use (FERRY_SQS_REGION).
func SQSRegion() string { return env(EnvSQSRegion, DefaultSQSRegion) }

// PostgresURL returns the PostgreSQL connection URL (FERRY_POSTGRES_URL).
func PostgresURL() string { return env(EnvPostgresURL, DefaultPostgresURL) }

// RedisAddr returns the Redis host:port (FERRY_REDIS_ADDR).
func RedisAddr() string { return env(EnvRedisAddr, DefaultRedisAddr) }

// RequireBrokers reports whether FERRY_REQUIRE_BROKERS asks for an
// unreachable broker to fail the test rather than skip it.
func RequireBrokers() bool {
	switch strings.ToLower(strings.TrimSpace(os.Getenv(EnvRequireBrokers))) {
	case "1", "true", "yes", "on":
		return true
	}
	return false
}

// Addr returns the host:port a TCP dial to service should reach, derived from
// that service's address variable.
func Addr(service Service) (string, error) {
	return addrOf(service, KafkaBrokers()[0], AMQPURL(), SQSEndpoint(), PostgresURL(), RedisAddr())
}

// DefaultAddr returns the host:port of service when no variable is set: where
// integration/brokers.sh and docker-compose.yml publish it.
func DefaultAddr(service Service) (string, error) {
	return addrOf(service, DefaultKafkaBrokers, DefaultAMQPURL, DefaultSQSEndpoint, DefaultPostgresURL, DefaultRedisAddr)
}

func addrOf(service Service, kafka, amqpURL, sqsEndpoint, postgresURL, redis string) (string, error) {
	switch service {
	case Kafka:
		return kafka, nil
	case RabbitMQ:
		return urlHostPort(amqpURL, "5672")
	case SQS:
		return urlHostPort(sqsEndpoint, "80")
	case Postgres:
		return urlHostPort(postgresURL, "5432")
	case Redis:
		return redis, nil
	}
	return "", fmt.Errorf("testenv: unknown service %q", service)
}

func urlHostPort(raw, defPort string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return "", fmt.Errorf("testenv: parse %q: %w", raw, err)
	}
	if u.Host == "" {
		return "", fmt.Errorf("testenv: no host in %q", raw)
	}
	if first, _, several := strings.Cut(u.Host, ","); several {
		// The nodes of a cluster (amqp://u:p@n1:5672,n2:5672/): the
		// first stands for them.
		u.Host = first
	}
	port := u.Port()
	if port == "" {
		port = defPort
		if u.Scheme == "https" || u.Scheme == "amqps" {
			port = map[string]string{"https": "443", "amqps": "5671"}[u.Scheme]
		}
	}
	return net.JoinHostPort(u.Hostname(), port), nil
}

// DialTimeout bounds the reachability check of Require.
var DialTimeout = 2 * time.Second

type probeResult struct {
	addr string
	err  error
}

var (
	probeMu    sync.Mutex
	probeCache = map[string]probeResult{}
)

// Reachable dials service once per process and address (the answer is
// cached) and returns its address and nil if it accepted a TCP connection.
func Reachable(service Service) (string, error) {
	addr, err := Addr(service)
	if err != nil {
		return "", err
	}
	key := string(service) + "|" + addr
	probeMu.Lock()
	defer probeMu.Unlock()
	if r, ok := probeCache[key]; ok {
		return r.addr, r.err
	}
	c, err := net.DialTimeout("tcp", addr, DialTimeout)
	if err == nil {
		c.Close()
	}
	probeCache[key] = probeResult{addr, err}
	return addr, err
}

// Require makes t need service: if the broker does not accept a connection,
// t fails when FERRY_REQUIRE_BROKERS=1 and is skipped otherwise; either way
// the message names the command that starts the brokers.
func Require(t testing.TB, service Service) {
	t.Helper()
	addr, err := Reachable(service)
	if err == nil {
		return
	}
	where := addr
	if where == "" {
		where = "(no address)"
	}
	msg := fmt.Sprintf("%s is not reachable at %s: %v; start the brokers with %s", service, where, err, StartCommand)
	if RequireBrokers() {
		t.Fatalf("%s (%s=1 makes this a failure)", msg, EnvRequireBrokers)
		return
	}
	t.Skipf("%s, or set %s=1 to fail instead of skipping", msg, EnvRequireBrokers)
}

// RequireKafka requires Kafka and returns its bootstrap addresses.
func RequireKafka(t testing.TB) []string {
	t.Helper()
	Require(t, Kafka)
	return KafkaBrokers()
}

// RequireRabbitMQ requires RabbitMQ and returns its AMQP URL.
func RequireRabbitMQ(t testing.TB) string {
	t.Helper()
	Require(t, RabbitMQ)
	return AMQPURL()
}

// RequireSQS requires the SQS-compatible server and returns its endpoint.
func RequireSQS(t testing.TB) string {
	t.Helper()
	Require(t, SQS)
	return SQSEndpoint()
}

// RequirePostgres requires PostgreSQL and returns its connection URL.
func RequirePostgres(t testing.TB) string {
	t.Helper()
	Require(t, Postgres)
	return PostgresURL()
}

// RequireRedis requires Redis and returns its address.
func RequireRedis(t testing.TB) string {
	t.Helper()
	Require(t, Redis)
	return RedisAddr()
}
