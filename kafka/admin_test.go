package kafka_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
)

// CreateSource makes a topic with the partitions and the retention asked
// for; making it again is not an error; DeleteSource removes it, and
// deleting a topic that is gone is not an error either.
func TestAdminCreatesAndDeletesTopics(t *testing.T) {
	b := newBroker(t)
	var adm consumer.Admin = b
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	topic := testenv.UniqueName(t, "admin")
	cfg := consumer.SourceConfig{Partitions: 3, Retention: time.Hour}
	if err := adm.CreateSource(ctx, topic, cfg); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.DeleteTopic(context.Background(), topic) })
	if err := adm.CreateSource(ctx, topic, cfg); err != nil {
		t.Fatalf("creating the topic again: %v", err)
	}
	td, err := b.Admin().ListTopics(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	if got := len(td[topic].Partitions); got != 3 {
		t.Fatalf("partitions = %d, want 3", got)
	}
	rcs, err := b.Admin().DescribeTopicConfigs(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	rc, err := rcs.On(topic, nil)
	if err != nil {
		t.Fatal(err)
	}
	retention := ""
	for _, c := range rc.Configs {
		if c.Key == "retention.ms" {
			retention = c.MaybeValue()
		}
	}
	if retention != "3600000" {
		t.Fatalf("retention.ms = %q, want 3600000", retention)
	}

	if err := b.Publish(ctx, topic, consumer.Message{ID: "m-1", Key: "k", Body: []byte("one")}); err != nil {
		t.Fatal(err)
	}
	ends, err := b.Admin().ListEndOffsets(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	ends.Each(func(o kadm.ListedOffset) { n += o.Offset })
	if n != 1 {
		t.Fatalf("the topic holds %d records, want 1", n)
	}

	if err := adm.DeleteSource(ctx, topic); err != nil {
		t.Fatal(err)
	}
	// Deletion is asynchronous in the cluster: the topic goes from the
	// metadata soon after.
	for {
		td, err := b.Admin().ListTopics(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := td[topic]; !ok {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := adm.DeleteSource(ctx, topic); err != nil {
		t.Fatalf("deleting a topic that is gone: %v", err)
	}
}

// Kafka has no broker dead-lettering and no lease: a SourceConfig that asks
// for either is refused, naming the field, before anything is made.
func TestAdminRefusesDeadLetterOnKafka(t *testing.T) {
	b := newBroker(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	topic := testenv.UniqueName(t, "admin-dlq")
	for _, cfg := range []consumer.SourceConfig{
		{DeadLetter: topic + "-dlq"},
		{MaxDeliveries: 3},
		{Partitions: -1},
		{Lease: time.Minute},
	} {
		err := b.CreateSource(ctx, topic, cfg)
		var ce *consumer.ConfigError
		if !errors.As(err, &ce) {
			t.Fatalf("CreateSource(%+v) = %v, want a *consumer.ConfigError", cfg, err)
		}
		if cfg.Lease != 0 && ce.Field != "SourceConfig.Lease" {
			t.Fatalf("CreateSource(%+v) names %q, want SourceConfig.Lease", cfg, ce.Field)
		}
	}
	td, err := b.Admin().ListTopics(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := td[topic]; ok {
		_ = b.DeleteTopic(ctx, topic)
		t.Fatalf("a refused CreateSource made topic %q", topic)
	}
}

var _ consumer.Admin = (*kafka.Broker)(nil)
