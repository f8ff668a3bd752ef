package kafka_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
)

// The cluster these tests kill nodes of: make test-cluster starts it
// (integration/brokers.sh up kafka-cluster: three Kafka nodes, each a broker
// and a controller, on 127.0.0.1:19091-19093, replication factor 3,
// min.insync.replicas 2) and sets these.
const (
	envClusterSeeds = "FERRY_KAFKA_CLUSTER_BROKERS" // 127.0.0.1:19091,127.0.0.1:19092,127.0.0.1:19093
	envClusterDir   = "FERRY_KAFKA_CLUSTER_DIR"     // the nodes' files: nN/kafka.pid, N the node.id
	envClusterUp    = "FERRY_KAFKA_CLUSTER_UP"      // a command that starts the nodes that are down and waits for them
)

type kafkaCluster struct {
	seeds   []string
	dir, up string
	adm     *kadm.Client
}

func clusterUnderTest(t *testing.T) *kafkaCluster {
	t.Helper()
	raw := os.Getenv(envClusterSeeds)
	if raw == "" {
		t.Skipf("%s is not set: make test-cluster starts a three-node Kafka cluster and runs this", envClusterSeeds)
	}
	c := &kafkaCluster{seeds: strings.Split(raw, ","), dir: os.Getenv(envClusterDir), up: os.Getenv(envClusterUp)}
	if len(c.seeds) != 3 || c.dir == "" || c.up == "" {
		t.Fatalf("%s must name 3 nodes, and %s and %s be set", envClusterSeeds, envClusterDir, envClusterUp)
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(c.seeds...), kgo.MetadataMinAge(250*time.Millisecond), kgo.MetadataMaxAge(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	c.adm = kadm.NewClient(cl)
	c.waitBrokers(t, 3)
	return c
}

// waitBrokers waits until the cluster's metadata lists n brokers.
func (c *kafkaCluster) waitBrokers(t *testing.T, n int) {
	t.Helper()
	testenv.WaitFor(t, 60*time.Second, fmt.Sprintf("%d brokers in the cluster's metadata", n), func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		m, err := c.adm.BrokerMetadata(ctx)
		return err == nil && len(m.Brokers) == n
	})
}

// leaders counts the partitions of topic each broker leads.
func (c *kafkaCluster) leaders(t *testing.T, topic string) map[int32]int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	m, err := c.adm.Metadata(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	out := map[int32]int{}
	for _, p := range m.Topics[topic].Partitions {
		out[p.Leader]++
	}
	return out
}

// kill SIGKILLs node id and waits until its port refuses connections.
func (c *kafkaCluster) kill(t *testing.T, id int32) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(c.dir, fmt.Sprintf("n%d", id), "kafka.pid"))
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 10*time.Second, "the killed node's port to refuse connections", func() bool {
		conn, err := net.DialTimeout("tcp", c.seeds[id-1], time.Second)
		if err == nil {
			conn.Close()
		}
		return err != nil
	})
}

// restore starts the nodes that are down and waits for them.
func (c *kafkaCluster) restore(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	f := strings.Fields(c.up)
	if out, err := exec.CommandContext(ctx, f[0], f[1:]...).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", c.up, err, out)
	}
	c.waitBrokers(t, 3)
}

// committedNeverDrops samples the group's committed offsets every 200 ms
// until stop is closed and reports each time one went down.
func (c *kafkaCluster) committedNeverDrops(t *testing.T, group string, stop <-chan struct{}) (done func() []string) {
	var mu sync.Mutex
	var drops []string
	last := map[int32]int64{}
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		for {
			select {
			case <-stop:
				return
			case <-time.After(200 * time.Millisecond):
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			offs, err := c.adm.FetchOffsets(ctx, group)
			cancel()
			if err != nil {
				continue // a coordinator moving: the next sample tells
			}
			offs.Each(func(o kadm.OffsetResponse) {
				if o.Err != nil {
					return
				}
				if prev, ok := last[o.Partition]; ok && o.At < prev {
					mu.Lock()
					drops = append(drops, fmt.Sprintf("partition %d: %d after %d", o.Partition, o.At, prev))
					mu.Unlock()
				}
				last[o.Partition] = max(last[o.Partition], o.At)
			})
		}
	}()
	return func() []string {
		<-finished
		mu.Lock()
		defer mu.Unlock()
		return drops
	}
}

