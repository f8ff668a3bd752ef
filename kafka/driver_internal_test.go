package kafka

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer/driver"
	"github.com/ferrymq/ferry/internal/testenv"
)

// unitDriver is a driver over topic owning partitions ids, with no client:
// enough for messages and Settle.
func unitDriver(topic string, ids ...int32) *kafkaDriver {
	b := &Broker{log: slog.New(slog.DiscardHandler)}
	d := &kafkaDriver{membership: membership{b: b, topic: topic, log: b.log}, parts: make(map[int32]*partition)}
	for _, id := range ids {
		d.parts[id] = newPartition(id)
	}
	return d
}

// records returns n records of topic's partition id from offset from on.
func records(topic string, id int32, from int64, n int) []*kgo.Record {
	out := make([]*kgo.Record, n)
	for i := range out {
		out[i] = &kgo.Record{Topic: topic, Partition: id, Offset: from + int64(i), Key: []byte("k" + strconv.Itoa(i))}
	}
	return out
}

// TestMessagesReadRecordsAsReadHeadersDoes: a record's key, ID and headers
// come out of messages as readHeaders and the ID rule say (the last
// HeaderMessageID, or topic/partition/offset when there is none or it is
// empty; other headers in a map, nil when there are none), whichever part
// of its group's string they were cut from or not, over groups of several
// records and strings too large to share one; and they are copies: a
// record's bytes written afterwards (a handler may, through As) change no
// message.
func TestMessagesReadRecordsAsReadHeadersDoes(t *testing.T) {
	const topic = "orders"
	d := unitDriver(topic, 4)
	big := strings.Repeat("b", smallStrings+1)
	hdr := func(kv ...string) []kgo.RecordHeader {
		var hs []kgo.RecordHeader
		for i := 0; i < len(kv); i += 2 {
			hs = append(hs, kgo.RecordHeader{Key: kv[i], Value: []byte(kv[i+1])})
		}
		return hs
	}
	var recs []*kgo.Record
	for i := range 3*handleSlab + 5 {
		r := &kgo.Record{Topic: topic, Partition: 4, Offset: 1000 + int64(i), Value: []byte{byte(i)}}
		switch i % 8 {
		case 0:
			r.Key = []byte("key-" + strconv.Itoa(i))
		case 1:
			r.Key = []byte(big + strconv.Itoa(i)) // its own string
			r.Headers = hdr(HeaderMessageID, "id-"+strconv.Itoa(i))
		case 2:
			r.Headers = hdr(HeaderMessageID, "") // empty: the ID is made
		case 3:
			r.Key = []byte("k")
			r.Headers = hdr(HeaderMessageID, "first", "x", "y", HeaderMessageID, "last", "e", "")
		case 4:
			r.Headers = hdr("a", big, "b", "small", "a", "again") // a repeated key: the last counts
		case 5:
			r.Headers = hdr(HeaderMessageID, big) // an ID too large to share
		case 6:
			r.Key = []byte(strings.Repeat("s", smallStrings)) // just fits, and fills the record's room
			r.Headers = hdr("h", "v")
		}
		recs = append(recs, r)
	}
	p := d.parts[4]
	got := d.messages(nil, p, recs)
	if len(got) != len(recs) {
		t.Fatalf("%d messages of %d records", len(got), len(recs))
	}
	for i, r := range recs {
		m := got[i]
		id, headers := readHeaders(r)
		if id == "" {
			id = topic + "/4/" + strconv.FormatInt(r.Offset, 10)
		}
		if m.Key != string(r.Key) || m.ID != id || m.Offset != r.Offset || m.Lane != "4" || m.Source != topic ||
			!bytes.Equal(m.Body, r.Value) || m.Deliveries != 1 || m.Generation != p.gen {
			t.Errorf("record %d: message %+v; want key %.20q, ID %.30q", i, m, r.Key, id)
		}
		if (headers == nil) != (m.Headers == nil) || len(headers) != len(m.Headers) {
			t.Errorf("record %d: headers %v, want %v", i, m.Headers, headers)
		}
		for k, v := range headers {
			if w, ok := m.Headers[k]; !ok || w != v {
				t.Errorf("record %d: headers %.40v, want %.40v", i, m.Headers, headers)
			}
		}
		if h := m.Handle.(*handle); h.rec != r || h.p != p {
			t.Errorf("record %d: handle of another record or partition", i)
		}
	}
	if p.outstanding != len(recs) || p.next != -1 {
		t.Errorf("partition holds %d unfinished, commit point %d; want %d and none", p.outstanding, p.next, len(recs))
	}
	keys := make([]string, len(got))
	for i := range got {
		keys[i] = strings.Clone(got[i].Key)
	}
	for _, r := range recs {
		for j := range r.Key {
			r.Key[j] = '!'
		}
		for _, h := range r.Headers {
			clear(h.Value)
		}
	}
	for i := range got {
		if got[i].Key != keys[i] {
			t.Fatalf("record %d: the message's key changed with its record's bytes: %.20q, was %.20q", i, got[i].Key, keys[i])
		}
	}
}

