package integration_test

import (
	"context"
	"fmt"
	"maps"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/compose-spec/compose-go/v2/cli"
	"github.com/compose-spec/compose-go/v2/types"

	"github.com/ferrymq/ferry/internal/testenv"
)

// These tests check docker-compose.yml without Docker: the Compose
// specification's own loader (compose-go, which docker compose is built on)
// must accept it, and what it starts must be what integration/brokers.sh
// starts and what internal/testenv (and so ferrytest) connects to: the same
// services, on the same loopback ports, with the same credentials, at the
// same versions where both name one, and Kafka with the same settings.

// repoRoot is the repository's root, the folder above this package.
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	return root
}

func readFile(t *testing.T, rel string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot(t), rel))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// loadCompose loads a compose file with compose-go, as docker compose would,
// from the repository's root, without the process environment.
func loadCompose(ctx context.Context, root, file string) (*types.Project, error) {
	opts, err := cli.NewProjectOptions([]string{file},
		cli.WithWorkingDirectory(root),
		cli.WithEnv(nil),
		cli.WithResolvedPaths(true),
	)
	if err != nil {
		return nil, fmt.Errorf("compose options: %w", err)
	}
	p, err := opts.LoadProject(ctx)
	if err != nil {
		return nil, fmt.Errorf("load %s: %w", file, err)
	}
	return p, nil
}

// native is what brokers.sh and the files it reads say.
type native struct {
	services     []string          // SERVICES=(...)
	ports        map[string]string // port_of: service -> client port
	scramUser    string            // KAFKA_SCRAM_USER
	scramPass    string            // KAFKA_SCRAM_PASSWORD
	pgRole       string            // create role R ... password 'P'
	pgPassword   string
	pgDatabase   string            // create database D
	rabbitUser   string            // rabbitmq.conf default_user
	rabbitPass   string            // rabbitmq.conf default_pass
	kafka        map[string]string // kafka-server.properties
	kafkaVersion string            // integration/kafka/pom.xml
	elasticMQ    string            // integration/elasticmq/pom.xml
}

func must1(t *testing.T, re, s, what string) string {
	t.Helper()
	m := regexp.MustCompile(re).FindStringSubmatch(s)
	if m == nil {
		t.Fatalf("%s: no match for %s", what, re)
	}
	return m[1]
}

func readNative(t *testing.T) native {
	t.Helper()
	sh := readFile(t, "integration/brokers.sh")
	n := native{ports: map[string]string{}, kafka: map[string]string{}}
	n.services = strings.Fields(must1(t, `(?m)^SERVICES=\(([^)]*)\)`, sh, "brokers.sh SERVICES"))
	portOf := must1(t, `(?s)\nport_of\(\) \{(.*?)\n\}`, sh, "brokers.sh port_of")
	for _, m := range regexp.MustCompile(`(\w+)\) echo (\d+) ;;`).FindAllStringSubmatch(portOf, -1) {
		n.ports[m[1]] = m[2]
	}
	n.scramUser = must1(t, `(?m)^KAFKA_SCRAM_USER=(\S+)`, sh, "brokers.sh KAFKA_SCRAM_USER")
	n.scramPass = must1(t, `(?m)^KAFKA_SCRAM_PASSWORD=(\S+)`, sh, "brokers.sh KAFKA_SCRAM_PASSWORD")
	role := regexp.MustCompile(`create role (\w+) login [^']*password '([^']*)'`).FindStringSubmatch(sh)
	if role == nil {
		t.Fatal("brokers.sh creates no PostgreSQL role with a password")
	}
	n.pgRole, n.pgPassword = role[1], role[2]
	n.pgDatabase = must1(t, `create database (\w+)`, sh, "brokers.sh create database")

	conf := readFile(t, "integration/config/rabbitmq.conf")
	n.rabbitUser = must1(t, `(?m)^default_user\s*=\s*(\S+)`, conf, "rabbitmq.conf default_user")
	n.rabbitPass = must1(t, `(?m)^default_pass\s*=\s*(\S+)`, conf, "rabbitmq.conf default_pass")

	for _, line := range strings.Split(readFile(t, "integration/config/kafka-server.properties"), "\n") {
		line = strings.TrimSpace(line)
		if k, v, ok := strings.Cut(line, "="); ok && !strings.HasPrefix(line, "#") {
			n.kafka[strings.TrimSpace(k)] = strings.TrimSpace(v)
		}
	}
	n.kafkaVersion = must1(t, `<kafka.version>([^<]+)</kafka.version>`, readFile(t, "integration/kafka/pom.xml"), "kafka pom")
	n.elasticMQ = must1(t, `<elasticmq.version>([^<]+)</elasticmq.version>`, readFile(t, "integration/elasticmq/pom.xml"), "elasticmq pom")
	return n
}

