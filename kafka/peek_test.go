package kafka_test

import (
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/ferrymq/ferry/consumer"
)

// Peek reads a topic from the log start, or from a group's committed
// offsets, without joining the group and without committing: the group's
// offsets are the same afterwards and no member ever joined it.
func TestPeekReadsWithoutJoiningOrCommitting(t *testing.T) {
	b := newBroker(t)
	topic := newTopic(t, b, "peek", 2)
	ctx := ctxFor(t, 60*time.Second)
	var msgs []consumer.Message
	for i, k := range []string{"a", "b", "c", "d", "e", "f"} {
		msgs = append(msgs, consumer.Message{ID: "id-" + k, Key: k, Body: []byte{byte('0' + i)}, Headers: map[string]string{"h": k}})
	}
	if err := b.Publish(ctx, topic, msgs...); err != nil {
		t.Fatal(err)
	}
	all, err := b.Peek(ctx, topic, "", 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != len(msgs) {
		t.Fatalf("Peek from the start read %d records, want %d", len(all), len(msgs))
	}
	for _, m := range all {
		if m.ID != "id-"+m.Key || m.Headers["h"] != m.Key || len(m.Headers) != 1 || m.Offset < 0 || m.Lane == "" {
			t.Errorf("peeked record %+v lost its id, header, lane or offset", m)
		}
	}

	group := topic + "-g"
	var off kadm.Offsets
	off.AddOffset(topic, 0, 1, -1)
	if _, err := b.Admin().CommitOffsets(ctx, group, off); err != nil {
		t.Fatal(err)
	}
	before := committed(t, b.Admin(), group, topic)
	rest, err := b.Peek(ctx, topic, group, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(rest) != len(msgs)-1 {
		t.Errorf("Peek from the group's offsets read %d records, want %d (one of partition 0 committed)", len(rest), len(msgs)-1)
	}
	one, err := b.Peek(ctx, topic, group, 1)
	if err != nil {
		t.Fatal(err)
	}
	if len(one) > 2 {
		t.Errorf("Peek with one per partition read %d records", len(one))
	}
	after := committed(t, b.Admin(), group, topic)
	if len(after) != len(before) || after[0] != before[0] {
		t.Errorf("the group's offsets moved: %v, then %v", before, after)
	}
	if _, ok := after[1]; ok {
		t.Errorf("Peek committed partition 1: %v", after)
	}
	groups, err := b.Admin().DescribeGroups(ctx, group)
	if err != nil {
		t.Fatal(err)
	}
	if g, ok := groups[group]; ok && len(g.Members) > 0 {
		t.Errorf("the group has members after Peek: %v", g.Members)
	}
}
