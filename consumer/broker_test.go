package consumer_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/memory"
)

// recordingOpener opens memory drivers and remembers the configs it was
// asked for.
type recordingOpener struct {
	b    *memory.Broker
	cfgs []driver.Config
}

func (o *recordingOpener) Driver(ctx context.Context, source string, cfg driver.Config) (driver.Driver, error) {
	o.cfgs = append(o.cfgs, cfg)
	return o.b.Driver(ctx, source, cfg)
}

// NewOn opens the driver with the loop's resolved config: the name only
// when WithName gave one (Kafka needs to tell a default from a choice),
// and the in-flight bound after its default was applied; a bad option
// opens no driver at all.
func TestNewOnOpensTheDriverWithTheLoopsConfig(t *testing.T) {
	b, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	o := &recordingOpener{b: b}

	if _, err := consumer.NewOn(t.Context(), o, "q", consumer.WithConcurrency(3)); err != nil {
		t.Fatal(err)
	}
	if _, err := consumer.NewOn(t.Context(), o, "q", consumer.WithName("billing"), consumer.WithMaxInFlight(50)); err != nil {
		t.Fatal(err)
	}
	want := []driver.Config{{Name: "", MaxInFlight: 12}, {Name: "billing", MaxInFlight: 50}}
	if len(o.cfgs) != len(want) || o.cfgs[0] != want[0] || o.cfgs[1] != want[1] {
		t.Errorf("drivers opened with %+v, want %+v", o.cfgs, want)
	}

	_, err = consumer.NewOn(t.Context(), o, "q", consumer.WithConcurrency(0))
	if !errors.Is(err, consumer.ErrInvalidConfig) {
		t.Errorf("NewOn with a bad option = %v, want a ConfigError", err)
	}
	if len(o.cfgs) != 2 {
		t.Errorf("a bad option opened a driver: %d opened, want 2", len(o.cfgs))
	}
	if _, err := consumer.NewOn(t.Context(), nil, "q"); !errors.Is(err, consumer.ErrInvalidConfig) {
		t.Errorf("NewOn(nil) = %v, want a ConfigError", err)
	}
}

// Every adapter's Broker is a consumer.Broker: the memory broker, here, is
// used through the interface alone.
func TestTheMemoryBrokerIsABroker(t *testing.T) {
	mb, err := memory.New()
	if err != nil {
		t.Fatal(err)
	}
	var b consumer.Broker = mb
	defer b.Close()
	if err := b.Publish(t.Context(), "q", consumer.Message{ID: "m-1", Body: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	l, err := b.NewConsumer(t.Context(), "q", consumer.WithName("billing"))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	got := make(chan string, 1)
	go func() {
		_ = l.Run(ctx, consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
			got <- m.ID
			cancel()
			return nil
		}))
	}()
	if id := <-got; id != "m-1" {
		t.Errorf("handled %q, want m-1", id)
	}
	if sn, ok := b.(consumer.SystemNamer); !ok || sn.System() != "ferry_memory" {
		t.Errorf("the memory broker names its system %v, want ferry_memory", b)
	}
}