// TestAGroupOfRecordsCostsTwoAllocations: handing out a group of
// handleSlab records costs two allocations (the handles, the strings)
// whatever their keys and IDs, and one more for each string too large to
// share (smallStrings); a header map (a map's two: its header and its
// table) is made only for a record that has headers other than the ID.
func TestAGroupOfRecordsCostsTwoAllocations(t *testing.T) {
	const topic = "orders"
	for _, tc := range []struct {
		name string
		edit func([]*kgo.Record)
		want float64
	}{
		{"keys and made IDs", func([]*kgo.Record) {}, 2},
		{"ID headers", func(rs []*kgo.Record) {
			for i, r := range rs {
				r.Headers = []kgo.RecordHeader{{Key: HeaderMessageID, Value: []byte("event-" + strconv.Itoa(i))}}
			}
		}, 2},
		{"one large key", func(rs []*kgo.Record) { rs[3].Key = bytes.Repeat([]byte("x"), smallStrings+1) }, 3},
		{"one record with another header", func(rs []*kgo.Record) {
			rs[5].Headers = []kgo.RecordHeader{{Key: "trace", Value: []byte("00-abc")}}
		}, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := unitDriver(topic, 0)
			p := d.parts[0]
			recs := records(topic, 0, 0, handleSlab)
			tc.edit(recs)
			dst := make([]driver.Message, 0, handleSlab)
			got := testing.AllocsPerRun(50, func() {
				p.ents, p.head, p.outstanding = p.ents[:0], 0, 0
				dst = d.messages(dst[:0], p, recs)
			})
			if got != tc.want {
				t.Errorf("%v allocations for %d records, want %v", got, handleSlab, tc.want)
			}
		})
	}
}

