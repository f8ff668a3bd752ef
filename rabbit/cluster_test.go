package rabbit_test

import (
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/rabbit"
)

// The cluster these tests kill nodes of: make test-cluster starts it
// (integration/brokers.sh up rabbitmq-cluster: three RabbitMQ 4.0 nodes,
// rabbitc1..3@localhost on 127.0.0.1:5691..5693) and sets these.
const (
	envClusterURL = "FERRY_RABBIT_CLUSTER_URL" // amqp://guest:guest@127.0.0.1:5691,127.0.0.1:5692,127.0.0.1:5693/
	envClusterDir = "FERRY_RABBIT_CLUSTER_DIR" // the nodes' files: cN/rabbitmq.pid
	envClusterUp  = "FERRY_RABBIT_CLUSTER_UP"  // a command that starts the nodes that are down and waits for all three
)

// testCluster is the three-node cluster of make test-cluster.
type testCluster struct {
	nodes []string // one URL a node, node i+1 at index i
	dir   string
	up    string
}

func clusterUnderTest(t *testing.T) testCluster {
	t.Helper()
	raw := os.Getenv(envClusterURL)
	if raw == "" {
		t.Skipf("%s is not set: make test-cluster starts a three-node RabbitMQ cluster and runs this", envClusterURL)
	}
	nodes, err := rabbit.NodeURLs(raw)
	must(t, err)
	if len(nodes) != 3 {
		t.Fatalf("%s names %d nodes, want 3", envClusterURL, len(nodes))
	}
	c := testCluster{nodes: nodes, dir: os.Getenv(envClusterDir), up: os.Getenv(envClusterUp)}
	if c.dir == "" || c.up == "" {
		t.Fatalf("%s and %s must be set with %s", envClusterDir, envClusterUp, envClusterURL)
	}
	return c
}

// name is the Erlang node name of node i (1-based).
func (c testCluster) name(i int) string { return fmt.Sprintf("rabbitc%d@localhost", i) }

// url names the nodes in the order given (1-based), so that the clients
// connect to the first.
func (c testCluster) url(t *testing.T, order ...int) string {
	t.Helper()
	var hosts []string
	for _, i := range order {
		u, err := url.Parse(c.nodes[i-1])
		must(t, err)
		hosts = append(hosts, u.Host)
	}
	return withNodes(t, c.nodes[0], hosts...)
}

// kill SIGKILLs node i and waits until its port refuses connections.
func (c testCluster) kill(t *testing.T, i int) {
	t.Helper()
	u, err := url.Parse(c.nodes[i-1])
	must(t, err)
	testenv.KillNode(t, filepath.Join(c.dir, fmt.Sprintf("c%d", i), "rabbitmq.pid"), u.Host)
}

// restore starts the nodes that are down and waits until all three run as
// one cluster.
func (c testCluster) restore(t *testing.T) {
	t.Helper()
	testenv.RunCommand(t, c.up, 3*time.Minute)
}

// queueInfo is a quorum queue's leader and members, as rabbitmqctl
// list_queues reports them.
type queueInfo struct {
	Name    string   `json:"name"`
	Leader  string   `json:"leader"`
	Members []string `json:"members"`
}

// queue asks node i for the leader and members of queue.
func (c testCluster) queue(t *testing.T, i int, queue string) queueInfo {
	t.Helper()
	var qs []queueInfo
	out := ctlAt(t, c.name(i), "list_queues", "name", "leader", "members", "--formatter", "json")
	if err := json.Unmarshal([]byte(out), &qs); err != nil {
		t.Fatalf("list_queues: %v\n%s", err, out)
	}
	for _, q := range qs {
		if q.Name == queue {
			return q
		}
	}
	t.Fatalf("node %d lists no queue %s", i, queue)
	return queueInfo{}
}

// TestClusterNodeKilledUnderLoad kills a node of a three-node RabbitMQ 4.0
// cluster with SIGKILL under a busy consumer and two publishers (with
// confirms) of a quorum queue of three members, whose leader is on node 1
// while the clients are connected to node 2:
//
//   - the quorum leader's node: the queue elects a new leader; the clients,
//     whose connections live, carry on;
//   - the clients' node: every connection is lost and moves to the next
//     node of the URL; the queue's leader is untouched.
//
// Either way every confirmed message is consumed, duplicates are at most
// the deliveries unacked on the channels that were lost, and the killed
// node is started again and rejoins before the next case.
func TestClusterNodeKilledUnderLoad(t *testing.T) {
	c := clusterUnderTest(t)
	for _, tc := range []struct {
		name string
		kill int
	}{
		{"quorum leader's node", 1},
		{"the clients' node", 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Cleanup(func() { c.restore(t) })
			run := busyThroughFaultAt(t, c.url(t, 2, 3, 1), func(name string) {
				// The queue was declared by clients on node 2 (leader
				// there, client-local); move its leader to node 1 so that
				// leader and clients are apart.
				ctlAt(t, c.name(1), "eval", fmt.Sprintf(
					`{ok, Q} = rabbit_amqqueue:lookup(rabbit_misc:r(<<"/">>, queue, <<"%s">>)), rabbit_quorum_queue:transfer_leadership(Q, 'rabbitc1@localhost').`, name))
				testenv.WaitFor(t, 30*time.Second, "the queue's leader to be on node 1 with 3 members", func() bool {
					q := c.queue(t, 1, name)
					return q.Leader == c.name(1) && len(q.Members) == 3
				})
				if n := strings.Count(ctlAt(t, c.name(2), "list_connections", "client_properties"), name); n != 3 {
					t.Fatalf("node 2 has %d of the clients' 3 connections", n)
				}
				c.kill(t, tc.kill)
			})
			t.Logf("cluster fault %q: confirmed %d, consumed %d deliveries (every confirmed one), duplicates %d, first message published after the kill consumed %v after it",
				tc.name, run.confirmed, run.consumed, run.dups, run.resumed.Round(time.Millisecond))
		})
	}
}
