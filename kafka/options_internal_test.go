package kafka

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
)

// New connects to nothing, so these need no broker.

func TestNewRefusesInstanceID(t *testing.T) {
	b, err := New([]string{"127.0.0.1:9092"}, WithClientOpts(kgo.InstanceID("static-1")))
	if err == nil {
		b.Close()
		t.Fatal("New accepted kgo.InstanceID: every consumer of the Broker would be one static member")
	}
	var ce *consumer.ConfigError
	if !errors.As(err, &ce) {
		t.Fatalf("New = %v, want a *consumer.ConfigError", err)
	}
}

func TestClientOptsRebalanceTimeoutBoundsRevokeWait(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts []Option
		want time.Duration
	}{
		{"default", nil, DefaultRevokeWait},
		{"kgo", []Option{WithClientOpts(kgo.RebalanceTimeout(8 * time.Second))}, 4 * time.Second},
		{"both", []Option{WithClientOpts(kgo.RebalanceTimeout(8 * time.Second)), WithRebalanceTimeout(30 * time.Second)}, 20 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := New([]string{"127.0.0.1:9092"}, tc.opts...)
			if err != nil {
				t.Fatal(err)
			}
			defer b.Close()
			d, err := b.newDriver("t", "g")
			if err != nil {
				t.Fatal(err)
			}
			if got := d.revokeWait(); got != tc.want {
				t.Errorf("revokeWait = %s, want %s", got, tc.want)
			}
		})
	}
}

func TestWithInstanceIDRefusesWhatKafkaWouldRefuse(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts []Option
	}{
		{"empty", []Option{WithInstanceID("")}},
		{"a character Kafka refuses", []Option{WithInstanceID("pod 0")}},
		{"dot", []Option{WithInstanceID(".")}},
		{"too long", []Option{WithInstanceID(strings.Repeat("x", 250))}},
		{"share group", []Option{WithGroupProtocol(Share), WithInstanceID("pod-0")}},
		{"KIP-848 group", []Option{WithGroupProtocol(NextGen), WithInstanceID("pod-0")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := New([]string{"127.0.0.1:9092"}, tc.opts...)
			if err == nil {
				b.Close()
				t.Fatal("New accepted it")
			}
			var ce *consumer.ConfigError
			if !errors.As(err, &ce) || ce.Field != "InstanceID" {
				t.Fatalf("New = %v, want a *consumer.ConfigError naming InstanceID", err)
			}
		})
	}
	b, err := New([]string{"127.0.0.1:9092"}, WithInstanceID("billing-0.eu_west-1"))
	if err != nil {
		t.Fatalf("New refused a good instance id: %v", err)
	}
	b.Close()
}

// A static member the coordinator fenced ends its Run: the poll's error
// from franz-go (a group session error wrapping FENCED_INSTANCE_ID) and the
// flag fenceHook sets when the group management reports it are fatal and
// match ErrFenced; another management error is neither.
func TestFencedStaticMemberFailsForGood(t *testing.T) {
	b, err := New([]string{"127.0.0.1:9092"}, WithInstanceID("pod-0"), WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	d, err := b.newDriver("orders", "billing")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	err = d.fetchErr(ctx, nil, pollResult{err: &kgo.ErrGroupSession{Err: kerr.FencedInstanceID}})
	if !errors.Is(err, ErrFenced) || !errors.Is(err, kerr.FencedInstanceID) || !driver.IsFatal(err) {
		t.Fatalf("a fenced poll: %v; want a fatal error wrapping ErrFenced and FENCED_INSTANCE_ID", err)
	}

	fenceHook{d}.OnGroupManageError(&kgo.ErrGroupSession{Err: kerr.RebalanceInProgress})
	if d.fenced.Load() {
		t.Fatal("a rebalance in progress was taken for a fence")
	}
	fenceHook{d}.OnGroupManageError(kerr.FencedInstanceID)
	if err := d.fetchErr(ctx, nil, pollResult{}); !errors.Is(err, ErrFenced) || !driver.IsFatal(err) {
		t.Fatalf("a poll after the hook saw the fence: %v; want a fatal error wrapping ErrFenced", err)
	}
}
