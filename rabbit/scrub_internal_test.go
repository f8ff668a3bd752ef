package rabbit

import (
	"errors"
	"testing"
)

// scrub takes the password out of the URL an error quotes, and nothing
// else: a one-letter password also occurs inside ordinary words.
func TestScrubReplacesOnlyTheURLsPassword(t *testing.T) {
	const raw = "amqp://ferry:p@broker.invalid:5672/"
	err := scrub(errors.New(`dial tcp: lookup broker.invalid: no such host (url "amqp://ferry:p@broker.invalid:5672/")`), raw)
	want := `dial tcp: lookup broker.invalid: no such host (url "amqp://ferry:xxxxx@broker.invalid:5672/")`
	if err.Error() != want {
		t.Errorf("scrub = %q\nwant    %q", err, want)
	}
	plain := errors.New("dial tcp: lookup broker.invalid: no such host")
	if got := scrub(plain, raw); got != plain {
		t.Errorf("scrub changed an error that holds no URL: %q", got)
	}
}