// kafkaNativeOnly are the settings of kafka-server.properties that the
// container sets its own way: its listeners inside the container, the
// state folder, and the SASL_SSL listener (whose certificates brokers.sh
// makes; docker-compose.yml has none, and tests of it skip, or fail under
// FERRY_REQUIRE_BROKERS=1).
var kafkaNativeOnly = []string{
	"listeners", "advertised.listeners", "controller.quorum.bootstrap.servers", "log.dirs",
	"listener.security.protocol.map", "sasl.enabled.mechanisms",
	"listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config",
	"ssl.keystore.type", "ssl.keystore.location", "ssl.client.auth",
}

// composeEnvOfProperty is the environment variable through which the
// apache/kafka image sets a server property.
func composeEnvOfProperty(p string) string {
	return "KAFKA_" + strings.ToUpper(strings.NewReplacer(".", "_", "-", "__").Replace(p))
}

func env(s types.ServiceConfig, name string) string {
	if v := s.Environment[name]; v != nil {
		return *v
	}
	return ""
}

func userPass(t *testing.T, raw string) (user, pass, path string) {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	pass, _ = u.User.Password()
	return u.User.Username(), pass, strings.TrimPrefix(u.Path, "/")
}

// composeMismatches lists every way p differs from what brokers.sh (n) and
// internal/testenv's defaults expect.
func composeMismatches(t *testing.T, p *types.Project, n native) []string {
	t.Helper()
	var bad []string
	add := func(format string, args ...any) { bad = append(bad, fmt.Sprintf(format, args...)) }

	// Services: one per service brokers.sh starts and testenv knows.
	var want []string
	for _, s := range testenv.Services {
		want = append(want, string(s))
	}
	if got := slices.Sorted(maps.Keys(p.Services)); !slices.Equal(got, slices.Sorted(slices.Values(want))) {
		add("services %v, testenv.Services %v", got, want)
	}
	if !slices.Equal(slices.Sorted(slices.Values(n.services)), slices.Sorted(slices.Values(want))) {
		add("brokers.sh SERVICES %v, testenv.Services %v", n.services, want)
	}

	// Ports: each service's client port published on 127.0.0.1 only, the
	// same port inside, and the port testenv dials by default and brokers.sh
	// waits on.
	for _, svc := range testenv.Services {
		s, ok := p.Services[string(svc)]
		if !ok {
			continue
		}
		addr, err := testenv.DefaultAddr(svc)
		if err != nil {
			t.Fatal(err)
		}
		host, port, err := net.SplitHostPort(addr)
		if err != nil {
			t.Fatal(err)
		}
		if n.ports[string(svc)] != port {
			add("%s: brokers.sh port_of says %q, testenv's default address is %s", svc, n.ports[string(svc)], addr)
		}
		var pubs []string
		for _, pc := range s.Ports {
			pubs = append(pubs, fmt.Sprintf("%s:%s:%d", pc.HostIP, pc.Published, pc.Target))
		}
		if wantPub := host + ":" + port + ":" + port; !slices.Equal(pubs, []string{wantPub}) {
			add("%s: ports %v, want [%s] (testenv's default address %s, loopback only)", svc, pubs, wantPub, addr)
		}
	}

	// Credentials.
	if s, ok := p.Services[string(testenv.RabbitMQ)]; ok {
		user, pass, _ := userPass(t, testenv.DefaultAMQPURL)
		if env(s, "RABBITMQ_DEFAULT_USER") != user || env(s, "RABBITMQ_DEFAULT_PASS") != pass {
			add("rabbitmq: user %q password %q, testenv.DefaultAMQPURL has %q %q",
				env(s, "RABBITMQ_DEFAULT_USER"), env(s, "RABBITMQ_DEFAULT_PASS"), user, pass)
		}
		if n.rabbitUser != user || n.rabbitPass != pass {
			add("rabbitmq.conf: user %q password %q, testenv.DefaultAMQPURL has %q %q", n.rabbitUser, n.rabbitPass, user, pass)
		}
	}
	if s, ok := p.Services[string(testenv.Postgres)]; ok {
		user, pass, db := userPass(t, testenv.DefaultPostgresURL)
		if env(s, "POSTGRES_USER") != user || env(s, "POSTGRES_PASSWORD") != pass || env(s, "POSTGRES_DB") != db {
			add("postgres: user %q password %q database %q, testenv.DefaultPostgresURL has %q %q %q",
				env(s, "POSTGRES_USER"), env(s, "POSTGRES_PASSWORD"), env(s, "POSTGRES_DB"), user, pass, db)
		}
		if n.pgRole != user || n.pgPassword != pass || n.pgDatabase != db {
			add("brokers.sh: PostgreSQL role %q password %q database %q, testenv.DefaultPostgresURL has %q %q %q",
				n.pgRole, n.pgPassword, n.pgDatabase, user, pass, db)
		}
	}
	if n.scramUser != testenv.KafkaSCRAMUser || n.scramPass != testenv.KafkaSCRAMPassword {
		add("brokers.sh: Kafka SCRAM user %q password %q, testenv has %q %q", n.scramUser, n.scramPass, testenv.KafkaSCRAMUser, testenv.KafkaSCRAMPassword)
	}

	// Kafka: the version Maven brings, what clients are told to dial, and
	// every setting of the native broker.
	if s, ok := p.Services[string(testenv.Kafka)]; ok {
		if want := "apache/kafka:" + n.kafkaVersion; s.Image != want {
			add("kafka: image %q, brokers.sh runs %s (integration/kafka/pom.xml)", s.Image, want)
		}
		if got, want := env(s, "KAFKA_ADVERTISED_LISTENERS"), "PLAINTEXT://"+testenv.DefaultKafkaBrokers; got != want {
			add("kafka: advertised listeners %q, testenv dials %s", got, want)
		}
		for _, prop := range slices.Sorted(maps.Keys(n.kafka)) {
			v := n.kafka[prop]
			if slices.Contains(kafkaNativeOnly, prop) {
				continue
			}
			if got := env(s, composeEnvOfProperty(prop)); got != v {
				add("kafka: %s=%q, kafka-server.properties has %s=%s", composeEnvOfProperty(prop), got, prop, v)
			}
		}
	}

	// SQS: ElasticMQ at the version Maven brings, with a configuration that
	// serves testenv's port and region.
	if s, ok := p.Services[string(testenv.SQS)]; ok {
		if want := "softwaremill/elasticmq-native:" + n.elasticMQ; s.Image != want {
			add("sqs: image %q, brokers.sh runs elasticmq %s (integration/elasticmq/pom.xml)", s.Image, n.elasticMQ)
		}
		addr, _ := testenv.DefaultAddr(testenv.SQS)
		_, port, _ := net.SplitHostPort(addr)
		found := false
		for _, v := range s.Volumes {
			if v.Target != "/opt/elasticmq.conf" {
				continue
			}
			found = true
			conf, err := os.ReadFile(v.Source)
			if err != nil {
				add("sqs: its configuration: %v", err)
				continue
			}
			for _, w := range []string{"port = " + port, "bind-port = " + port, "region = " + testenv.DefaultSQSRegion} {
				if !strings.Contains(string(conf), w) {
					add("sqs: %s has no %q (testenv's %s and %s)", filepath.Base(v.Source), w, testenv.DefaultSQSEndpoint, testenv.DefaultSQSRegion)
				}
			}
		}
		if !found {
			add("sqs: no configuration mounted at /opt/elasticmq.conf")
		}
	}

	// Every file mounted into a container is in the repository.
	for _, name := range slices.Sorted(maps.Keys(p.Services)) {
		for _, v := range p.Services[name].Volumes {
			if v.Type == types.VolumeTypeBind {
				if _, err := os.Stat(v.Source); err != nil {
					add("%s: mounts %s: %v", name, v.Source, err)
				}
			}
		}
	}
	return bad
}

