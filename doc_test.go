package ferry

import (
	"fmt"
	"go/ast"
	"go/doc"
	"go/doc/comment"
	"go/parser"
	"go/token"
	"maps"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// packageDoc returns the package doc comment of this package, as go doc
// shows it.
func packageDoc(t *testing.T) string {
	t.Helper()
	names, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	var files []*ast.File
	for _, n := range names {
		if strings.HasSuffix(n, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, n, nil, parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	p, err := doc.NewFromFiles(fset, files, "github.com/ferrymq/ferry")
	if err != nil {
		t.Fatal(err)
	}
	return p.Doc
}

// docSection is what one section of the package doc says: its text, and
// the query parameters its lists name.
type docSection struct {
	text   string
	params []string
}

// paramItem matches a list item that documents a query parameter:
// "name=VALUE: what it does".
var paramItem = regexp.MustCompile(`^([a-z_]+)=`)

// sections splits a doc comment at its headings.
func sections(text string) map[string]*docSection {
	var pr comment.Printer
	var p comment.Parser
	printed := func(b comment.Block) string { return string(pr.Text(&comment.Doc{Content: []comment.Block{b}})) }
	out := map[string]*docSection{}
	cur := &docSection{}
	for _, b := range p.Parse(text).Content {
		switch b := b.(type) {
		case *comment.Heading:
			cur = &docSection{}
			out[strings.TrimSpace(strings.TrimPrefix(printed(b), "#"))] = cur
			continue
		case *comment.List:
			for _, it := range b.Items {
				item := strings.TrimSpace(string(pr.Text(&comment.Doc{Content: it.Content})))
				if m := paramItem.FindStringSubmatch(item); m != nil {
					cur.params = append(cur.params, m[1])
				}
			}
		}
		cur.text += printed(b)
	}
	return out
}

// docMismatches lists every way the doc's sections differ from the
// schemes: a scheme without its section or its URL form there, a
// parameter it takes that its section does not list, a parameter a
// section lists that none of its schemes takes.
func docMismatches(secs map[string]*docSection, schemes map[string]scheme) []string {
	var bad []string
	taken := map[string]map[string]bool{} // section -> the parameters its schemes take
	for _, name := range slices.Sorted(maps.Keys(schemes)) {
		s := schemes[name]
		sec := secs[s.section]
		if sec == nil {
			bad = append(bad, fmt.Sprintf("scheme %s: the package doc has no section %q (it has %q)", name, s.section, slices.Sorted(maps.Keys(secs))))
			continue
		}
		if !strings.Contains(sec.text, s.form) {
			bad = append(bad, fmt.Sprintf("scheme %s: section %q does not give its URL form %s", name, s.section, s.form))
		}
		if taken[s.section] == nil {
			taken[s.section] = map[string]bool{}
		}
		for _, p := range s.params {
			taken[s.section][p] = true
			if !slices.Contains(sec.params, p) {
				bad = append(bad, fmt.Sprintf("scheme %s takes the query parameter %s, which section %q does not list (as a list item \"%s=VALUE: what it does\")", name, p, s.section, p))
			}
		}
	}
	for _, section := range slices.Sorted(maps.Keys(taken)) {
		for _, p := range secs[section].params {
			if !taken[section][p] {
				bad = append(bad, fmt.Sprintf("section %q lists the query parameter %s, which none of its schemes takes", section, p))
			}
		}
	}
	return bad
}

// The package doc, which go doc shows, describes every scheme Open takes in
// a section of its own, with its URL form, and lists every query parameter
// the parser accepts: the table the parser checks a query against is the
// one compared here. It lists no parameter that no scheme takes.
func TestPackageDocListsEveryURLFormAndParameter(t *testing.T) {
	schemesMu.RLock()
	defer schemesMu.RUnlock()
	if len(schemes) < 6 {
		t.Fatalf("only %d schemes registered: %v", len(schemes), slices.Sorted(maps.Keys(schemes)))
	}
	for _, m := range docMismatches(sections(packageDoc(t)), schemes) {
		t.Error(m)
	}
}

// The check above fails a doc that misses a section, a form or a
// parameter, or lists a parameter nothing takes.
func TestPackageDocCheckCatchesDrift(t *testing.T) {
	kafka := map[string]scheme{"kafka": {section: "Kafka", form: "kafka://", params: []string{"client_id", "sasl"}}}
	cases := []struct{ name, doc, want string }{
		{"in order", "# Kafka\n\n\tkafka://HOST:PORT\n\nParameters:\n\n  - client_id=NAME: x\n  - sasl=MECHANISM: y\n", ""},
		{"a parameter missing", "# Kafka\n\n\tkafka://HOST:PORT\n\nParameters:\n\n  - client_id=NAME: x\n", "takes the query parameter sasl"},
		{"a parameter too many", "# Kafka\n\n\tkafka://HOST:PORT\n\nParameters:\n\n  - client_id=NAME: x\n  - sasl=M: y\n  - acks=all: z\n", "lists the query parameter acks"},
		{"no section", "# Kafka brokers\n\n\tkafka://HOST:PORT\n\nParameters:\n\n  - client_id=NAME: x\n  - sasl=M: y\n", "no section"},
		{"no form", "# Kafka\n\nApache Kafka.\n\n  - client_id=NAME: x\n  - sasl=M: y\n", "URL form"},
	}
	for _, c := range cases {
		bad := docMismatches(sections(c.doc), kafka)
		if c.want == "" {
			if len(bad) > 0 {
				t.Errorf("%s: %q", c.name, bad)
			}
			continue
		}
		if !slices.ContainsFunc(bad, func(m string) bool { return strings.Contains(m, c.want) }) {
			t.Errorf("%s: no mismatch naming %q among %q", c.name, c.want, bad)
		}
	}
}

// The SQS section says that the host is the endpoint, and lists no
// endpoint parameter, which the parser refuses.
func TestPackageDocSaysTheSQSHostIsTheEndpoint(t *testing.T) {
	sqs := sections(packageDoc(t))["SQS"]
	if sqs == nil {
		t.Fatal("no section SQS")
	}
	if slices.Contains(sqs.params, "endpoint") || !strings.Contains(strings.Join(strings.Fields(sqs.text), " "), "the host is the endpoint") {
		t.Errorf("section SQS: %s", sqs.text)
	}
	if strings.Contains(packageDoc(t), "endpoint=") {
		t.Error("the package doc still gives an endpoint= parameter")
	}
}