// TestSettleRunsCommitOnlyAFinishedPrefix: Settle's runs (acks of one
// partition in a row) move each partition's commit point only over
// records finished with every one before them, whatever the order of the
// acks across partitions and inside a run, across several calls; an ack
// given twice counts once; acks of a partition revoked since are not
// counted, and an at-most-once one of them fails.
func TestSettleRunsCommitOnlyAFinishedPrefix(t *testing.T) {
	const topic = "orders"
	d := unitDriver(topic, 0, 1, 2)
	var msgs []driver.Message
	msgs = d.messages(msgs, d.parts[0], records(topic, 0, 100, 40))
	msgs = d.messages(msgs, d.parts[1], records(topic, 1, 0, 40))
	msgs = d.messages(msgs, d.parts[2], records(topic, 2, 7, 3))
	of := func(id int32, off int64) any {
		for _, m := range msgs {
			if h := m.Handle.(*handle); h.p.id == id && h.rec.Offset == off {
				return m.Handle
			}
		}
		t.Fatalf("no record %d/%d", id, off)
		return nil
	}
	acks := func(spec ...[3]int64) []driver.Settlement { // {partition, from, to} inclusive
		var out []driver.Settlement
		for _, s := range spec {
			step := int64(1)
			if s[2] < s[1] {
				step = -1
			}
			for o := s[1]; ; o += step {
				out = append(out, driver.Settlement{Handle: of(int32(s[0]), o), Action: driver.Ack})
				if o == s[2] {
					break
				}
			}
		}
		return out
	}
	ctx := context.Background()
	check := func(step string, want0, want1 int64, out0, out1 int) {
		t.Helper()
		p0, p1 := d.parts[0], d.parts[1]
		if p0.next != want0 || p1.next != want1 || p0.outstanding != out0 || p1.outstanding != out1 {
			t.Fatalf("%s: commit points %d and %d, unfinished %d and %d; want %d and %d, %d and %d",
				step, p0.next, p1.next, p0.outstanding, p1.outstanding, want0, want1, out0, out1)
		}
	}
	// Runs of both partitions, interleaved, each with a gap.
	if err := d.Settle(ctx, acks([3]int64{0, 100, 109}, [3]int64{1, 0, 4}, [3]int64{0, 111, 120}, [3]int64{1, 6, 9})); err != nil {
		t.Fatal(err)
	}
	check("first batch", 110, 5, 20, 31)
	// A Return finishes nothing; an ack twice counts once; a run in
	// reverse order closes a gap.
	batch := append(acks([3]int64{0, 105, 105}, [3]int64{1, 5, 5}), driver.Settlement{Handle: of(0, 110), Action: driver.Return})
	batch = append(batch, acks([3]int64{1, 19, 10})...)
	if err := d.Settle(ctx, batch); err != nil {
		t.Fatal(err)
	}
	check("second batch", 110, 20, 20, 20)
	if err := d.Settle(ctx, acks([3]int64{0, 139, 121}, [3]int64{0, 110, 110})); err != nil {
		t.Fatal(err)
	}
	check("third batch", 140, 20, 0, 20)
	if len(d.parts[0].ents) != 0 {
		t.Errorf("%d entries kept of a partition with all finished", len(d.parts[0].ents))
	}

	// Partition 2 is revoked: its acks count for nothing, and an
	// at-most-once one fails (its handler must not run).
	p2 := d.parts[2]
	d.forgetPartitions(nil, []int32{2})
	batch = acks([3]int64{2, 7, 8})
	batch[1].BeforeRun = true
	batch = append(batch, acks([3]int64{1, 20, 20})...)
	err := d.Settle(ctx, batch)
	var se *driver.SettleError
	if !errors.As(err, &se) || len(se.Failed) != 1 || se.Failed[0] != 1 {
		t.Fatalf("Settle = %v, want the at-most-once ack of the revoked partition (index 1) failed", err)
	}
	if p2.next != -1 || p2.outstanding != 3 {
		t.Errorf("revoked partition: commit point %d, unfinished %d; want none and 3", p2.next, p2.outstanding)
	}
	check("after the revocation", 140, 21, 0, 19)
}

