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

	"github.com/ferrymq/ferry/internal/brokerurl"

	// Every adapter, so that every scheme has registered.
	_ "github.com/ferrymq/ferry/brokers"
)

// packageDoc returns the package doc comment of the package in dir, whose
// import path is path, as go doc shows it.
func packageDoc(t *testing.T, dir, path string) string {
	t.Helper()
	names, err := filepath.Glob(filepath.Join(dir, "*.go"))
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
	p, err := doc.NewFromFiles(fset, files, path)
	if err != nil {
		t.Fatal(err)
	}
	return p.Doc
}

// modulePath is the import path of this module, whose packages' docs
// describe the schemes.
const modulePath = "github.com/ferrymq/ferry"

// packageDocOf returns the package doc of a package of this module, by its
// import path.
func packageDocOf(t *testing.T, path string) string {
	t.Helper()
	dir := strings.TrimPrefix(strings.TrimPrefix(path, modulePath), "/")
	if dir == "" {
		dir = "."
	}
	return packageDoc(t, dir, path)
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

// docMismatches lists every way the docs' sections differ from the
// schemes: a scheme without its section in its package's doc, or without
// its URL form there, a parameter it takes that its section does not
// list, a parameter a section lists that none of its schemes takes. docs
// holds the sections of each package's doc, by import path.
func docMismatches(docs map[string]map[string]*docSection, schemes map[string]brokerurl.Scheme) []string {
	var bad []string
	type where struct{ pkg, section string }
	taken := map[where]map[string]bool{} // a section -> the parameters its schemes take
	for _, name := range slices.Sorted(maps.Keys(schemes)) {
		s := schemes[name]
		secs := docs[s.Package]
		sec := secs[s.Section]
		if sec == nil {
			bad = append(bad, fmt.Sprintf("scheme %s: the doc of package %s has no section %q (it has %q)", name, s.Package, s.Section, slices.Sorted(maps.Keys(secs))))
			continue
		}
		if !strings.Contains(sec.text, s.Form) {
			bad = append(bad, fmt.Sprintf("scheme %s: section %q of package %s does not give its URL form %s", name, s.Section, s.Package, s.Form))
		}
		w := where{s.Package, s.Section}
		if taken[w] == nil {
			taken[w] = map[string]bool{}
		}
		for _, p := range s.Params {
			taken[w][p] = true
			if !slices.Contains(sec.params, p) {
				bad = append(bad, fmt.Sprintf("scheme %s takes the query parameter %s, which section %q of package %s does not list (as a list item \"%s=VALUE: what it does\")", name, p, s.Section, s.Package, p))
			}
		}
	}
	for _, w := range slices.SortedFunc(maps.Keys(taken), func(a, b where) int { return strings.Compare(a.pkg+" "+a.section, b.pkg+" "+b.section) }) {
		for _, p := range docs[w.pkg][w.section].params {
			if !taken[w][p] {
				bad = append(bad, fmt.Sprintf("section %q of package %s lists the query parameter %s, which none of its schemes takes", w.section, w.pkg, p))
			}
		}
	}
	return bad
}

// The package docs, which go doc shows, describe every scheme Open takes in
// a section of the doc of the package that registers it, with its URL
// form, and list every query parameter its parser accepts: the table Open
// checks a query against is the one compared here. They list no parameter
// that no scheme takes. (This test links every adapter, through package
// brokers, so that all of them have registered.)
func TestPackageDocListsEveryURLFormAndParameter(t *testing.T) {
	schemes := brokerurl.All()
	if len(schemes) < 6 {
		t.Fatalf("only %d schemes registered: %v", len(schemes), slices.Sorted(maps.Keys(schemes)))
	}
	docs := map[string]map[string]*docSection{}
	for _, s := range schemes {
		if docs[s.Package] == nil {
			docs[s.Package] = sections(packageDocOf(t, s.Package))
		}
	}
	for _, m := range docMismatches(docs, schemes) {
		t.Error(m)
	}
}

// Open's table of the adapters (what a program that does not link one is
// told to import) agrees with what each adapter registers, and this
// package's doc gives each adapter's import.
func TestAdaptersTableMatchesTheRegisteredSchemes(t *testing.T) {
	linking := sections(packageDoc(t, ".", modulePath))["Linking the brokers"]
	if linking == nil {
		t.Fatal("the package doc has no section Linking the brokers")
	}
	for _, name := range slices.Sorted(maps.Keys(adapters)) {
		a := adapters[name]
		s, ok := brokerurl.Lookup(name)
		if !ok {
			t.Errorf("scheme %s is in Open's table of adapters, and no package registers it", name)
			continue
		}
		if s.Package != a.pkg {
			t.Errorf("scheme %s: Open would say import %s, and %s registers it", name, a.pkg, s.Package)
		}
		if !strings.Contains(linking.text, `import _ "`+a.pkg+`"`) {
			t.Errorf("section Linking the brokers does not give import _ %q", a.pkg)
		}
	}
	for name, s := range brokerurl.All() {
		if _, ok := adapters[name]; !ok && s.Package != modulePath {
			t.Errorf("scheme %s, registered by %s, is missing from Open's table of adapters", name, s.Package)
		}
	}
}

// The check above fails a doc that misses a section, a form or a
// parameter, or lists a parameter nothing takes.
func TestPackageDocCheckCatchesDrift(t *testing.T) {
	const pkg = "github.com/ferrymq/ferry/kafka"
	kafka := map[string]brokerurl.Scheme{"kafka": {Package: pkg, Section: "Kafka", Form: "kafka://", Params: []string{"client_id", "sasl"}}}
	cases := []struct{ name, doc, want string }{
		{"in order", "# Kafka\n\n\tkafka://HOST:PORT\n\nParameters:\n\n  - client_id=NAME: x\n  - sasl=MECHANISM: y\n", ""},
		{"a parameter missing", "# Kafka\n\n\tkafka://HOST:PORT\n\nParameters:\n\n  - client_id=NAME: x\n", "takes the query parameter sasl"},
		{"a parameter too many", "# Kafka\n\n\tkafka://HOST:PORT\n\nParameters:\n\n  - client_id=NAME: x\n  - sasl=M: y\n  - acks=all: z\n", "lists the query parameter acks"},
		{"no section", "# Kafka brokers\n\n\tkafka://HOST:PORT\n\nParameters:\n\n  - client_id=NAME: x\n  - sasl=M: y\n", "no section"},
		{"no form", "# Kafka\n\nApache Kafka.\n\n  - client_id=NAME: x\n  - sasl=M: y\n", "URL form"},
	}
	for _, c := range cases {
		bad := docMismatches(map[string]map[string]*docSection{pkg: sections(c.doc)}, kafka)
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
	// A section of the right name in another package's doc is no section.
	if bad := docMismatches(map[string]map[string]*docSection{modulePath: sections(cases[0].doc)}, kafka); !slices.ContainsFunc(bad, func(m string) bool { return strings.Contains(m, "no section") }) {
		t.Errorf("a section in the wrong package's doc passes: %q", bad)
	}
}

// The SQS section says that the host is the endpoint, and lists no
// endpoint parameter, which the parser refuses.
func TestPackageDocSaysTheSQSHostIsTheEndpoint(t *testing.T) {
	s, ok := brokerurl.Lookup("sqs")
	if !ok {
		t.Fatal("sqs:// is not registered")
	}
	pkgDoc := packageDocOf(t, s.Package)
	sqs := sections(pkgDoc)[s.Section]
	if sqs == nil {
		t.Fatalf("no section %s in the doc of %s", s.Section, s.Package)
	}
	if slices.Contains(sqs.params, "endpoint") || !strings.Contains(strings.Join(strings.Fields(sqs.text), " "), "the host is the endpoint") {
		t.Errorf("section %s of package sqs: %s", s.Section, sqs.text)
	}
	for _, d := range []string{pkgDoc, packageDoc(t, ".", modulePath)} {
		if strings.Contains(d, "endpoint=") {
			t.Error("a package doc still gives an endpoint= parameter")
		}
	}
}
