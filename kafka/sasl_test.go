package kafka_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/sasl/scram"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
)

// saslBroker connects through the SASL_SSL listener with password, logging
// into buf.
func saslBroker(t *testing.T, password string, buf *syncBuffer) *kafka.Broker {
	t.Helper()
	seeds, caFile := testenv.RequireKafkaSASL(t)
	pem, err := os.ReadFile(caFile)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		t.Fatalf("no certificate in %s", caFile)
	}
	b, err := kafka.New(seeds,
		kafka.WithTLS(&tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}),
		kafka.WithSASL(scram.Auth{User: testenv.KafkaSCRAMUser, Pass: password}.AsSha512Mechanism()),
		kafka.WithLogger(slog.New(slog.NewTextHandler(buf, &slog.HandlerOptions{Level: slog.LevelDebug}))))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return b
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestSASLSSLPublishAndConsume: through the SASL_SSL listener (SCRAM-SHA-512
// over TLS, the broker's certificate verified against its CA), records are
// published and consumed.
func TestSASLSSLPublishAndConsume(t *testing.T) {
	var logs syncBuffer
	b := saslBroker(t, testenv.KafkaSCRAMPassword, &logs)
	topic := newTopic(t, b, "sasl", 2)
	publishKeyed(t, b, topic, 0, 10, 3)
	c, err := b.NewConsumer(t.Context(), topic, consumer.WithName("sasl-"+topic))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	n := 0
	runConsumer(t, c, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		n++
		mu.Unlock()
		return nil
	}))
	testenv.WaitFor(t, 60*time.Second, "10 records over SASL_SSL", func() bool { mu.Lock(); defer mu.Unlock(); return n == 10 })
	if strings.Contains(logs.String(), testenv.KafkaSCRAMPassword) {
		t.Error("the password appears in the logs")
	}
}

// TestWrongPasswordFailsFast: with a wrong password, Publish fails and Run
// returns within seconds with an error that says authentication failed
// (errors.Is ErrAuthentication), and the password is in no error and no
// log line.
func TestWrongPasswordFailsFast(t *testing.T) {
	const wrong = "not-the-password-7f3a"
	var logs syncBuffer
	b := saslBroker(t, wrong, &logs)

	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	err := b.Publish(ctx, "ferry-sasl-any", consumer.Message{Body: []byte("x")})
	took := time.Since(start)
	if !errors.Is(err, kafka.ErrAuthentication) {
		t.Errorf("Publish = %v, want an error matching kafka.ErrAuthentication", err)
	}
	if took > 15*time.Second {
		t.Errorf("Publish took %s to fail, want seconds", took)
	}
	if err != nil && strings.Contains(err.Error(), wrong) {
		t.Errorf("the password appears in Publish's error: %v", err)
	}

	c, err := b.NewConsumer(t.Context(), "ferry-sasl-any", consumer.WithName("sasl-wrong"))
	if err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	done := make(chan error, 1)
	go func() {
		done <- c.Run(ctx, consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }))
	}()
	select {
	case err = <-done:
	case <-time.After(30 * time.Second):
		cancel()
		<-done
		t.Fatal("Run did not return within 30s with a wrong password")
	}
	took = time.Since(start)
	if !errors.Is(err, kafka.ErrAuthentication) {
		t.Errorf("Run = %v, want an error matching kafka.ErrAuthentication", err)
	}
	if took > 15*time.Second {
		t.Errorf("Run took %s to fail, want seconds", took)
	}
	if err != nil && strings.Contains(err.Error(), wrong) {
		t.Errorf("the password appears in Run's error: %v", err)
	}
	if strings.Contains(logs.String(), wrong) {
		t.Error("the password appears in the logs")
	}
	t.Logf("Publish and Run failed with: %v", err)
}
