package rabbit

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
)

func TestNodeURLsSplitsAListOfNodes(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []string
		err  bool
	}{
		{in: "amqp://u:p@h1:5672/v", want: []string{"amqp://u:p@h1:5672/v"}},
		{in: "amqp://u:p@h1:5672,h2,h3:5673/v?x=1",
			want: []string{"amqp://u:p@h1:5672/v?x=1", "amqp://u:p@h2/v?x=1", "amqp://u:p@h3:5673/v?x=1"}},
		{in: "amqps://h1,h2", want: []string{"amqps://h1", "amqps://h2"}},
		{in: "amqp://u:p@[::1]:5672,h2:5672/", want: []string{"amqp://u:p@[::1]:5672/", "amqp://u:p@h2:5672/"}},
		{in: "amqp://u:p@h1,,h2/", err: true},
	} {
		got, err := nodeURLs(tc.in)
		if (err != nil) != tc.err || !slices.Equal(got, tc.want) {
			t.Errorf("nodeURLs(%q) = %q, %v; want %q (error %v)", tc.in, got, err, tc.want, tc.err)
		}
	}
}

// TestOnlyFerryRecovers: the connections a Broker dials have amqp091-go's
// own connection and topology recovery off, so a lost connection is
// recovered once, by the Broker, and not also by the client library
// (which would declare the topology and open consumers a second time).
func TestOnlyFerryRecovers(t *testing.T) {
	b, err := Dial(testenv.RequireRabbitMQ(t))
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	for _, m := range []*connMgr{b.pubConn, b.consConn} {
		conn, err := m.get(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if conn.IsRecoveryEnabled() || conn.IsTopologyRecoveryEnabled() {
			t.Errorf("the %s connection has amqp091-go's recovery on", m.role)
		}
	}
}

// TestNodesFailedDoesNotDependOnTheOrder: what a dial of several nodes
// returns, fatal or retried, is the same whichever node was tried last.
func TestNodesFailedDoesNotDependOnTheOrder(t *testing.T) {
	unreachable := fmt.Errorf("connect: %w: %w", consumer.ErrUnreachable, errors.New("connection refused"))
	badUser := fmt.Errorf("connect: %w: %w", consumer.ErrRefused, &amqp.Error{Code: amqp.AccessRefused, Reason: "ACCESS_REFUSED"})
	badCreds := fmt.Errorf("connect: %w: %w", consumer.ErrRefused, amqp.ErrCredentials)
	badCert := fmt.Errorf("connect: %w: %w", consumer.ErrRefused, errors.New("x509: certificate is valid for another node"))
	for _, tc := range []struct {
		name string
		errs []error
		want error
	}{
		{"the user refused, another node down", []error{unreachable, badUser}, consumer.ErrRefused},
		{"bad credentials, another node down", []error{badCreds, unreachable}, consumer.ErrRefused},
		{"one node's certificate, another node down", []error{badCert, unreachable}, consumer.ErrUnreachable},
		{"every node's certificate", []error{badCert, badCert}, consumer.ErrRefused},
		{"every node down", []error{unreachable, unreachable}, consumer.ErrUnreachable},
	} {
		for _, errs := range [][]error{tc.errs, {tc.errs[1], tc.errs[0]}} {
			lines := []string{"a:1: " + errs[0].Error(), "b:2: " + errs[1].Error()}
			err := nodesFailed(errs, lines)
			other := consumer.ErrUnreachable
			if tc.want == consumer.ErrUnreachable {
				other = consumer.ErrRefused
			}
			if !errors.Is(err, tc.want) || errors.Is(err, other) {
				t.Errorf("%s, order %v: %v, want %v and not %v", tc.name, errs, err, tc.want, other)
			}
			if !strings.Contains(err.Error(), "a:1: ") || !strings.Contains(err.Error(), "b:2: ") {
				t.Errorf("%s: %v does not name every node's reason", tc.name, err)
			}
		}
	}
}
