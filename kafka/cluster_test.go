package kafka_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

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
	cl      *kgo.Client
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
	c.cl, c.adm = cl, kadm.NewClient(cl)
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

// newBrokerAndTopic makes a Broker of the cluster and a topic of 6
// partitions with 3 replicas. The cluster is made whole again first of
// all at cleanup (cleanups run last first), so that deleting the topic
// finds a quorum after a test that failed mid-fault.
func (c *kafkaCluster) newBrokerAndTopic(t *testing.T, prefix string) (*kafka.Broker, string) {
	t.Helper()
	b, err := kafka.New(c.seeds, kafka.WithLogger(testLogger(t)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	topic := testenv.UniqueName(t, prefix)
	if err := b.CreateTopic(testenv.Context(t, 30*time.Second), topic, kafka.TopicConfig{Partitions: 6, ReplicationFactor: 3}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		_ = b.DeleteSource(ctx, topic)
	})
	t.Cleanup(func() { c.restore(t) })
	return b, topic
}

// quorumLeader asks the cluster which node leads the KRaft quorum (the
// active controller): DescribeQuorum of __cluster_metadata.
func (c *kafkaCluster) quorumLeader() (int32, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req := kmsg.NewPtrDescribeQuorumRequest()
	topic := kmsg.NewDescribeQuorumRequestTopic()
	topic.Topic = "__cluster_metadata"
	part := kmsg.NewDescribeQuorumRequestTopicPartition()
	topic.Partitions = append(topic.Partitions, part)
	req.Topics = append(req.Topics, topic)
	resp, err := req.RequestWith(ctx, c.cl)
	if err != nil {
		return -1, err
	}
	if err := kerr.ErrorForCode(resp.ErrorCode); err != nil {
		return -1, err
	}
	if len(resp.Topics) == 0 || len(resp.Topics[0].Partitions) == 0 {
		return -1, errors.New("DescribeQuorum answered no partition")
	}
	p := resp.Topics[0].Partitions[0]
	if err := kerr.ErrorForCode(p.ErrorCode); err != nil {
		return -1, err
	}
	return p.LeaderID, nil
}

func (c *kafkaCluster) activeController(t *testing.T) int32 {
	t.Helper()
	id, err := c.quorumLeader()
	if err != nil || id < 1 || id > 3 {
		t.Fatalf("the active controller: %d, %v", id, err)
	}
	return id
}

// kill SIGKILLs node id and waits until its port refuses connections.
func (c *kafkaCluster) kill(t *testing.T, id int32) {
	t.Helper()
	testenv.KillNode(t, filepath.Join(c.dir, fmt.Sprintf("n%d", id), "kafka.pid"), c.seeds[id-1])
}

// restore starts the nodes that are down and waits for them.
func (c *kafkaCluster) restore(t *testing.T) {
	t.Helper()
	testenv.RunCommand(t, c.up, 3*time.Minute)
	c.waitBrokers(t, 3)
}

// committedNeverDrops samples the group's committed offsets every 200 ms
// until stop is called (or the test ends), and stop reports each time one
// went down.
// until stop is closed and reports each time one went down.
func (c *kafkaCluster) committedNeverDrops(t *testing.T, group string) (stop func() []string) {
	var drops []string
	last := map[int32]int64{}
	stopping, finished := make(chan struct{}), make(chan struct{})
	var once sync.Once
	stop = func() []string {
		once.Do(func() { close(stopping) })
		<-finished
		return drops
	}
	t.Cleanup(func() { stop() })
	go func() {
		defer close(finished)
		for {
			select {
			case <-stopping:
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
					drops = append(drops, fmt.Sprintf("partition %d: %d after %d", o.Partition, o.At, prev))
				}
				last[o.Partition] = max(last[o.Partition], o.At)
			})
		}
	}()
	return stop
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
	stopOnce  sync.Once
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
	t.Cleanup(func() { // the test failed before finish: stop publishing
		l.stopOnce.Do(func() { close(l.stop) })
		<-l.pubDone
	})
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
	l.stopOnce.Do(func() { close(l.stop) })
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
// returned nil is handled, duplicates stay within twice the consumer's
// in-flight bound (records handled but not yet committed, each time
// partitions move), the consumer handles a record made after the kill
// within 30 s, and no committed offset ever goes down.
func TestClusterLeaderKilled(t *testing.T) {
	killUnderLoad(t, "leader killed", func(kc *kafkaCluster, topic string) (int32, string) {
		var victim int32
		most := 0
		for id, n := range kc.leaders(t, topic) {
			if n > most {
				victim, most = id, n
			}
		}
		return victim, fmt.Sprintf("broker %d, leading %d of 6 partitions", victim, most)
	}, nil)
}

