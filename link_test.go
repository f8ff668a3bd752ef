package ferry_test

import (
	"os/exec"
	"slices"
	"strings"
	"testing"
)

// goTool runs the go command in this module and returns its output.
func goTool(t *testing.T, args ...string) string {
	t.Helper()
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command to build with:", err)
	}
	out, err := exec.Command(gobin, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// modules lists the modules of the packages pkg links.
func modules(t *testing.T, pkg string) []string {
	t.Helper()
	var mods []string
	for _, m := range strings.Fields(goTool(t, "list", "-deps", "-f", "{{with .Module}}{{.Path}}{{end}}", pkg)) {
		if !slices.Contains(mods, m) {
			mods = append(mods, m)
		}
	}
	return mods
}

// hasModule reports whether mods holds a module whose path starts with
// prefix.
func hasModule(mods []string, prefix string) bool {
	return slices.ContainsFunc(mods, func(m string) bool { return strings.HasPrefix(m, prefix) })
}

// The root package links no broker SDK: each adapter registers its own
// schemes, so that importing ferry costs only what mem:// needs.
func TestRootLinksNoBrokerSDK(t *testing.T) {
	mods := modules(t, ".")
	for _, sdk := range []string{"github.com/twmb/franz-go", "github.com/aws/", "github.com/rabbitmq/amqp091-go"} {
		if hasModule(mods, sdk) {
			t.Errorf("package ferry links %s: %q", sdk, mods)
		}
	}
}

// A service that runs on Kafka alone (testdata/kafkaonly: the root and
// package kafka) links franz-go and neither the AWS SDK nor amqp091-go.
func TestKafkaOnlyServiceLinksNoOtherSDK(t *testing.T) {
	mods := modules(t, "./testdata/kafkaonly")
	if !hasModule(mods, "github.com/twmb/franz-go") {
		t.Errorf("the Kafka-only service does not link franz-go: %q", mods)
	}
	for _, sdk := range []string{"github.com/aws/", "github.com/rabbitmq/amqp091-go"} {
		if hasModule(mods, sdk) {
			t.Errorf("the Kafka-only service links %s: %q", sdk, mods)
		}
	}
}

// In a program that does not import a broker's package, Open of that
// broker's URL is a *URLError for the scheme saying which package to
// import, and never shows the password; a scheme Ferry does not know is
// told so, with the schemes the program opens.
func TestOpenOfAnUnlinkedSchemeSaysWhatToImport(t *testing.T) {
	urls := []string{"sqs://k:s3cret@127.0.0.1:9324", "https://sqs.us-east-1.amazonaws.com/123456789012/q", "amqp://u:s3cret@127.0.0.1:5672/", "amqps://u:s3cret@127.0.0.1/", "nats://127.0.0.1:4222"}
	want := []string{
		`scheme	sqs:// needs import _ "github.com/ferrymq/ferry/sqs"`,
		`scheme	an SQS queue URL needs import _ "github.com/ferrymq/ferry/sqs"`,
		`scheme	amqp:// needs import _ "github.com/ferrymq/ferry/rabbit"`,
		`scheme	amqps:// needs import _ "github.com/ferrymq/ferry/rabbit"`,
		`scheme	"nats" is not one Ferry opens (kafka://, mem://)`,
	}
	out := goTool(t, append([]string{"run", "./testdata/kafkaonly"}, urls...)...)
	if strings.Contains(out, "s3cret") {
		t.Errorf("a password shows: %s", out)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != len(want) {
		t.Fatalf("got %d lines for %d URLs:\n%s", len(lines), len(urls), out)
	}
	for i, w := range want {
		if !strings.HasPrefix(lines[i], w) {
			t.Errorf("Open(%q) = %q, want %q...", urls[i], lines[i], w)
		}
	}
	if !strings.Contains(lines[0], `"github.com/ferrymq/ferry/brokers"`) {
		t.Errorf("the error does not name package brokers: %q", lines[0])
	}
}
