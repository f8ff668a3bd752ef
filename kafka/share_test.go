package kafka_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/consumer/consumertest"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
)

// shareLease is the record lock the share tests give their groups: short,
// so that locks that run out (and renewals that keep them) show in
// seconds. The test broker allows locks from 1 s
// (group.share.min.record.lock.duration.ms).
const shareLease = 2 * time.Second

// TestShareConformance runs the conformance suite against share groups
// (kafka.Share): Kafka as a queue, every consumer of a source a member of
// one share group, on a topic of one partition, made as a user makes them.
// One partition, because the group's assignor gives a member whole
// partitions while members are no more than partitions, and a member
// cannot take what another holds (TestShareMembersShareOnePartition shows
// many members on one).
func TestShareConformance(t *testing.T) {
	consumertest.Run(t, &shareHarness{b: newBroker(t, kafka.WithGroupProtocol(kafka.Share))})
}

// shareHarness makes a topic of one partition per test and configures the
// share group its consumers join (source+"-share") before any of them
// does.
type shareHarness struct {
	b *kafka.Broker
}

var _ consumertest.Harness = (*shareHarness)(nil)

func (h *shareHarness) NewSource(t *testing.T, cfg consumertest.SourceConfig) string {
	topic := newTopic(t, h.b, "share", 1)
	lease := cfg.Lease
	if lease == 0 {
		lease = 30 * time.Second
	}
	setGroupConfig(t, topic+"-share", map[string]string{"share.record.lock.duration.ms": strconv.Itoa(int(lease.Milliseconds()))})
	return topic
}

func (h *shareHarness) Publisher(*testing.T) consumer.Publisher { return h.b }

func (h *shareHarness) NewConsumer(t *testing.T, source string, opts ...consumer.Option) consumer.Consumer {
	opts = append(opts[:len(opts):len(opts)], consumer.WithName(source+"-share"))
	c, err := h.b.NewConsumer(t.Context(), source, opts...)
	if err != nil {
		t.Fatalf("new consumer of %q: %v", source, err)
	}
	return c
}

func (h *shareHarness) AsCheck(m *consumer.Message) error {
	var r *kgo.Record
	if !m.As(&r) {
		return errors.New("Message.As(**kgo.Record) = false")
	}
	if r.Topic != m.Source || r.Offset != m.Offset || string(r.Value) != string(m.Body) {
		return fmt.Errorf("Message.As gave %s/%d/%d for message at %s/%d", r.Topic, r.Partition, r.Offset, m.Source, m.Offset)
	}
	if int(r.DeliveryCount()) != m.Deliveries {
		return fmt.Errorf("Message.Deliveries is %d, the record's delivery count %d", m.Deliveries, r.DeliveryCount())
	}
	return nil
}

func (h *shareHarness) Capabilities() consumertest.Capabilities {
	// A queue: no order, a lock that a running handler renews, and a
	// record any member may get when another does not hold it.
	return consumertest.Capabilities{Lease: shareLease, Redelivers: true, MaxBody: 900 << 10}
}

// setGroupConfig sets configuration keys of a group (it need not exist
// yet) through the admin API.
func setGroupConfig(t testing.TB, group string, set map[string]string) {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(testenv.KafkaBrokers()...))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	req := kmsg.NewPtrIncrementalAlterConfigsRequest()
	r := kmsg.NewIncrementalAlterConfigsRequestResource()
	r.ResourceType = kmsg.ConfigResourceTypeGroupConfig
	r.ResourceName = group
	for k, v := range set {
		c := kmsg.NewIncrementalAlterConfigsRequestResourceConfig()
		c.Name, c.Value, c.Op = k, kmsg.StringPtr(v), kmsg.IncrementalAlterConfigOpSet
		r.Configs = append(r.Configs, c)
	}
	req.Resources = append(req.Resources, r)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		t.Fatalf("configure group %s: %v", group, err)
	}
	for _, res := range resp.Resources {
		if err := kerr.ErrorForCode(res.ErrorCode); err != nil {
			msg := ""
			if res.ErrorMessage != nil {
				msg = *res.ErrorMessage
			}
			t.Fatalf("configure group %s: %v %s", group, err, msg)
		}
	}
}
