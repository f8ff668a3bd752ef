package composecheck_test

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"maps"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
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
// same versions where both name one, Kafka with the same settings and its
// SASL_SSL listener, RabbitMQ with its amqps listener and its tenant user
// and vhost, and their certificates where the tests look for them. The
// script that makes those certificates runs here too, with this machine's
// openssl. (No test here starts a container: that needs a Docker engine.)

// repoRoot is the repository's root, two folders above this package.
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", ".."))
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
// from the repository's root, without the process environment, with the
// given profiles active.
func loadCompose(ctx context.Context, root, file string, profiles ...string) (*types.Project, error) {
	opts, err := cli.NewProjectOptions([]string{file},
		cli.WithWorkingDirectory(root),
		cli.WithEnv(nil),
		cli.WithResolvedPaths(true),
		cli.WithProfiles(profiles),
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
	services     []string            // SERVICES=(...)
	ports        map[string]string   // port_of: service -> client port
	allPorts     map[string][]string // ports_of: service -> every port it listens on
	scramUser    string              // KAFKA_SCRAM_USER
	scramPass    string              // KAFKA_SCRAM_PASSWORD
	pgRole       string              // create role R ... password 'P'
	pgPassword   string
	pgDatabase   string            // create database D
	rabbitUser   string            // rabbitmq.conf default_user
	rabbitPass   string            // rabbitmq.conf default_pass
	amqpsPort    string            // rabbitmq.conf listeners.ssl.default
	tenant       string            // RABBIT_TENANT: a user and a vhost of that name
	tenantPass   string            // RABBIT_TENANT_PASSWORD
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
	n := native{ports: map[string]string{}, allPorts: map[string][]string{}}
	n.services = strings.Fields(must1(t, `(?m)^SERVICES=\(([^)]*)\)`, sh, "brokers.sh SERVICES"))
	portOf := must1(t, `(?s)\nport_of\(\) \{(.*?)\n\}`, sh, "brokers.sh port_of")
	for _, m := range regexp.MustCompile(`(\w+)\) echo (\d+) ;;`).FindAllStringSubmatch(portOf, -1) {
		n.ports[m[1]] = m[2]
	}
	portsOf := must1(t, `(?s)\nports_of\(\) \{(.*?)\n\}`, sh, "brokers.sh ports_of")
	for _, m := range regexp.MustCompile(`(\w+)\) echo ([\d ]+) ;;`).FindAllStringSubmatch(portsOf, -1) {
		n.allPorts[m[1]] = strings.Fields(m[2])
	}
	for svc, port := range n.ports {
		if n.allPorts[svc] == nil {
			n.allPorts[svc] = []string{port} // ports_of falls back to port_of
		}
	}
	n.tenant = must1(t, `(?m)^RABBIT_TENANT=(\S+)`, sh, "brokers.sh RABBIT_TENANT")
	n.tenantPass = must1(t, `(?m)^RABBIT_TENANT_PASSWORD=(\S+)`, sh, "brokers.sh RABBIT_TENANT_PASSWORD")
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
	n.amqpsPort = must1(t, `(?m)^listeners\.ssl\.default\s*=\s*\S*:(\d+)$`, conf, "rabbitmq.conf listeners.ssl.default")

	n.kafka = readProperties(readFile(t, "integration/config/kafka-server.properties"))
	n.kafkaVersion = must1(t, `<kafka.version>([^<]+)</kafka.version>`, readFile(t, "integration/kafka/pom.xml"), "kafka pom")
	n.elasticMQ = must1(t, `<elasticmq.version>([^<]+)</elasticmq.version>`, readFile(t, "integration/elasticmq/pom.xml"), "elasticmq pom")
	return n
}

// kafkaNativeOnly are the settings of kafka-server.properties that the
// container sets its own way: its listeners inside the container, the
// state folder, and the keystore of the SASL_SSL listener (a PKCS#12 file
// with a password in the container, which the apache/kafka image's start
// script requires; a PEM file natively). compareKafkaTLS checks those.
var kafkaNativeOnly = []string{
	"listeners", "advertised.listeners", "controller.quorum.bootstrap.servers", "log.dirs",
	"ssl.keystore.type", "ssl.keystore.location",
}

// composeEnvOfProperty is the environment variable through which the
// apache/kafka image sets a server property: its start script reads "_" as
// ".", "__" as "_" and "___" as "-".
func composeEnvOfProperty(p string) string {
	return "KAFKA_" + strings.ToUpper(strings.NewReplacer("_", "__", "-", "___", ".", "_").Replace(p))
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

	// Services: one per service brokers.sh starts and testenv knows, and
	// one-shot helpers that those wait for.
	var want []string
	for _, s := range testenv.Services {
		want = append(want, string(s))
	}
	var brokers []string
	for _, name := range slices.Sorted(maps.Keys(p.Services)) {
		if !slices.Contains(composeHelpers, name) {
			brokers = append(brokers, name)
		}
	}
	if !slices.Equal(brokers, slices.Sorted(slices.Values(want))) {
		add("services %v (besides the helpers %v), testenv.Services %v", brokers, composeHelpers, want)
	}
	for _, h := range composeHelpers {
		s, ok := p.Services[h]
		if !ok {
			add("no helper service %s", h)
			continue
		}
		if s.Restart != "no" {
			add("%s: restart %q, want \"no\" (it runs once)", h, s.Restart)
		}
		// docker compose up --wait fails on a service that exited unless a
		// running one waits for it to complete.
		adopted := false
		for _, b := range brokers {
			if d, ok := p.Services[b].DependsOn[h]; ok && d.Condition == types.ServiceConditionCompletedSuccessfully {
				adopted = true
			}
		}
		if !adopted {
			add("%s: no service depends on it with condition service_completed_successfully (up --wait would fail when it exits)", h)
		}
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
		wantPorts := []string{port}
		switch svc {
		case testenv.RabbitMQ:
			wantPorts = append(wantPorts, n.amqpsPort) // amqps
		case testenv.Kafka:
			_, sasl, err := net.SplitHostPort(testenv.DefaultKafkaSASLBrokers)
			if err != nil {
				t.Fatal(err)
			}
			wantPorts = append(wantPorts, sasl) // SASL_SSL
		}
		var wantPubs []string
		for _, wp := range wantPorts {
			wantPubs = append(wantPubs, host+":"+wp+":"+wp)
			if !slices.Contains(n.allPorts[string(svc)], wp) {
				add("%s: port %s is not among brokers.sh's ports_of %v", svc, wp, n.allPorts[string(svc)])
			}
		}
		if !slices.Equal(slices.Sorted(slices.Values(pubs)), slices.Sorted(slices.Values(wantPubs))) {
			add("%s: ports %v, want %v (testenv's default address %s and the native listeners, loopback only)", svc, pubs, wantPubs, addr)
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
		if got, want := env(s, "KAFKA_ADVERTISED_LISTENERS"), "PLAINTEXT://"+testenv.DefaultKafkaBrokers+",SASL_SSL://"+testenv.DefaultKafkaSASLBrokers; got != want {
			add("kafka: advertised listeners %q, want %q (testenv dials them)", got, want)
		}
		if !strings.Contains(n.kafka["listeners"], "SASL_SSL://127.0.0.1:"+strings.TrimPrefix(testenv.DefaultKafkaSASLBrokers, "127.0.0.1:")) {
			add("kafka-server.properties: listeners %q lack testenv's SASL_SSL address %s", n.kafka["listeners"], testenv.DefaultKafkaSASLBrokers)
		}
		bad = append(bad, kafkaSASLMismatches(t, p, s, n)...)
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

	if s, ok := p.Services[string(testenv.RabbitMQ)]; ok {
		bad = append(bad, rabbitExtrasMismatches(t, p, s, n)...)
	}

	// Every file mounted into a container is in the repository, or made in
	// the state folder by the helper certs before the brokers start.
	state := stateDir(p)
	for _, name := range slices.Sorted(maps.Keys(p.Services)) {
		for _, v := range p.Services[name].Volumes {
			if v.Type != types.VolumeTypeBind || state != "" && (v.Source == state || strings.HasPrefix(v.Source, state+string(filepath.Separator))) {
				continue
			}
			if _, err := os.Stat(v.Source); err != nil {
				add("%s: mounts %s: %v", name, v.Source, err)
			}
		}
	}
	return bad
}

// composeHelpers are the one-shot services of docker-compose.yml: they
// prepare the brokers and exit.
var composeHelpers = []string{"certs"}

// mountOf returns the host folder or file mounted at target in s, or "".
func mountOf(s types.ServiceConfig, target string) string {
	for _, v := range s.Volumes {
		if v.Target == target {
			return v.Source
		}
	}
	return ""
}

// stateDir is the state folder the helper certs writes into (as seen from
// the host), or "".
func stateDir(p *types.Project) string {
	if s, ok := p.Services["certs"]; ok {
		for i, a := range s.Entrypoint {
			if strings.HasSuffix(a, "compose-certs.sh") && i+1 < len(s.Entrypoint) {
				return mountOf(s, s.Entrypoint[i+1])
			}
		}
	}
	return ""
}

// certsScript is what the helper certs makes: integration/config/compose-certs.sh.
const certsScript = "integration/config/compose-certs.sh"

// certsMismatches checks the helper certs: it runs certsScript on the
// state folder where testenv looks for the certificates by default.
func certsMismatches(t *testing.T, p *types.Project) []string {
	t.Helper()
	var bad []string
	s, ok := p.Services["certs"]
	if !ok {
		return []string{"no service certs"}
	}
	script := ""
	for _, v := range s.Volumes {
		if filepath.Base(v.Source) == filepath.Base(certsScript) {
			script = v.Source
			if !slices.Contains(s.Entrypoint, v.Target) {
				bad = append(bad, fmt.Sprintf("certs: its entrypoint %q does not run %s", s.Entrypoint, v.Target))
			}
		}
	}
	if script != filepath.Join(repoRoot(t), certsScript) {
		bad = append(bad, fmt.Sprintf("certs: mounts no %s (it mounts %v)", certsScript, s.Volumes))
	}
	// Loaded without FERRY_BROKERS_DIR, the certificates land where
	// testenv.KafkaCAFile (and rabbit's tests) look when it is unset.
	if got, want := stateDir(p), filepath.Join(repoRoot(t), ".brokers"); got != want {
		bad = append(bad, fmt.Sprintf("certs: writes into %q, the tests look in %s", got, want))
	}
	if want := filepath.Join(repoRoot(t), ".brokers", "kafka", "tls", "ca.pem"); os.Getenv(testenv.EnvKafkaCA) == "" && os.Getenv(testenv.EnvBrokersDir) == "" && testenv.KafkaCAFile() != want {
		bad = append(bad, fmt.Sprintf("testenv.KafkaCAFile() = %s, certs makes %s", testenv.KafkaCAFile(), want))
	}
	return bad
}

// kafkaSASLMismatches checks Kafka's SASL_SSL listener: its keystore comes
// from the state folder the helper certs fills, its SCRAM user is
// brokers.sh's, and so is the healthcheck's.
func kafkaSASLMismatches(t *testing.T, p *types.Project, s types.ServiceConfig, n native) []string {
	t.Helper()
	var bad []string
	add := func(format string, args ...any) { bad = append(bad, fmt.Sprintf(format, args...)) }
	const secrets = "/etc/kafka/secrets" // where the image's start script looks
	if got, want := mountOf(s, secrets), filepath.Join(stateDir(p), "kafka", "tls"); got != want {
		add("kafka: mounts %q at %s, want the state folder's %s", got, secrets, want)
	}
	if d, ok := s.DependsOn["certs"]; !ok || d.Condition != types.ServiceConditionCompletedSuccessfully {
		add("kafka: does not wait for certs to complete")
	}
	script := readFile(t, certsScript)
	for _, v := range []string{"KAFKA_SSL_KEYSTORE_FILENAME", "KAFKA_SSL_KEYSTORE_CREDENTIALS", "KAFKA_SSL_KEY_CREDENTIALS"} {
		if f := env(s, v); f == "" || !strings.Contains(script, `"$k/`+f+`"`) {
			add("kafka: %s=%q, which %s does not make", v, f, certsScript)
		}
	}
	if env(s, "KAFKA_SSL_KEYSTORE_TYPE") != "PKCS12" {
		add("kafka: KAFKA_SSL_KEYSTORE_TYPE=%q, want PKCS12 (what %s makes)", env(s, "KAFKA_SSL_KEYSTORE_TYPE"), certsScript)
	}
	// The SCRAM user the command adds.
	m := regexp.MustCompile(`--entity-name (\S+) --add-config 'SCRAM-SHA-512=\[password=([^\]]+)\]'`).FindStringSubmatch(strings.Join(s.Command, " "))
	if m == nil {
		add("kafka: its command adds no SCRAM-SHA-512 user (%q)", s.Command)
	} else if m[1] != n.scramUser || m[2] != n.scramPass {
		add("kafka: SCRAM user %q password %q, brokers.sh has %q %q", m[1], m[2], n.scramUser, n.scramPass)
	}
	// The healthcheck logs in as that user over TLS.
	if s.HealthCheck == nil || !strings.Contains(strings.Join(s.HealthCheck.Test, " "), "--bootstrap-server "+testenv.DefaultKafkaSASLBrokers+" --command-config /opt/ferry/sasl-client.properties") {
		add("kafka: the healthcheck does not ask the SASL_SSL listener")
	}
	if props := mountOf(s, "/opt/ferry/sasl-client.properties"); props == "" {
		add("kafka: mounts no /opt/ferry/sasl-client.properties")
	} else if b, err := os.ReadFile(props); err != nil {
		add("kafka: %v", err)
	} else {
		for _, w := range []string{
			"security.protocol=SASL_SSL", "sasl.mechanism=SCRAM-SHA-512",
			fmt.Sprintf(`username="%s" password="%s";`, n.scramUser, n.scramPass),
			"ssl.truststore.location=" + secrets + "/ca.pem",
		} {
			if !strings.Contains(string(b), w) {
				add("kafka: %s has no %q", filepath.Base(props), w)
			}
		}
	}
	return bad
}

// rabbitExtrasMismatches checks what brokers.sh adds to RabbitMQ: the
// amqps listener with the certificate of the state folder, and the tenant
// user and vhost, with the password brokers.sh gives them.
func rabbitExtrasMismatches(t *testing.T, p *types.Project, s types.ServiceConfig, n native) []string {
	t.Helper()
	var bad []string
	add := func(format string, args ...any) { bad = append(bad, fmt.Sprintf(format, args...)) }
	if d, ok := s.DependsOn["certs"]; !ok || d.Condition != types.ServiceConditionCompletedSuccessfully {
		add("rabbitmq: does not wait for certs to complete")
	}
	confFile := ""
	for _, v := range s.Volumes {
		if strings.HasPrefix(v.Target, "/etc/rabbitmq/conf.d/") {
			confFile = v.Source
		}
	}
	if confFile == "" {
		add("rabbitmq: mounts no configuration into /etc/rabbitmq/conf.d/")
		return bad
	}
	b, err := os.ReadFile(confFile)
	if err != nil {
		add("rabbitmq: %v", err)
		return bad
	}
	conf := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, "="); ok && !strings.HasPrefix(strings.TrimSpace(line), "#") {
			conf[strings.TrimSpace(k)] = strings.TrimSpace(v)
		}
	}
	if conf["listeners.ssl.default"] != n.amqpsPort {
		add("rabbitmq: %s listens for amqps on %q, rabbitmq.conf on %s", filepath.Base(confFile), conf["listeners.ssl.default"], n.amqpsPort)
	}
	tlsDir := filepath.Join(stateDir(p), "rabbitmq", "tls")
	for _, k := range []string{"ssl_options.certfile", "ssl_options.keyfile", "ssl_options.cacertfile"} {
		dir, file := filepath.Split(conf[k])
		if mountOf(s, filepath.Clean(dir)) != tlsDir {
			add("rabbitmq: %s=%q is not in a mount of the state folder's %s", k, conf[k], tlsDir)
		}
		if !strings.Contains(readFile(t, certsScript), `"$r/`+file+`"`) {
			add("rabbitmq: %s=%q, which %s does not make", k, conf[k], certsScript)
		}
	}
	defsFile := mountOf(s, conf["load_definitions"])
	if defsFile == "" {
		add("rabbitmq: load_definitions=%q is not mounted", conf["load_definitions"])
		return bad
	}
	raw, err := os.ReadFile(defsFile)
	if err != nil {
		add("rabbitmq: %v", err)
		return bad
	}
	var defs rabbitDefinitions
	if err := json.Unmarshal(raw, &defs); err != nil {
		add("rabbitmq: %s: %v", filepath.Base(defsFile), err)
		return bad
	}
	guest, guestPass, _ := userPass(t, testenv.DefaultAMQPURL)
	for user, pass := range map[string]string{guest: guestPass, n.tenant: n.tenantPass} {
		i := slices.IndexFunc(defs.Users, func(u rabbitUser) bool { return u.Name == user })
		if i < 0 {
			add("rabbitmq: %s has no user %s", filepath.Base(defsFile), user)
			continue
		}
		if u := defs.Users[i]; u.HashingAlgorithm != "rabbit_password_hashing_sha256" || !rabbitHashMatches(u.PasswordHash, pass) {
			add("rabbitmq: %s: user %s's password hash (%s) is not of the password %q", filepath.Base(defsFile), user, u.HashingAlgorithm, pass)
		}
	}
	if !slices.ContainsFunc(defs.Vhosts, func(v struct{ Name string }) bool { return v.Name == n.tenant }) {
		add("rabbitmq: %s has no vhost %s", filepath.Base(defsFile), n.tenant)
	}
	for _, want := range [][2]string{{guest, "/"}, {n.tenant, n.tenant}} {
		if !slices.ContainsFunc(defs.Permissions, func(pm rabbitPermission) bool {
			return pm.User == want[0] && pm.Vhost == want[1] && pm.Configure == ".*" && pm.Write == ".*" && pm.Read == ".*"
		}) {
			add("rabbitmq: %s does not let %s use the vhost %s", filepath.Base(defsFile), want[0], want[1])
		}
	}
	// RabbitMQ 3.13 is past community support: compose runs a 4.x, named
	// in docs/TESTING.md.
	if m := regexp.MustCompile(`^rabbitmq:(\d+)\.`).FindStringSubmatch(s.Image); m == nil || atoi(m[1]) < 4 {
		add("rabbitmq: image %q, want a 4.x", s.Image)
	}
	if !strings.Contains(readFile(t, "docs/TESTING.md"), "`"+s.Image+"`") {
		add("rabbitmq: docs/TESTING.md does not name the image %s that compose runs", s.Image)
	}
	return bad
}

func atoi(s string) int {
	n, err := strconv.Atoi(s)
	if err != nil {
		return -1
	}
	return n
}

// rabbitDefinitions is the part of a RabbitMQ definitions file the
// tests need.
type rabbitDefinitions struct {
	Users       []rabbitUser            `json:"users"`
	Vhosts      []struct{ Name string } `json:"vhosts"`
	Permissions []rabbitPermission      `json:"permissions"`
}

type rabbitUser struct {
	Name             string `json:"name"`
	PasswordHash     string `json:"password_hash"`
	HashingAlgorithm string `json:"hashing_algorithm"`
}

type rabbitPermission struct {
	User      string `json:"user"`
	Vhost     string `json:"vhost"`
	Configure string `json:"configure"`
	Write     string `json:"write"`
	Read      string `json:"read"`
}

// rabbitHashMatches reports whether hash is RabbitMQ's SHA-256 password
// hash of password: base64 of a 4-byte salt and SHA-256(salt, password).
func rabbitHashMatches(hash, password string) bool {
	b, err := base64.StdEncoding.DecodeString(hash)
	if err != nil || len(b) != 4+sha256.Size {
		return false
	}
	sum := sha256.Sum256(append(slices.Clone(b[:4]), password...))
	return string(b[4:]) == string(sum[:])
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
	for _, m := range certsMismatches(t, p) {
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
	// The definitions of RabbitMQ, with the tenant's password hash of
	// another password.
	wrongTenant := filepath.Join(t.TempDir(), "definitions.json")
	defs := readFile(t, "integration/config/rabbitmq-definitions.json")
	var d rabbitDefinitions
	if err := json.Unmarshal([]byte(defs), &d); err != nil {
		t.Fatal(err)
	}
	for _, u := range d.Users {
		if u.Name == n.tenant {
			other := sha256.Sum256([]byte("salt" + "another password"))
			defs = strings.Replace(defs, u.PasswordHash, base64.StdEncoding.EncodeToString(append([]byte("salt"), other[:]...)), 1)
		}
	}
	if err := os.WriteFile(wrongTenant, []byte(defs), 0o644); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name, old, new string
		invalid        bool
		want           string // in a mismatch
	}{
		{name: "unknown key", old: "    image: redis:7\n", new: "    image: redis:7\n    imagee: redis:7\n", invalid: true},
		{name: "bad port", old: `ports: ["127.0.0.1:6379:6379"]`, new: `ports: ["127.0.0.1:6379:notaport"]`, invalid: true},
		{name: "kafka port", old: `"127.0.0.1:9092:9092"`, new: `"127.0.0.1:9093:9092"`, want: "kafka: ports"},
		{name: "no SASL_SSL port", old: `, "127.0.0.1:9094:9094"]`, new: `]`, want: "kafka: ports"},
		{name: "no amqps port", old: `, "127.0.0.1:5671:5671"]`, new: `]`, want: "rabbitmq: ports"},
		{name: "all interfaces", old: `ports: ["127.0.0.1:5432:5432"]`, new: `ports: ["5432:5432"]`, want: "postgres: ports"},
		{name: "rabbit password", old: "RABBITMQ_DEFAULT_PASS: guest", new: "RABBITMQ_DEFAULT_PASS: secret", want: "rabbitmq: user"},
		{name: "postgres db", old: "POSTGRES_DB: ferry", new: "POSTGRES_DB: app", want: "postgres: user"},
		{name: "kafka setting", old: `KAFKA_AUTO_CREATE_TOPICS_ENABLE: "false"`, new: `KAFKA_AUTO_CREATE_TOPICS_ENABLE: "true"`, want: "auto.create.topics.enable"},
		{name: "kafka SASL mechanism", old: "KAFKA_SASL_ENABLED_MECHANISMS: SCRAM-SHA-512", new: "KAFKA_SASL_ENABLED_MECHANISMS: PLAIN", want: "sasl.enabled.mechanisms"},
		{name: "kafka JAAS under a wrong name", old: "KAFKA_LISTENER_NAME_SASL__SSL_SCRAM___SHA___512_SASL_JAAS_CONFIG", new: "KAFKA_LISTENER_NAME_SASL_SSL_SCRAM__SHA__512_SASL_JAAS_CONFIG", want: "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config"},
		{name: "kafka advertised", old: "KAFKA_ADVERTISED_LISTENERS: PLAINTEXT://127.0.0.1:9092,SASL_SSL://127.0.0.1:9094", new: "KAFKA_ADVERTISED_LISTENERS: PLAINTEXT://127.0.0.1:9092", want: "kafka: advertised listeners"},
		{name: "kafka SCRAM password", old: "[password=ferry-scram-test]", new: "[password=other]", want: "kafka: SCRAM user"},
		{name: "kafka keystore", old: "KAFKA_SSL_KEYSTORE_FILENAME: server.p12", new: "KAFKA_SSL_KEYSTORE_FILENAME: server.jks", want: "KAFKA_SSL_KEYSTORE_FILENAME"},
		{name: "kafka secrets elsewhere", old: "/kafka/tls:/etc/kafka/secrets:ro", new: "/kafka/certs:/etc/kafka/secrets:ro", want: "kafka: mounts"},
		{name: "kafka without certs", old: "    image: apache/kafka:" + n.kafkaVersion + " # the version brokers.sh runs from Maven Central\n    depends_on:\n      certs:\n        condition: service_completed_successfully\n",
			new: "    image: apache/kafka:" + n.kafkaVersion + "\n", want: "kafka: does not wait for certs"},
		{name: "certs not adopted", old: "        condition: service_completed_successfully", new: "        condition: service_started", want: "rabbitmq: does not wait for certs"},
		{name: "certs into a folder of its own", old: "${FERRY_BROKERS_DIR:-./.brokers}:/brokers", new: "./certs:/brokers", want: "certs: writes into"},
		{name: "rabbitmq 3.13", old: "    image: rabbitmq:4.1\n    depends_on:", new: "    image: rabbitmq:3.13\n    depends_on:", want: "rabbitmq: image"},
		{name: "rabbitmq without its extras", old: "      - ./integration/config/rabbitmq-docker.conf:/etc/rabbitmq/conf.d/30-ferry.conf:ro\n", new: "", want: "rabbitmq: mounts no configuration"},
		{name: "rabbitmq tenant password", old: "./integration/config/rabbitmq-definitions.json:", new: wrongTenant + ":", want: "user ferry-tenant's password hash"},
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
			bad := append(composeMismatches(t, p, n), certsMismatches(t, p)...)
			if !slices.ContainsFunc(bad, func(m string) bool { return strings.Contains(m, c.want) }) {
				t.Fatalf("no mismatch naming %q among %q", c.want, bad)
			}
		})
	}
}