// TestClusterControllerKilled SIGKILLs the active controller (the leader of
// the KRaft quorum; every node is a broker too): the other two elect a new
// one, and the group and the publisher carry on as in
// TestClusterLeaderKilled.
func TestClusterControllerKilled(t *testing.T) {
	killUnderLoad(t, "controller killed", func(kc *kafkaCluster, _ string) (int32, string) {
		id := kc.activeController(t)
		return id, fmt.Sprintf("node %d, the active controller", id)
	}, func(kc *kafkaCluster, victim int32) {
		testenv.WaitFor(t, 30*time.Second, "another node to lead the KRaft quorum", func() bool {
			id, err := kc.quorumLeader()
			return err == nil && id >= 0 && id != victim
		})
	})
}

// killUnderLoad runs a group member and a publisher over a new topic (6
// partitions, replication factor 3), SIGKILLs the node pick names once
// records flow, runs after (when not nil) once the consumer resumed, starts
// the node again and checks what TestClusterLeaderKilled says.
func killUnderLoad(t *testing.T, fault string, pick func(kc *kafkaCluster, topic string) (int32, string), after func(kc *kafkaCluster, victim int32)) {
	kc := clusterUnderTest(t)
	b, topic := kc.newBrokerAndTopic(t, "cluster")
	group := testenv.UniqueName(t, "cluster-group")

	load := startClusterLoad(t, b, topic, group, 2*time.Minute)
	stopSampling := kc.committedNeverDrops(t, group)
	testenv.WaitFor(t, 60*time.Second, "records to flow", func() bool { return load.handledCount() >= 300 })

	victim, what := pick(kc, topic)
	t.Cleanup(func() { kc.restore(t) }) // first of all, should the test fail from here
	kc.kill(t, victim)
	killed := time.Now()
	mark := load.sentSoFar() // records made from here on were made after the kill
	testenv.WaitFor(t, 30*time.Second, "a record published after the kill to be handled", func() bool { return load.handledFrom(mark) })
	resumed := time.Since(killed)
	if after != nil {
		after(kc, victim)
	}
	time.Sleep(3 * time.Second) // running on two nodes
	kc.restore(t)
	time.Sleep(2 * time.Second) // and on three again
	confirmed, deliveries, dups := load.finish(t)
	if d := stopSampling(); len(d) > 0 {
		t.Errorf("committed offsets went down: %v", d)
	}
	// Each time partitions move (the kill; the group's coordinator moving
	// with it), at most the in-flight bound of records handled and not yet
	// committed come again.
	if dups > 400 {
		t.Errorf("%d duplicates, more than twice the in-flight bound of 200 (records handled and not committed)", dups)
	}
	t.Logf("cluster fault %q (%s): confirmed %d, handled %d deliveries (every confirmed one), duplicates %d, publish errors %d, first record published after the kill handled %v after it",
		fault, what, confirmed, deliveries, dups, len(load.pubErrs), resumed.Round(time.Millisecond))
}