// clusterLoad is a consumer group member and a publisher (acks=all,
// idempotent: Ferry's only way) over one topic, busy until stopped.
type clusterLoad struct {
	mu        sync.Mutex
	handled   map[string]int
	confirmed []string
	pubErrs   []error
	sent      int
	stop      chan struct{}
	pubDone   chan struct{}
}

func startClusterLoad(t *testing.T, b *kafka.Broker, topic, group string, publishTimeout time.Duration) *clusterLoad {
	t.Helper()
	l := &clusterLoad{handled: map[string]int{}, stop: make(chan struct{}), pubDone: make(chan struct{})}
	c, err := b.NewConsumer(t.Context(), topic, consumer.WithName(group), consumer.WithMaxInFlight(200))
	if err != nil {
		t.Fatal(err)
	}
	runConsumer(t, c, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		l.mu.Lock()
		l.handled[string(m.Body)]++
		l.mu.Unlock()
		return nil
	}))
	go func() {
		defer close(l.pubDone)
		for i := 0; ; i += 10 {
			select {
			case <-l.stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
			var msgs []consumer.Message
			for j := i; j < i+10; j++ {
				msgs = append(msgs, consumer.Message{Key: "k" + strconv.Itoa(j%13), Body: []byte(strconv.Itoa(j))})
			}
			l.mu.Lock()
			l.sent = i + 10
			l.mu.Unlock()
			ctx, cancel := context.WithTimeout(context.Background(), publishTimeout)
			err := b.Publish(ctx, topic, msgs...)
			cancel()
			failed := map[int]bool{}
			if err != nil {
				var pe *consumer.PublishError
				if errors.As(err, &pe) {
					for _, f := range pe.Failed {
						failed[f.Index] = true
					}
				} else {
					for j := range msgs {
						failed[j] = true
					}
				}
			}
			l.mu.Lock()
			if err != nil {
				l.pubErrs = append(l.pubErrs, err)
			}
			for j, m := range msgs {
				if !failed[j] {
					l.confirmed = append(l.confirmed, string(m.Body))
				}
			}
			l.mu.Unlock()
		}
	}()
	return l
}

func (l *clusterLoad) handledCount() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.handled)
}

func (l *clusterLoad) sentSoFar() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.sent
}

// handledFrom says whether a record numbered n or later was handled.
func (l *clusterLoad) handledFrom(n int) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for id := range l.handled {
		if i, _ := strconv.Atoi(id); i >= n {
			return true
		}
	}
	return false
}

// finish stops publishing and waits until every confirmed record is
// handled; it returns the confirmed count, the handled deliveries and the
// duplicates.
func (l *clusterLoad) finish(t *testing.T) (confirmed, deliveries, dups int) {
	t.Helper()
	close(l.stop)
	<-l.pubDone
	testenv.WaitFor(t, 120*time.Second, "every confirmed record to be handled", func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		for _, id := range l.confirmed {
			if l.handled[id] == 0 {
				return false
			}
		}
		return true
	})
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, n := range l.handled {
		deliveries += n
		dups += n - 1
	}
	return len(l.confirmed), deliveries, dups
}