// certsFiles are what compose-certs.sh makes in the state folder, and the
// brokers' containers (other users than the script's) read.
var certsFiles = []string{
	"rabbitmq/tls/cert.pem", "rabbitmq/tls/key.pem",
	"kafka/tls/ca.pem", "kafka/tls/server.pem", "kafka/tls/server.p12", "kafka/tls/keystore-password",
}

// runCertsScript runs compose-certs.sh on dir, as the helper certs does in
// its container, with this machine's bash and openssl.
func runCertsScript(t *testing.T, dir string) {
	t.Helper()
	out, err := exec.Command("bash", filepath.Join(repoRoot(t), certsScript), dir).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", certsScript, err, out)
	}
}

// verifyFor checks that certPEM is a certificate a client dialing
// 127.0.0.1 accepts when it trusts caPEM.
func verifyFor(t *testing.T, certPEM, caPEM []byte, dnsNames ...string) {
	t.Helper()
	block, _ := pem.Decode(certPEM)
	if block == nil {
		t.Fatal("no PEM certificate")
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		t.Fatal("the CA file holds no certificate")
	}
	for _, name := range append([]string{"127.0.0.1"}, dnsNames...) {
		if _, err := cert.Verify(x509.VerifyOptions{DNSName: name, Roots: roots}); err != nil {
			t.Errorf("a client of %s refuses the certificate: %v", name, err)
		}
	}
}

