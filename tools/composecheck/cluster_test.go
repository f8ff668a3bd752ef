package composecheck_test

import (
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/compose-spec/compose-go/v2/types"
)

// The profile "cluster" of docker-compose.yml starts the optional brokers
// of make test-rabbit4 and make test-cluster (integration/brokers.sh up
// rabbitmq4, rabbitmq-cluster, kafka-cluster) on the same ports, and its
// Kafka nodes run with every setting of integration/config/
// kafka-cluster.properties that is not a node's own address or folder.

// clusterServices are the services of the profile.
var clusterServices = []string{"kafkac1", "kafkac2", "kafkac3", "rabbitc1", "rabbitc2", "rabbitc3", "rabbitmq4"}

// kafkaClusterNodeOnly are the properties of kafka-cluster.properties that
// name a node's own addresses or folder: in Docker each node has its
// container's name and an internal listener instead.
var kafkaClusterNodeOnly = []string{
	"node.id", "controller.quorum.voters", "listeners", "advertised.listeners",
	"inter.broker.listener.name", "listener.security.protocol.map", "log.dirs",
}

// clusterMismatches lists every way the profile "cluster" of p differs
// from what brokers.sh (sh, its text) and kafka-cluster.properties (props)
// start.
func clusterMismatches(p *types.Project, sh string, props map[string]string) []string {
	var bad []string
	add := func(format string, args ...any) { bad = append(bad, fmt.Sprintf(format, args...)) }
	for _, name := range clusterServices {
		s, ok := p.Services[name]
		if !ok {
			add("profile cluster: no service %s", name)
			continue
		}
		if !slices.Equal(s.Profiles, []string{"cluster"}) {
			add("%s: profiles %v, want [cluster] (make test starts none of them)", name, s.Profiles)
		}
	}
	published := func(name string) []string {
		var ps []string
		for _, port := range p.Services[name].Ports {
			ps = append(ps, port.HostIP+":"+port.Published+"->"+strconv.Itoa(int(port.Target)))
		}
		return ps
	}
	// rabbitmq4: brokers.sh's ports for AMQP and amqps.
	r4 := regexp.MustCompile(`(?m)^RABBIT4_PORT=(\d+)`).FindStringSubmatch(sh)
	r4tls := regexp.MustCompile(`(?m)^RABBIT4_TLS_PORT=(\d+)`).FindStringSubmatch(sh)
	if r4 == nil || r4tls == nil {
		add("brokers.sh: no RABBIT4_PORT or RABBIT4_TLS_PORT")
	} else if got, want := published("rabbitmq4"), []string{"127.0.0.1:" + r4[1] + "->5672", "127.0.0.1:" + r4tls[1] + "->5671"}; !slices.Equal(got, want) {
		add("rabbitmq4: ports %v, want %v (brokers.sh)", got, want)
	}
	if img := p.Services["rabbitmq4"].Image; !strings.HasPrefix(img, "rabbitmq:4.0") {
		add("rabbitmq4: image %q, want RabbitMQ 4.0 (make test-rabbit4 asks for 4.0)", img)
	}
	// The RabbitMQ cluster: node N on 5690+N, as brokers.sh's nodes, all
	// named in the peer discovery of the configuration they mount.
	for n := 1; n <= 3; n++ {
		name := fmt.Sprintf("rabbitc%d", n)
		s := p.Services[name]
		if got, want := published(name), []string{fmt.Sprintf("127.0.0.1:%d->5672", 5690+n)}; !slices.Equal(got, want) {
			add("%s: ports %v, want %v (brokers.sh: listeners.tcp.1 = 127.0.0.1:$((5690 + n)))", name, got, want)
		}
		if s.Hostname != name {
			add("%s: hostname %q, want %q (its node is rabbit@ its hostname)", name, s.Hostname, name)
		}
		if !strings.HasPrefix(s.Image, "rabbitmq:4.0") {
			add("%s: image %q, want RabbitMQ 4.0", name, s.Image)
		}
		conf := mountOf(s, "/etc/rabbitmq/conf.d/30-ferry.conf")
		b, err := os.ReadFile(conf)
		if err != nil {
			add("%s: its configuration: %v", name, err)
			continue
		}
		for m := 1; m <= 3; m++ {
			if w := fmt.Sprintf("cluster_formation.classic_config.nodes.%d = rabbit@rabbitc%d", m, m); !strings.Contains(string(b), w) {
				add("%s: %s has no %q", name, filepath.Base(conf), w)
			}
		}
	}
	// The Kafka cluster: node N on 19090+N, as kafka-cluster.properties'
	// listeners, a voter of the three, with every other setting.
	if !strings.Contains(props["listeners"], "PLAINTEXT://127.0.0.1:1909@N@") {
		add("kafka-cluster.properties: listeners %q, the check expects node N on 1909N", props["listeners"])
	}
	for n := 1; n <= 3; n++ {
		name := fmt.Sprintf("kafkac%d", n)
		s := p.Services[name]
		port := strconv.Itoa(19090 + n)
		if got, want := published(name), []string{"127.0.0.1:" + port + "->" + port}; !slices.Equal(got, want) {
			add("%s: ports %v, want %v", name, got, want)
		}
		if got := env(s, "KAFKA_NODE_ID"); got != strconv.Itoa(n) {
			add("%s: KAFKA_NODE_ID %q, want %d", name, got, n)
		}
		if got, want := env(s, "KAFKA_ADVERTISED_LISTENERS"), "PLAINTEXT://127.0.0.1:"+port; !strings.HasPrefix(got, want+",") {
			add("%s: KAFKA_ADVERTISED_LISTENERS %q, want clients told %s", name, got, want)
		}
		if got, want := env(s, "KAFKA_CONTROLLER_QUORUM_VOTERS"), "1@kafkac1:9093,2@kafkac2:9093,3@kafkac3:9093"; got != want {
			add("%s: KAFKA_CONTROLLER_QUORUM_VOTERS %q, want %q", name, got, want)
		}
		if got := env(s, "CLUSTER_ID"); got == "" || got != env(p.Services["kafkac1"], "CLUSTER_ID") {
			add("%s: CLUSTER_ID %q, want one the three nodes share", name, got)
		}
		for _, prop := range slices.Sorted(maps.Keys(props)) {
			if slices.Contains(kafkaClusterNodeOnly, prop) {
				continue
			}
			if got := env(s, composeEnvOfProperty(prop)); got != props[prop] {
				add("%s: %s=%q, kafka-cluster.properties has %s=%s", name, composeEnvOfProperty(prop), got, prop, props[prop])
			}
		}
	}
	return bad
}

