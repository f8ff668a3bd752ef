package outbox

import (
	"testing"

	"github.com/ferrymq/ferry/outbox/internal/row"
)

func TestEventIDHeaderMatchesTheWriters(t *testing.T) {
	if EventIDHeader != row.EventIDHeader {
		t.Fatalf("outbox.EventIDHeader %q, row.EventIDHeader %q", EventIDHeader, row.EventIDHeader)
	}
}