// compose-certs.sh makes the certificates and keystore the containers
// read: a key pair for amqps that a client of 127.0.0.1 or localhost
// trusts, Kafka's certificate and key (PEM) and the same as a PKCS#12
// keystore that opens with the password it writes, all readable by other
// users; run again it changes nothing, and it takes over the certificate
// brokers.sh made.
func TestComposeCertsScriptMakesWhatTheBrokersRead(t *testing.T) {
	t.Parallel()
	for _, tool := range []string{"bash", "openssl"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s is not installed: the script runs in the certs container, which has both, and brokers.sh needs them too", tool)
		}
	}
	dir := t.TempDir()
	runCertsScript(t, dir)
	read := func(rel string) []byte {
		b, err := os.ReadFile(filepath.Join(dir, rel))
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	made := map[string][]byte{}
	for _, f := range certsFiles {
		made[f] = read(f)
		fi, err := os.Stat(filepath.Join(dir, f))
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm()&0o004 == 0 {
			t.Errorf("%s has mode %v: the broker's container user cannot read it", f, fi.Mode().Perm())
		}
	}

	// amqps: the pair loads, and names 127.0.0.1 and localhost.
	if _, err := tls.X509KeyPair(made["rabbitmq/tls/cert.pem"], made["rabbitmq/tls/key.pem"]); err != nil {
		t.Errorf("rabbitmq key pair: %v", err)
	}
	verifyFor(t, made["rabbitmq/tls/cert.pem"], made["rabbitmq/tls/cert.pem"], "localhost")

	// Kafka: server.pem is the key and ca.pem's certificate; the keystore
	// holds that certificate and opens with keystore-password.
	pair, err := tls.X509KeyPair(made["kafka/tls/server.pem"], made["kafka/tls/server.pem"])
	if err != nil {
		t.Fatalf("kafka server.pem: %v", err)
	}
	caBlock, _ := pem.Decode(made["kafka/tls/ca.pem"])
	if caBlock == nil || string(pair.Certificate[0]) != string(caBlock.Bytes) {
		t.Error("server.pem's certificate is not ca.pem's")
	}
	verifyFor(t, made["kafka/tls/ca.pem"], made["kafka/tls/ca.pem"])
	p12, err := exec.Command("openssl", "pkcs12", "-in", filepath.Join(dir, "kafka/tls/server.p12"),
		"-passin", "file:"+filepath.Join(dir, "kafka/tls/keystore-password"), "-nokeys").CombinedOutput()
	if err != nil {
		t.Fatalf("server.p12 does not open with keystore-password: %v\n%s", err, p12)
	}
	if i := strings.Index(string(p12), "-----BEGIN"); i < 0 {
		t.Errorf("server.p12 holds no certificate:\n%s", p12)
	} else if b, _ := pem.Decode(p12[i:]); b == nil || string(b.Bytes) != string(caBlock.Bytes) {
		t.Errorf("server.p12 does not hold ca.pem's certificate:\n%s", p12)
	}

	// Again: nothing changes.
	runCertsScript(t, dir)
	for _, f := range certsFiles {
		if string(read(f)) != string(made[f]) {
			t.Errorf("a second run changed %s", f)
		}
	}
	// brokers.sh's Kafka certificate (server.pem, ca.pem) and no keystore:
	// the keystore is made of that certificate.
	for _, f := range []string{"kafka/tls/server.p12", "kafka/tls/keystore-password"} {
		if err := os.Remove(filepath.Join(dir, f)); err != nil {
			t.Fatal(err)
		}
	}
	runCertsScript(t, dir)
	if string(read("kafka/tls/ca.pem")) != string(made["kafka/tls/ca.pem"]) {
		t.Error("the script replaced brokers.sh's ca.pem")
	}
	if len(read("kafka/tls/server.p12")) == 0 {
		t.Error("no keystore made of brokers.sh's certificate")
	}
}