// readProperties reads a Java properties file of key=value lines.
func readProperties(text string) map[string]string {
	m := map[string]string{}
	for _, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(line)
		if k, v, ok := strings.Cut(line, "="); ok && !strings.HasPrefix(line, "#") {
			m[strings.TrimSpace(k)] = strings.TrimSpace(v)
		}
	}
	return m
}

// TestDockerComposeClusterProfileMatchesBrokersSh: the profile loads, and
// starts the optional brokers where brokers.sh starts them, with the Kafka
// cluster's settings.
func TestDockerComposeClusterProfileMatchesBrokersSh(t *testing.T) {
	t.Parallel()
	root := repoRoot(t)
	p, err := loadCompose(t.Context(), root, filepath.Join(root, "docker-compose.yml"), "cluster")
	if err != nil {
		t.Fatalf("docker-compose.yml with the profile cluster does not load: %v", err)
	}
	props := readProperties(readFile(t, "integration/config/kafka-cluster.properties"))
	for _, m := range clusterMismatches(p, readFile(t, "integration/brokers.sh"), props) {
		t.Error(m)
	}
}

// The check above fails a profile whose Kafka node lacks a setting of the
// native cluster, or publishes a RabbitMQ node on another port.
func TestDockerComposeClusterCheckCatchesDrift(t *testing.T) {
	t.Parallel()
	root := repoRoot(t)
	orig := readFile(t, "docker-compose.yml")
	sh := readFile(t, "integration/brokers.sh")
	props := readProperties(readFile(t, "integration/config/kafka-cluster.properties"))
	for _, c := range []struct{ name, old, new, want string }{
		{"min ISR", "KAFKA_MIN_INSYNC_REPLICAS: 2", "KAFKA_MIN_INSYNC_REPLICAS: 1", "KAFKA_MIN_INSYNC_REPLICAS"},
		{"RabbitMQ node port", `"127.0.0.1:5692:5672"`, `"127.0.0.1:5699:5672"`, "rabbitc2: ports"},
		{"Kafka node port", `"127.0.0.1:19093:19093"`, `"127.0.0.1:19094:19093"`, "kafkac3: ports"},
	} {
		t.Run(c.name, func(t *testing.T) {
			if !strings.Contains(orig, c.old) {
				t.Fatalf("docker-compose.yml has no %q to change", c.old)
			}
			f := filepath.Join(t.TempDir(), "docker-compose.yml")
			if err := os.WriteFile(f, []byte(strings.Replace(orig, c.old, c.new, 1)), 0o644); err != nil {
				t.Fatal(err)
			}
			p, err := loadCompose(t.Context(), root, f, "cluster")
			if err != nil {
				t.Fatal(err)
			}
			bad := clusterMismatches(p, sh, props)
			if !slices.ContainsFunc(bad, func(m string) bool { return strings.Contains(m, c.want) }) {
				t.Fatalf("changing %s: mismatches %q, want one naming %s", c.name, bad, c.want)
			}
		})
	}
}
