package urlsecret

import (
	"errors"
	"slices"
	"testing"
)

// The password runs from the user's ":" to the last "@", whatever it
// holds, with or without a scheme; a URL without one keeps all it has.
func TestRedactHidesUpToTheLastAt(t *testing.T) {
	for raw, want := range map[string]string{
		"kafka://u:p@ss@h:1?sasl=PLAIN": "kafka://u:xxxxx@h:1?sasl=PLAIN",
		"amqp://u:p w/x?y#z@h/v":        "amqp://u:xxxxx@h/v",
		"u:p@ss@h:1":                    "u:xxxxx@h:1",
		"amqp://me@corp:pw@h/":          "amqp://me@corp:xxxxx@h/",
		"amqp://guest@h/v":              "amqp://guest@h/v",
		"kafka://h:1,h:2":               "kafka://h:1,h:2",
		"amqp://u:@h/":                  "amqp://u:xxxxx@h/",
	} {
		if got := Redact(raw); got != want {
			t.Errorf("Redact(%q) = %q, want %q", raw, got, want)
		}
	}
	if got, want := RedactText(`dial "amqp://u:a b@h:1/": refused; then kafka://v:c@d@k:2`), `dial "amqp://u:xxxxx@k:2`; got != want {
		t.Errorf("RedactText = %q, want %q", got, want)
	}
}

func TestCheckRefusesWhatURLParseReadsOtherwise(t *testing.T) {
	for raw, want := range map[string]error{
		"kafka://u:p@ss@h:1":          nil,
		"kafka://u:p%2Fs@h:1":         nil,
		"amqp://guest@h/v@x":          nil,          // no password at stake
		"kafka://h:1?client_id=a@b":   ErrAmbiguous, // user h, password "1?client_id=a", by the rule
		"amqp://u:p/s@h/":             ErrAmbiguous,
		"kafka://u:1?x=y@h:1":         ErrAmbiguous,
		"amqp://u:p#s@h/":             ErrAmbiguous,
		"amqp://u:p s@h/":             ErrNotEncoded,
		"amqp://u:pä@h/":              ErrNotEncoded,
		"amqp://u:p%zz@h/":            ErrNotEncoded,
		"amqp://u:p%4@h/":             ErrNotEncoded,
		"amqp://u:[p]@h/":             ErrNotEncoded,
		"amqp://guest:guest@h/vh@x":   ErrAmbiguous,
		"amqp://guest:guest@h/vh%40x": nil,
	} {
		if got := Check(raw); !errors.Is(got, want) || (want == nil) != (got == nil) {
			t.Errorf("Check(%q) = %v, want %v", raw, got, want)
		}
	}
}

func TestFormsAndScrub(t *testing.T) {
	forms := Forms("amqp://u:a%2Fb c@h/")
	for _, f := range []string{"a%2Fb c", "a/b c", "a%2Fb%20c", "a%2Fb+c"} {
		if !slices.Contains(forms, f) {
			t.Errorf("Forms = %q, missing %q", forms, f)
		}
	}
	if got := Scrub("user u, password a/b c, url amqp://u:a%2Fb%20c@h/", forms); got != "user u, password xxxxx, url amqp://u:xxxxx@h/" {
		t.Errorf("Scrub = %q", got)
	}
	// A short password is replaced only where it stands as one.
	if got := Scrub("a bad host: amqp://u:ab@h/", Forms("amqp://u:ab@h/")); got != "a bad host: amqp://u:xxxxx@h/" {
		t.Errorf("Scrub of a short password = %q", got)
	}
}
