package cli_test

import (
	"testing"

	"github.com/ferrymq/ferry/cmd/ferry/internal/cli"
	"github.com/ferrymq/ferry/ferrytest"
)

// TestKindIsFerrytestKind checks that Kind names every broker as
// ferrytest.Kind does, on the real brokers.
func TestKindIsFerrytestKind(t *testing.T) {
	for _, kind := range ferrytest.Kinds {
		t.Run(string(kind), func(t *testing.T) {
			b := ferrytest.Open(t, kind)
			if got := cli.Kind(b.Broker); got != string(kind) {
				t.Errorf("Kind = %q, want %q", got, kind)
			}
		})
	}
}
