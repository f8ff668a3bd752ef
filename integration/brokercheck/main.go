// Command brokercheck waits until each test broker answers a real client
// operation and prints one line per broker: name, address, version, and
// "ready" or why not. integration/brokers.sh runs it for `up` and `status`.
//
// Usage:
//
//	brokercheck [-wait 120s] [-version kafka=4.4.0] [-pid kafka=1234] [-kafka-ca ca.pem] [service ...]
//
// Addresses come from the same environment variables as the tests (see
// internal/testenv). With -pid, the wait for a service ends as soon as its
// process is gone. With -kafka-ca, Kafka is ready only once its SASL_SSL
// listener authenticates the test SCRAM user over TLS trusting that CA; the
// checker creates the user through the admin API first when it is missing
// (a log dir formatted before the listener existed). Kafka is ready once
// share groups are on (share.version; the checker turns them on in a log
// dir formatted by a Kafka older than 4.4, which left them off). It exits
// 1 if any broker is not ready in time.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"github.com/twmb/franz-go/pkg/sasl/scram"

	"github.com/ferrymq/ferry/internal/testenv"
)

type versions map[string]string

func (v versions) String() string { return fmt.Sprint(map[string]string(v)) }

func (v versions) Set(s string) error {
	name, ver, ok := strings.Cut(s, "=")
	if !ok {
		return errors.New("want service=version")
	}
	v[name] = ver
	return nil
}

func main() {
	wait := flag.Duration("wait", 0, "keep trying each broker for this long (0: one attempt)")
	vers := versions{}
	flag.Var(vers, "version", "service=version to print instead of the detected version (repeatable)")
	pids := versions{}
	flag.Var(pids, "pid", "service=pid: stop waiting for service once this process is gone (repeatable)")
	flag.StringVar(&kafkaCA, "kafka-ca", "", "PEM file of the CA of Kafka's SASL_SSL listener: check that listener too")
	flag.Parse()
	redis.SetLogger(quietLogger{})

	services := testenv.Services
	if flag.NArg() > 0 {
		services = nil
		for _, a := range flag.Args() {
			services = append(services, testenv.Service(a))
		}
	}

	type result struct {
		addr, version string
		err           error
	}
	results := make([]result, len(services))
	var wg sync.WaitGroup
	deadline := time.Now().Add(*wait)
	for i, s := range services {
		wg.Add(1)
		go func() {
			defer wg.Done()
			addr, _ := testenv.Addr(s)
			var ver string
			var err error
			for {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				ver, err = check(ctx, s)
				cancel()
				if err == nil || time.Now().After(deadline) {
					break
				}
				if p := pids[string(s)]; p != "" && !alive(p) {
					err = fmt.Errorf("its process (pid %s) exited: %w", p, err)
					break
				}
				time.Sleep(300 * time.Millisecond)
			}
			if v := vers[string(s)]; v != "" && err == nil {
				ver = v
			}
			results[i] = result{addr, ver, err}
		}()
	}
	wg.Wait()
	failed := false
	for i, r := range results {
		if r.err == nil {
			fmt.Printf("%-9s %-22s %-18s ready\n", services[i], r.addr, r.version)
		} else {
			fmt.Printf("%-9s %-22s %-18s NOT READY: %v\n", services[i], r.addr, "-", r.err)
			failed = true
		}
	}
	if failed {
		os.Exit(1)
	}
}

// alive reports whether process pid exists.
func alive(pid string) bool {
	n, err := strconv.Atoi(pid)
	if err != nil || n <= 0 {
		return false
	}
	return syscall.Kill(n, 0) == nil
}

// quietLogger drops go-redis's own logging of failed dials.
type quietLogger struct{}

func (quietLogger) Printf(context.Context, string, ...interface{}) {}

func check(ctx context.Context, s testenv.Service) (string, error) {
	switch s {
	case testenv.Kafka:
		return checkKafka(ctx)
	case testenv.RabbitMQ:
		return checkRabbitMQ(ctx)
	case testenv.SQS:
		return checkSQS(ctx)
	case testenv.Postgres:
		return checkPostgres(ctx)
	case testenv.Redis:
		return checkRedis(ctx)
	}
	return "", fmt.Errorf("unknown service %q", s)
}

// kafkaCA is the -kafka-ca flag.
var kafkaCA string

// checkKafka asks for the API versions and the cluster metadata, and wants a
// broker registered with the controller; with -kafka-ca, it also makes sure
// the SCRAM user exists and authenticates through the SASL_SSL listener.
func checkKafka(ctx context.Context) (string, error) {
	ver, err := checkKafkaPlain(ctx)
	if err != nil || kafkaCA == "" {
		return ver, err
	}
	if err := ensureKafkaSCRAM(ctx); err != nil {
		return "", fmt.Errorf("SCRAM user %s: %w", testenv.KafkaSCRAMUser, err)
	}
	if err := checkKafkaSASL(ctx); err != nil {
		return "", fmt.Errorf("SASL_SSL listener %s: %w", testenv.KafkaSASLBrokers()[0], err)
	}
	return ver, nil
}

