package kafka

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
)

// These need no broker: they check how what a client saw is judged. The
// same judgements against the real listeners are in connectivity_test.go.

var seed = kgo.BrokerMetadata{NodeID: -1, Host: "127.0.0.1", Port: 1}

// A failure is the link down only once no broker answered for failGrace;
// a broker answering ends it; a refusal is down at once.
func TestLinkDownAfterGraceUntilABrokerAnswers(t *testing.T) {
	var l link
	refused := errors.New("connection refused")
	l.OnBrokerConnect(seed, 0, nil, refused)
	if _, err := l.down(); err != nil {
		t.Fatalf("down at once after one failure: %v", err)
	}
	if addr, err := l.last(); addr != "127.0.0.1:1" || err != refused {
		t.Errorf("last = %s, %v", addr, err)
	}
	l.mu.Lock()
	l.failFrom = time.Now().Add(-failGrace)
	l.mu.Unlock()
	if addr, err := l.down(); addr != "127.0.0.1:1" || err != refused {
		t.Errorf("down after the grace = %s, %v; want the failure", addr, err)
	}
	l.OnBrokerE2E(seed, 3, kgo.BrokerE2E{})
	if _, err := l.down(); err != nil {
		t.Errorf("down after a broker answered: %v", err)
	}
	if !l.everAnswered() {
		t.Error("everAnswered = false after an answer")
	}

	// The client's own doing is no failure.
	l.OnBrokerE2E(seed, 1, kgo.BrokerE2E{ReadErr: context.Canceled})
	l.OnBrokerE2E(seed, 1, kgo.BrokerE2E{ReadErr: kgo.ErrClientClosed})
	if _, err := l.last(); err != nil {
		t.Errorf("a cancelled request or a closed client counted as a failure: %v", err)
	}

	var m link
	m.OnBrokerConnect(seed, 0, nil, kerr.SaslAuthenticationFailed)
	if _, err := m.down(); !errors.Is(err, kerr.SaslAuthenticationFailed) {
		t.Errorf("a refused login is not down at once: %v", err)
	}
}

// Refusals (a TLS/plaintext mismatch, authentication, authorization) wrap
// consumer.ErrRefused, and ErrAuthentication for a login; other failures
// are ErrUnreachable. A mismatch met after the client got through is a
// dropped connection, not a refusal.
func TestRefusalsAreToldFromOutages(t *testing.T) {
	mm := &mismatchError{addr: "127.0.0.1:9092", clientTLS: true, cause: io.EOF}
	for _, tc := range []struct {
		err  error
		auth bool
	}{
		{fmt.Errorf("unable to dial: %w", mm), false},
		{kerr.SaslAuthenticationFailed, true},
		{tls.AlertError(42), true},
		{kerr.TopicAuthorizationFailed, false},
		{kerr.GroupAuthorizationFailed, false},
	} {
		if !refusedBy(nil, tc.err) {
			t.Errorf("%v: not a refusal", tc.err)
			continue
		}
		err := refused("127.0.0.1:9092", tc.err)
		if !errors.Is(err, consumer.ErrRefused) || errors.Is(err, ErrAuthentication) != tc.auth || !errors.Is(err, tc.err) {
			t.Errorf("refused(%v) = %v: ErrRefused %v, ErrAuthentication %v (want %v)", tc.err, err,
				errors.Is(err, consumer.ErrRefused), errors.Is(err, ErrAuthentication), tc.auth)
		}
	}
	for _, err := range []error{io.EOF, errors.New("connection refused"), kerr.CoordinatorNotAvailable} {
		if isRefusal(err) {
			t.Errorf("%v taken for a refusal", err)
		}
	}
	var l link
	l.answered()
	if refusedBy(&l, fmt.Errorf("unable to dial: %w", mm)) {
		t.Error("a mismatch after the client got through is taken for a refusal")
	}
	if !refusedBy(&l, kerr.SaslAuthenticationFailed) {
		t.Error("a refused login after the client got through is not a refusal")
	}
}

// A plaintext connection whose first bytes are a TLS alert record is a
// mismatch; a Kafka response is read as it is.
func TestPlaintextConnTellsATLSListener(t *testing.T) {
	for _, tc := range []struct {
		name     string
		sent     []byte
		mismatch bool
	}{
		{"TLS alert", []byte{0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x50}, true},
		{"Kafka response", []byte{0x00, 0x00, 0x00, 0x08, 0, 0, 0, 1, 0, 0, 0, 0}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client, server := net.Pipe()
			defer client.Close()
			go func() { _, _ = server.Write(tc.sent); _ = server.Close() }()
			c := &watchedConn{Conn: client, addr: "127.0.0.1:9094", plain: true}
			buf := make([]byte, 64)
			n, err := c.Read(buf)
			var mm *mismatchError
			if got := errors.As(err, &mm); got != tc.mismatch {
				t.Fatalf("Read = %d, %v; mismatch %v, want %v", n, err, got, tc.mismatch)
			}
			if tc.mismatch && (mm.clientTLS || n != 0) {
				t.Errorf("Read = %d, %+v", n, mm)
			}
		})
	}
}

// The Broker dials itself unless the user's options bring a dialer:
// their TLS config wins; their kgo.Dialer with WithTLS is refused (it
// would dial in plaintext); kgo.DialTimeout is honoured.
func TestBrokerDialsUnlessTheUserDoes(t *testing.T) {
	b, err := New([]string{"127.0.0.1:9092"}, WithClientOpts(kgo.DialTimeout(3*time.Second)))
	if err != nil {
		t.Fatal(err)
	}
	if b.cfg.dial == nil || b.cfg.dial.timeout != 3*time.Second || b.cfg.dial.tls != nil {
		t.Errorf("dialer %+v, want the Broker's, plaintext, 3s", b.cfg.dial)
	}
	b.Close()

	own := &tls.Config{MinVersion: tls.VersionTLS12}
	b, err = New([]string{"127.0.0.1:9092"}, WithTLS(&tls.Config{}), WithClientOpts(kgo.DialTLSConfig(own)))
	if err != nil {
		t.Fatal(err)
	}
	if b.cfg.dial != nil {
		t.Error("the Broker dials although the user's options bring a TLS config")
	}
	b.Close()

	dial := func(ctx context.Context, network, host string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, network, host)
	}
	_, err = New([]string{"127.0.0.1:9092"}, WithTLS(&tls.Config{}), WithClientOpts(kgo.Dialer(dial)))
	var ce *consumer.ConfigError
	if !errors.As(err, &ce) {
		t.Errorf("New(WithTLS, kgo.Dialer) = %v, want a *consumer.ConfigError", err)
	}
}
