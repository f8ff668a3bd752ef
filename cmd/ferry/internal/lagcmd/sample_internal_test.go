package lagcmd

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/kafka"
)

// peekFails is a PeekGroup that fails with err: how ferry lag takes a
// PeekGroup error is the command's behaviour, not Kafka's (kafka's own
// tests show when it stops short).
func peekFails(err error) func(context.Context, string, string, int) ([]consumer.Message, error) {
	return func(context.Context, string, string, int) ([]consumer.Message, error) { return nil, err }
}

// TestBacklogAgeOfAShortPeekIsUnknown: a Peek that stopped short (an open
// transaction, a stalled broker) leaves the backlog's age unknown for that
// sample, and the lag goes on; any other Peek error ends the sample.
func TestBacklogAgeOfAShortPeekIsUnknown(t *testing.T) {
	lanes := map[string]int64{"0": 3}
	short := &sampler{peekGroup: peekFails(fmt.Errorf("kafka: peek \"t\": partition 0 at offset 2, end 3: %w", kafka.ErrPeekShort)), source: "t"}
	if age, err := short.oldestKafka(context.Background(), lanes); err != nil || age != 0 {
		t.Errorf("short Peek: age %v, err %v; want an unknown age (0) and no error", age, err)
	}
	other := errors.New("broken")
	failing := &sampler{peekGroup: peekFails(other), source: "t"}
	if _, err := failing.oldestKafka(context.Background(), lanes); !errors.Is(err, other) {
		t.Errorf("failing Peek: err %v, want it passed on", err)
	}
}
