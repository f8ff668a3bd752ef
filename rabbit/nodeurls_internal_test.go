package rabbit

import (
	"slices"
	"testing"

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