// TestDockerComposeMatchesBrokersSh loads docker-compose.yml with compose-go
// and requires it to start what brokers.sh starts, where testenv looks.
func TestDockerComposeMatchesBrokersSh(t *testing.T) {
	t.Parallel()
	root := repoRoot(t)
	p, err := loadCompose(t.Context(), root, filepath.Join(root, "docker-compose.yml"))
	if err != nil {
		t.Fatalf("docker-compose.yml does not load: %v", err)
	}
	for _, m := range composeMismatches(t, p, readNative(t)) {
		t.Error(m)
	}
}

// The check above fails a compose file that is invalid, or that differs in
// a port, a credential or a Kafka setting.
func TestDockerComposeCheckCatchesDrift(t *testing.T) {
	t.Parallel()
	root := repoRoot(t)
	orig := readFile(t, "docker-compose.yml")
	n := readNative(t)
	cases := []struct {
		name, old, new string
		invalid        bool
		want           string // in a mismatch
	}{
		{name: "unknown key", old: "    image: redis:7\n", new: "    image: redis:7\n    imagee: redis:7\n", invalid: true},
		{name: "bad port", old: `ports: ["127.0.0.1:6379:6379"]`, new: `ports: ["127.0.0.1:6379:notaport"]`, invalid: true},
		{name: "kafka port", old: `ports: ["127.0.0.1:9092:9092"]`, new: `ports: ["127.0.0.1:9093:9092"]`, want: "kafka: ports"},
		{name: "all interfaces", old: `ports: ["127.0.0.1:5432:5432"]`, new: `ports: ["5432:5432"]`, want: "postgres: ports"},
		{name: "rabbit password", old: "RABBITMQ_DEFAULT_PASS: guest", new: "RABBITMQ_DEFAULT_PASS: secret", want: "rabbitmq: user"},
		{name: "postgres db", old: "POSTGRES_DB: ferry", new: "POSTGRES_DB: app", want: "postgres: user"},
		{name: "kafka setting", old: `KAFKA_AUTO_CREATE_TOPICS_ENABLE: "false"`, new: `KAFKA_AUTO_CREATE_TOPICS_ENABLE: "true"`, want: "auto.create.topics.enable"},
		{name: "kafka version", old: "image: apache/kafka:" + n.kafkaVersion, new: "image: apache/kafka:3.9.0", want: "kafka: image"},
		{name: "service gone", old: "\n  redis:\n", new: "\n  valkey:\n", want: "services"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if !strings.Contains(orig, c.old) {
				t.Fatalf("docker-compose.yml has no %q to change", c.old)
			}
			file := filepath.Join(t.TempDir(), "docker-compose.yml")
			if err := os.WriteFile(file, []byte(strings.Replace(orig, c.old, c.new, 1)), 0o644); err != nil {
				t.Fatal(err)
			}
			p, err := loadCompose(t.Context(), root, file)
			if c.invalid {
				if err == nil {
					t.Fatal("compose-go loaded it")
				}
				t.Log(err)
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			bad := composeMismatches(t, p, n)
			if !slices.ContainsFunc(bad, func(m string) bool { return strings.Contains(m, c.want) }) {
				t.Fatalf("no mismatch naming %q among %q", c.want, bad)
			}
		})
	}
}