// TestScrambledAcksCommitOnlyContiguousOffsets: through the real group,
// acks settled in runs out of order across partitions (as OrderByKey and
// batched hand-offs give them) commit, after each Settle, exactly the
// offset below which every record of the partition was acked: never past
// one still unacked.
func TestScrambledAcksCommitOnlyContiguousOffsets(t *testing.T) {
	seeds := testenv.RequireKafka(t)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	b, err := New(seeds, WithCommitInterval(time.Hour), WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	topic := testenv.UniqueName(t, "scrambled-acks")
	group := topic + "-group"
	if err := b.CreateTopic(ctx, topic, TopicConfig{Partitions: 2}); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = b.DeleteTopic(context.Background(), topic) }()
	const perPartition = 60
	cl, err := kgo.NewClient(kgo.SeedBrokers(seeds...), kgo.DefaultProduceTopic(topic), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	var rs []*kgo.Record
	for p := range int32(2) {
		for i := range perPartition {
			rs = append(rs, &kgo.Record{Partition: p, Value: []byte(strconv.Itoa(i))})
		}
	}
	err = cl.ProduceSync(ctx, rs...).FirstErr()
	cl.Close()
	if err != nil {
		t.Fatal(err)
	}

	d := startGroupDriver(t, b, topic, group)
	defer d.Close()
	handles := map[[2]int64]any{}
	for len(handles) < 2*perPartition {
		got, err := d.Fetch(ctx, nil, 2*perPartition)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range got {
			lane, _ := strconv.Atoi(m.Lane)
			handles[[2]int64{int64(lane), m.Offset}] = m.Handle
		}
	}
	acked := map[[2]int64]bool{}
	// want is the offset below which every record of partition p is
	// acked: what the commit must say.
	want := func(p int64) int64 {
		o := int64(0)
		for acked[[2]int64{p, o}] {
			o++
		}
		return o
	}
	// Each step a batch of runs: {partition, from, to} inclusive.
	steps := [][][3]int64{
		{{0, 10, 19}, {1, 0, 9}, {0, 30, 39}},
		{{1, 20, 29}, {0, 0, 4}, {1, 11, 15}},
		{{0, 9, 5}, {1, 10, 10}, {0, 20, 29}, {1, 16, 19}},
		{{1, 59, 30}, {0, 40, 59}},
		{{0, 4, 0}, {1, 9, 0}}, // twice: counted once
	}
	for i, step := range steps {
		var batch []driver.Settlement
		for _, run := range step {
			for o := run[1]; ; {
				k := [2]int64{run[0], o}
				acked[k] = true
				batch = append(batch, driver.Settlement{Handle: handles[k], Action: driver.Ack})
				if o == run[2] {
					break
				}
				if run[2] > run[1] {
					o++
				} else {
					o--
				}
			}
		}
		if err := d.Settle(ctx, batch); err != nil {
			t.Fatal(err)
		}
		if err := d.commit(ctx, nil, false); err != nil {
			t.Fatal(err)
		}
		offs, err := b.Admin().FetchOffsets(ctx, group)
		if err != nil {
			t.Fatal(err)
		}
		for p := range int64(2) {
			w := want(p)
			o, ok := offs.Lookup(topic, int32(p))
			switch {
			case w == 0 && ok && o.At >= 0:
				t.Errorf("step %d: partition %d committed at %d with offset 0 unacked", i, p, o.At)
			case w > 0 && (!ok || o.At != w):
				t.Errorf("step %d: partition %d committed at %d (found %v), want %d", i, p, o.At, ok, w)
			}
		}
	}
	if want(0) != perPartition || want(1) != perPartition {
		t.Fatalf("the steps left records unacked: %d and %d", want(0), want(1))
	}
}

// TestAppendOffsetCountsAsStrconvFormats: the digits appendOffset counts
// up from one offset to the next are those strconv formats, over carries,
// an extra digit, jumps either way, an offset written twice and negative
// ones (never fetched).
func TestAppendOffsetCountsAsStrconvFormats(t *testing.T) {
	d := unitDriver("t")
	var offs []int64
	for o := int64(0); o <= 1100; o++ {
		offs = append(offs, o)
	}
	offs = append(offs, 5, 5, 6, -1, 0, -2, -1, 99_999, 100_000, 100_001, 1<<40, 1<<40+1, 9, 10, 0, 1, 999_999_999, 1_000_000_000, 42)
	for _, o := range offs {
		last := d.lastOffset
		got := string(d.appendOffset([]byte("x/"), o))
		if want := "x/" + strconv.FormatInt(o, 10); got != want {
			t.Fatalf("after %d: appendOffset wrote %q, want %q", last, got, want)
		}
	}
}
