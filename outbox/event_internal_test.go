package outbox

import (
	"testing"

	"github.com/ferrymq/ferry/outbox/internal/row"
)

func TestConstantsMatchTheWriters(t *testing.T) {
	if EventIDHeader != row.EventIDHeader {
		t.Fatalf("outbox.EventIDHeader %q, row.EventIDHeader %q", EventIDHeader, row.EventIDHeader)
	}
	if Lanes != row.Lanes {
		t.Fatalf("outbox.Lanes %d, row.Lanes %d", Lanes, row.Lanes)
	}
}