// TestClusterBelowMinInSync SIGKILLs two of the three brokers: with
// min.insync.replicas 2, acks=all writes cannot succeed, and Publish fails
// at its context's deadline with an error that says why, instead of
// hanging (it hung for minutes: franz-go's idempotent producer waits for
// the outcome of a write it sent, and Publish waited for franz-go) or
// losing records;
// once the brokers are back, Publish succeeds again, and the consumer group
// member, which kept its position, handles every record that was
// confirmed, before and after.
func TestClusterBelowMinInSync(t *testing.T) {
	kc := clusterUnderTest(t)
	b, topic := kc.newBrokerAndTopic(t, "minisr")
	group := testenv.UniqueName(t, "minisr-group")
	// The timed Publish has a producer of its own: records buffered for a
	// partition fail together when the first one's context ends, and the
	// load's would fail it first.
	probe, err := kafka.New(kc.seeds, kafka.WithLogger(testLogger(t)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = probe.Close() })
	probeMsgs := make([]consumer.Message, 30) // over every partition
	for i := range probeMsgs {
		probeMsgs[i] = consumer.Message{Key: "probe-" + strconv.Itoa(i), Body: []byte("probe-" + strconv.Itoa(i))}
	}
	if err := probe.Publish(testenv.Context(t, 30*time.Second), topic, probeMsgs...); err != nil {
		t.Fatal(err)
	}
	for i := range probeMsgs { // the timed publish: bodies of their own
		probeMsgs[i].Body = []byte("probe-again-" + strconv.Itoa(i))
	}

	load := startClusterLoad(t, b, topic, group, 10*time.Second)
	stopSampling := kc.committedNeverDrops(t, group)
	testenv.WaitFor(t, 60*time.Second, "records to flow", func() bool { return load.handledCount() >= 300 })

	t.Cleanup(func() { kc.restore(t) }) // first of all, should the test fail from here
	kc.kill(t, 2)
	kc.kill(t, 3)
	start := time.Now()
	pctx, pcancel := context.WithTimeout(context.Background(), 10*time.Second)
	err = probe.Publish(pctx, topic, probeMsgs...)
	pcancel()
	took := time.Since(start)
	if err == nil {
		t.Fatal("Publish with one broker of three returned nil: acks=all with min.insync.replicas 2 cannot have succeeded")
	}
	if took > 11*time.Second {
		t.Errorf("Publish took %v to fail, past its 10 s deadline", took)
	}
	t.Logf("Publish with one broker of three failed after %v: %v", took.Round(time.Millisecond), err)
	// The producer may still write those records once the brokers are
	// back; the caller reuses its buffers at once. What is written must be
	// what the call was given (Publish copied the bodies).
	for i := range probeMsgs {
		for j := range probeMsgs[i].Body {
			probeMsgs[i].Body[j] = 'X'
		}
	}
	// Why: with two of three nodes gone the controller quorum is gone
	// too, so no leader moves and no ISR shrinks; records wait on the
	// partitions whose leader is dead (the error names the broker the
	// producer could not reach, or the metadata's LEADER_NOT_AVAILABLE),
	// and on the others the write is not answered (their followers are
	// dead too).
	if !errors.Is(err, context.DeadlineExceeded) ||
		!errors.Is(err, kerr.LeaderNotAvailable) && !strings.Contains(err.Error(), kc.seeds[1]) && !strings.Contains(err.Error(), kc.seeds[2]) {
		t.Errorf("Publish = %v, want the deadline and why: a killed broker it could not reach, or a partition without a leader", err)
	}

	kc.restore(t)
	tries := 0
	testenv.WaitFor(t, 60*time.Second, "a Publish to succeed with the brokers back", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		tries++
		return b.Publish(ctx, topic, consumer.Message{Key: "k", Body: []byte("back-" + strconv.Itoa(tries))}) == nil
	})
	time.Sleep(2 * time.Second)
	confirmed, deliveries, dups := load.finish(t)
	if d := stopSampling(); len(d) > 0 {
		t.Errorf("committed offsets went down: %v", d)
	}
	load.mu.Lock()
	for body := range load.handled {
		if strings.HasPrefix(body, "XXX") {
			t.Errorf("a record was written with the bytes its caller wrote into the body after Publish returned: %q", body)
		}
	}
	load.mu.Unlock()
	t.Logf("cluster fault \"below min ISR\" (brokers 2 and 3 killed, then started again): confirmed %d, handled %d deliveries (every confirmed one), duplicates %d, publish errors %d",
		confirmed, deliveries, dups, len(load.pubErrs))
}