// TestClusterLeaderKilled SIGKILLs the broker leading most partitions of a
// topic (6 partitions, replication factor 3) under a consumer group member
// and a publisher, and later starts it again: every record whose Publish
// returned nil is handled, duplicates stay within the consumer's in-flight
// bound (records handled but not yet committed), the consumer handles a
// record published after the kill within 30 s, and no committed offset
// ever goes down.
func TestClusterLeaderKilled(t *testing.T) {
	kc := clusterUnderTest(t)
	t.Cleanup(func() { kc.restore(t) })
	b, err := kafka.New(kc.seeds, kafka.WithLogger(testLogger(t)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	topic := testenv.UniqueName(t, "cluster")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := b.CreateTopic(ctx, topic, kafka.TopicConfig{Partitions: 6, ReplicationFactor: 3}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.DeleteSource(context.Background(), topic) })
	group := testenv.UniqueName(t, "cluster-group")

	load := startClusterLoad(t, b, topic, group, 2*time.Minute)
	stopSampling := make(chan struct{})
	drops := kc.committedNeverDrops(t, group, stopSampling)
	testenv.WaitFor(t, 60*time.Second, "records to flow", func() bool { return load.handledCount() >= 300 })

	var victim int32
	most := 0
	for id, n := range kc.leaders(t, topic) {
		if n > most {
			victim, most = id, n
		}
	}
	mark := load.sentSoFar()
	kc.kill(t, victim)
	killed := time.Now()
	testenv.WaitFor(t, 30*time.Second, "a record published after the kill to be handled", func() bool { return load.handledFrom(mark) })
	resumed := time.Since(killed)
	time.Sleep(3 * time.Second) // running on two brokers
	kc.restore(t)
	time.Sleep(2 * time.Second) // and on three again
	confirmed, deliveries, dups := load.finish(t)
	close(stopSampling)
	if d := drops(); len(d) > 0 {
		t.Errorf("committed offsets went down: %v", d)
	}
	if dups > 200 {
		t.Errorf("%d duplicates, more than the in-flight bound of 200 (records handled and not committed)", dups)
	}
	t.Logf("cluster fault \"leader killed\" (broker %d, leading %d of 6 partitions): confirmed %d, handled %d deliveries (every confirmed one), duplicates %d, publish errors %d, first record published after the kill handled %v after it",
		victim, most, confirmed, deliveries, dups, len(load.pubErrs), resumed.Round(time.Millisecond))
}

// TestClusterBelowMinInSync SIGKILLs two of the three brokers: with
// min.insync.replicas 2, acks=all writes cannot succeed, and Publish fails
// at its context's deadline with an error that says why, instead of
// hanging (it hung for minutes before the producer allowed in-flight
// records to be cancelled, and ended 5 s late before Publish stopped
// waiting at the deadline itself) or losing records;
// once the brokers are back, Publish succeeds again, and the consumer group
// member, which kept its position, handles every record that was
// confirmed, before and after.
func TestClusterBelowMinInSync(t *testing.T) {
	kc := clusterUnderTest(t)
	t.Cleanup(func() { kc.restore(t) })
	b, err := kafka.New(kc.seeds, kafka.WithLogger(testLogger(t)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	topic := testenv.UniqueName(t, "minisr")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := b.CreateTopic(ctx, topic, kafka.TopicConfig{Partitions: 6, ReplicationFactor: 3}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.DeleteSource(context.Background(), topic) })
	group := testenv.UniqueName(t, "minisr-group")

	load := startClusterLoad(t, b, topic, group, 10*time.Second)
	stopSampling := make(chan struct{})
	drops := kc.committedNeverDrops(t, group, stopSampling)
	testenv.WaitFor(t, 60*time.Second, "records to flow", func() bool { return load.handledCount() >= 300 })

	kc.kill(t, 2)
	kc.kill(t, 3)
	// A publish of its own, timed: the load's publisher is failing too.
	start := time.Now()
	pctx, pcancel := context.WithTimeout(context.Background(), 10*time.Second)
	err = b.Publish(pctx, topic, consumer.Message{Key: "k", Body: []byte("below-min-isr")})
	pcancel()
	took := time.Since(start)
	if err == nil {
		t.Fatal("Publish with one broker of three returned nil: acks=all with min.insync.replicas 2 cannot have succeeded")
	}
	if took > 11*time.Second {
		t.Errorf("Publish took %v to fail, past its 10 s deadline", took)
	}
	t.Logf("Publish with one broker of three failed after %v: %v", took.Round(time.Millisecond), err)
	// Why: with two of three nodes gone the controller quorum is gone
	// too, so no leader moves and no ISR shrinks; a record waits on a
	// partition whose leader is dead (the error names the broker it could
	// not reach) or on one whose followers never answer (too few in sync).
	if !errors.Is(err, context.DeadlineExceeded) ||
		!errors.Is(err, kerr.NotEnoughReplicas) && !strings.Contains(err.Error(), kc.seeds[1]) && !strings.Contains(err.Error(), kc.seeds[2]) {
		t.Errorf("Publish = %v, want the deadline and why: a killed broker it could not reach, or too few replicas in sync", err)
	}

	kc.restore(t)
	testenv.WaitFor(t, 60*time.Second, "a Publish to succeed with the brokers back", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		return b.Publish(ctx, topic, consumer.Message{Key: "k", Body: []byte("back")}) == nil
	})
	time.Sleep(2 * time.Second)
	confirmed, deliveries, dups := load.finish(t)
	close(stopSampling)
	if d := drops(); len(d) > 0 {
		t.Errorf("committed offsets went down: %v", d)
	}
	t.Logf("cluster fault \"below min ISR\" (brokers 2 and 3 killed, then started again): confirmed %d, handled %d deliveries (every confirmed one), duplicates %d, publish errors %d",
		confirmed, deliveries, dups, len(load.pubErrs))
}