// ensureKafkaSCRAM creates the test SCRAM-SHA-512 user unless it exists.
func ensureKafkaSCRAM(ctx context.Context) error {
	cl, err := kgo.NewClient(kgo.SeedBrokers(testenv.KafkaBrokers()...), kgo.DialTimeout(2*time.Second))
	if err != nil {
		return err
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	users, err := adm.DescribeUserSCRAMs(ctx, testenv.KafkaSCRAMUser)
	if err == nil {
		if u, ok := users[testenv.KafkaSCRAMUser]; ok && u.Err == nil {
			for _, c := range u.CredInfos {
				if c.Mechanism == kadm.ScramSha512 {
					return nil
				}
			}
		}
	}
	res, err := adm.AlterUserSCRAMs(ctx, nil, []kadm.UpsertSCRAM{{
		User: testenv.KafkaSCRAMUser, Mechanism: kadm.ScramSha512, Iterations: 8192,
		Password: testenv.KafkaSCRAMPassword,
	}})
	if err != nil {
		return err
	}
	return res.Error()
}

// checkKafkaSASL authenticates through the SASL_SSL listener and asks for
// the cluster metadata.
func checkKafkaSASL(ctx context.Context) error {
	pem, err := os.ReadFile(kafkaCA)
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return fmt.Errorf("no certificate in %s", kafkaCA)
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(testenv.KafkaSASLBrokers()...), kgo.DialTimeout(2*time.Second),
		kgo.DialTLSConfig(&tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}),
		kgo.SASL(scram.Auth{User: testenv.KafkaSCRAMUser, Pass: testenv.KafkaSCRAMPassword}.AsSha512Mechanism()))
	if err != nil {
		return err
	}
	defer cl.Close()
	_, err = kadm.NewClient(cl).BrokerMetadata(ctx)
	return err
}

func checkKafkaPlain(ctx context.Context) (string, error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(testenv.KafkaBrokers()...), kgo.DialTimeout(2*time.Second))
	if err != nil {
		return "", err
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	md, err := adm.BrokerMetadata(ctx)
	if err != nil {
		return "", err
	}
	if len(md.Brokers) == 0 || md.Controller < 0 {
		return "", errors.New("no broker registered with a controller yet")
	}
	api, err := adm.ApiVersions(ctx)
	if err != nil {
		return "", err
	}
	answers := api.Sorted()
	if len(answers) == 0 {
		return "", errors.New("no ApiVersions answer")
	}
	// Every broker answered alike (one node here); the first says the version.
	if answers[0].Err != nil {
		return "", answers[0].Err
	}
	if err := ensureShareGroups(ctx, adm, answers[0].Raw()); err != nil {
		return "", fmt.Errorf("share groups: %w", err)
	}
	return answers[0].VersionGuess(), nil
}

// ensureShareGroups turns share groups (KIP-932) on where the broker can
// run them and they are off: a log dir Kafka 4.4 formats has share.version
// 2 already; one formatted by an older Kafka has none.
func ensureShareGroups(ctx context.Context, adm *kadm.Client, api *kmsg.ApiVersionsResponse) error {
	supported := int16(0)
	for _, f := range api.SupportedFeatures {
		if f.Name == "share.version" {
			supported = f.MaxVersion
		}
	}
	if supported < 1 {
		return nil // a Kafka before 4.x: its share group tests fail, saying so
	}
	for _, f := range api.FinalizedFeatures {
		if f.Name == "share.version" && f.MaxVersionLevel >= 1 {
			return nil
		}
	}
	res, err := adm.UpdateFeatures(ctx, false, kadm.FeatureUpdate{Feature: "share.version", MaxVersionLevel: supported, UpgradeType: 1})
	if err != nil {
		return err
	}
	return res.Error()
}

// checkRabbitMQ opens an AMQP connection and a channel.
func checkRabbitMQ(ctx context.Context) (string, error) {
	conn, err := amqp.DialConfig(testenv.AMQPURL(), amqp.Config{Dial: amqp.DefaultDial(2 * time.Second)})
	if err != nil {
		return "", err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return "", err
	}
	ch.Close()
	v, _ := conn.Properties["version"].(string)
	return v, nil
}

// checkSQS lists the queues over the AWS JSON protocol.
func checkSQS(ctx context.Context) (string, error) {
	c := sqs.New(sqs.Options{
		Region:           testenv.SQSRegion(),
		BaseEndpoint:     aws.String(testenv.SQSEndpoint()),
		Credentials:      credentials.NewStaticCredentialsProvider(testenv.SQSAccessKey, testenv.SQSSecretKey, ""),
		RetryMaxAttempts: 1,
	})
	if _, err := c.ListQueues(ctx, &sqs.ListQueuesInput{}); err != nil {
		return "", err
	}
	return "sqs-json", nil
}

// checkPostgres logs in and runs a query.
func checkPostgres(ctx context.Context) (string, error) {
	conn, err := pgx.Connect(ctx, testenv.PostgresURL())
	if err != nil {
		return "", err
	}
	defer conn.Close(context.Background())
	var v string
	if err := conn.QueryRow(ctx, "select current_setting('server_version')").Scan(&v); err != nil {
		return "", err
	}
	if i := strings.IndexByte(v, ' '); i > 0 {
		v = v[:i]
	}
	return v, nil
}

// checkRedis pings and reads the server version.
func checkRedis(ctx context.Context) (string, error) {
	c := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr(), DialTimeout: 2 * time.Second, MaxRetries: -1})
	defer c.Close()
	if err := c.Ping(ctx).Err(); err != nil {
		return "", err
	}
	info, err := c.Info(ctx, "server").Result()
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "redis_version:"); ok {
			return v, nil
		}
	}
	return "?", nil
}
