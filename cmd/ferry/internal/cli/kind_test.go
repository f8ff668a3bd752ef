package cli_test

import (
	"testing"

	"github.com/ferrymq/ferry/cmd/ferry/internal/cli"
	"github.com/ferrymq/ferry/ferrytest"
)

// TestKindIsFerrytestKind checks that Kind names every broker as
// ferrytest.Kind does, on the real brokers (Kafka's share groups are Kafka
// to the command).
func TestKindIsFerrytestKind(t *testing.T) {
	for _, kind := range ferrytest.Kinds {
		t.Run(string(kind), func(t *testing.T) {
			b := ferrytest.Open(t, kind)
			want := string(kind)
			if kind == ferrytest.KafkaShare {
				want = string(ferrytest.Kafka) // the command's kafka, with group_protocol=share
			}
			if got := cli.Kind(b.Broker); got != want {
				t.Errorf("Kind = %q, want %q", got, want)
			}
		})
	}
}
