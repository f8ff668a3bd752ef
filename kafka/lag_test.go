package kafka_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
)

// TestLagCountsTakenRecordsOnce: on a partially consumed topic (10 of 20
// records done and committed, the other 10 fetched and unfinished), the
// driver reports the 10 not done once: Messages (waiting, untaken) plus
// InFlight (taken, unsettled) is the high watermark minus the committed
// offset, what ferry lag prints, and so is the lag of the consumer's
// Health.
func TestLagCountsTakenRecordsOnce(t *testing.T) {
	b := newBroker(t)
	topic := newTopic(t, b, "lag-once", 1)
	group := testenv.UniqueName(t, "lag-once")
	var ms []consumer.Message
	for i := range 20 {
		ms = append(ms, consumer.Message{Key: "k", Body: fmt.Appendf(nil, "%d", i)})
	}
	if err := b.Publish(testenv.Context(t, 30*time.Second), topic, ms...); err != nil {
		t.Fatal(err)
	}
	c, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group), consumer.WithHealthWindow(200*time.Millisecond, 3),
		consumer.WithShutdownGrace(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	runConsumer(t, c, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if m.Offset < 10 {
			return nil
		}
		<-ctx.Done() // the rest stay in flight
		return ctx.Err()
	}))
	testenv.WaitFor(t, 30*time.Second, "offset 10 committed", func() bool { return committed(t, b.Admin(), group, topic)[0] == 10 })
	testenv.WaitFor(t, 10*time.Second, "all 20 records fetched", func() bool { return c.Stats().Fetched == 20 })

	lag, err := c.Lag(testenv.Context(t, 10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if lag.Lanes["0"] != 10 || lag.Messages+lag.InFlight != 10 || lag.InFlight != 10 || lag.Messages != 0 {
		t.Errorf("Lag = %d waiting + %d in flight, lanes %v; want 0 + 10, lane 0 at 10", lag.Messages, lag.InFlight, lag.Lanes)
	}
	// What ferry lag prints: the high watermark minus the committed offset.
	ends, err := b.Admin().ListEndOffsets(testenv.Context(t, 10*time.Second), topic)
	if err != nil {
		t.Fatal(err)
	}
	end, _ := ends.Lookup(topic, 0)
	want := end.Offset - committed(t, b.Admin(), group, topic)[0]
	testenv.WaitFor(t, 10*time.Second, fmt.Sprintf("the health's lag at %d", want), func() bool { return c.Health().Lag == want })
	if h := c.Health(); len(h.Lanes) != 1 || h.Lanes[0].Lag != want {
		t.Errorf("Health lanes %+v, want lane 0 at %d", h.Lanes, want)
	}
}

// A consumer that never fetched (as ferry lag's) counts nothing in flight.
func TestLagOfAMemberThatTookNothingIsAllWaiting(t *testing.T) {
	b := newBroker(t)
	topic := newTopic(t, b, "lag-idle", 2)
	publishKeyed(t, b, topic, 0, 12, 4)
	d, err := b.Driver(t.Context(), topic, driver.Config{Name: testenv.UniqueName(t, "lag-idle")})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	lag, err := d.(interface {
		Lag(context.Context) (consumer.Lag, error)
	}).Lag(testenv.Context(t, 10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if lag.Messages != 12 || lag.InFlight != 0 || lag.Lanes["0"]+lag.Lanes["1"] != 12 {
		t.Errorf("Lag = %d waiting + %d in flight, lanes %v; want 12 + 0", lag.Messages, lag.InFlight, lag.Lanes)
	}
}
