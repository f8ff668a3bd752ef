package rabbit_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/rabbit"
)

// Per-key partitioning over the consistent-hash exchange: every message of
// a key lands in one partition, each partition has one active consumer at
// a time (a second one is a standby and gets nothing), the lane is the key,
// and each key's messages complete in publish order while several
// handlers run.
func TestPartitionedKeepsKeyOrderWithOneActiveConsumer(t *testing.T) {
	ex := testenv.UniqueName(t, "parts")
	const parts, keys, perKey = 2, 8, 25
	topo := rabbit.Partitioned(ex, parts, rabbit.Queue{DeadLetterExchange: ex + ".dlx"})
	var qs []string
	for i := range parts {
		qs = append(qs, rabbit.PartitionQueue(ex, i))
	}
	deleteLater(t, qs, []string{ex})
	b := dial(t, rabbit.WithTopology(topo))

	var mu sync.Mutex
	done := map[string][]int{}            // key -> sequence in completion order
	where := map[string]map[string]bool{} // key -> consumers that got it
	laneOK := true
	handler := func(name string) consumer.HandlerFunc {
		return func(ctx context.Context, m *consumer.Message) error {
			seq, _ := strconv.Atoi(string(m.Body))
			_ = sleepCtx(ctx, time.Millisecond*time.Duration(seq%3))
			mu.Lock()
			defer mu.Unlock()
			done[m.Key] = append(done[m.Key], seq)
			if where[m.Key] == nil {
				where[m.Key] = map[string]bool{}
			}
			where[m.Key][name] = true
			if m.Lane != m.Key {
				laneOK = false
			}
			return nil
		}
	}
	for i, q := range qs {
		for _, role := range []string{"active", "standby"} {
			name := fmt.Sprintf("p%d-%s", i, role)
			c, err := b.NewConsumer(t.Context(), q, consumer.WithConcurrency(4), consumer.WithName(name))
			must(t, err)
			runLoop(t, c, handler(name))
			if role == "active" {
				time.Sleep(300 * time.Millisecond) // the first registered is the active one
			}
		}
	}
	var msgs []consumer.Message
	for i := range perKey {
		for k := range keys {
			msgs = append(msgs, consumer.Message{Key: "key-" + strconv.Itoa(k), Body: []byte(strconv.Itoa(i))})
		}
	}
	must(t, b.Publish(testenv.Context(t, 20*time.Second), rabbit.ToExchange(ex), msgs...))
	testenv.WaitFor(t, 30*time.Second, "every message handled", func() bool {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, s := range done {
			n += len(s)
		}
		return n >= keys*perKey
	})
	mu.Lock()
	defer mu.Unlock()
	want := make([]int, perKey)
	for i := range want {
		want[i] = i
	}
	used := map[string]bool{}
	for k, seqs := range done {
		if !slices.Equal(seqs, want) {
			t.Errorf("key %s completed in the order %v", k, seqs)
		}
		if len(where[k]) != 1 {
			t.Errorf("key %s was handled by %v, want one consumer", k, where[k])
		}
		for c := range where[k] {
			used[c] = true
		}
	}
	for c := range used {
		if c[len(c)-len("standby"):] == "standby" {
			t.Errorf("standby consumer %s got messages while the active one ran", c)
		}
	}
	if !laneOK {
		t.Error("a message's Lane is not its Key on a single-active-consumer queue")
	}
	t.Logf("consumers used: %v", used)
}
