package ferry_test

import (
	"context"
	"errors"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ferrymq/ferry"
	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/rabbit"
)

// passwordShapes are passwords of every awkward shape, written into URLs
// as they are (not percent-encoded). Their letters and digits ("Qz7",
// "Wk9", "Xv5") occur in no message, so any of them in an error is the
// password's.
var passwordShapes = []struct{ name, password string }{
	{"plain", "Qz7Wk9Xv5"},
	{"space", "Qz7 Wk9"},
	{"tab", "Qz7\tWk9"},
	{"newline", "Qz7\nWk9"},
	{"at", "Qz7@Wk9"},
	{"two ats", "Qz7@Wk9@Xv5"},
	{"colon", "Qz7:Wk9"},
	{"slash", "Qz7/Wk9"},
	{"question mark", "Qz7?Wk9=Xv5"},
	{"hash", "Qz7#Wk9"},
	{"bare percent", "Qz7%Wk9"},
	{"percent-encoded", "Qz7%40Wk9%2FXv5"},
	{"unicode", "Qzä7Wk9ßXv5"},
	{"empty", ""},
	{"brackets", "Qz7[Wk9]"},
	{"quote and backslash", `Qz7"Wk9\Xv5`},
	{"reads as a query", "1?group_protocol=Qz7Wk9"},
	{"digits then slash", "123/Qz7Wk9"},
	{"at, host and slash", "Qz7@127.0.0.1:1/Wk9"},
	{"scheme inside", "Qz7://Wk9"},
	{"everything", " \t@:/?#%[]\"\\Qz7Wk9ä"},
}

// leakTemplates are URLs that Open refuses without reaching a broker,
// each for another reason, with PASSWORD where the password goes.
var leakTemplates = []string{
	"kafka://ferry:PASSWORD@127.0.0.1:9094?sasl=NOPE",                                  // bad sasl
	"kafka://ferry:PASSWORD@127.0.0.1:9094?acks=all",                                   // unknown parameter
	"kafka://ferry:PASSWORD@127.0.0.1:9094",                                            // a user without sasl
	"kafka://ferry:PASSWORD@127.0.0.1:9094?sasl=PLAIN&tls=maybe",                       // bad tls
	"kafka://ferry:PASSWORD@127.0.0.1?sasl=PLAIN",                                      // a seed without a port
	"kafka://ferry:PASSWORD@127.0.0.1:9094?sasl=PLAIN&ca_file=%2Fnonexistent%2Fca.pem", // an unreadable ca_file
	"kafka://ferry:PASSWORD@127.0.0.1:9094?sasl=PLAIN&group_protocol=eager",            // bad group_protocol
	"sqs://ferry:PASSWORD@127.0.0.1:9324?tls=maybe",                                    // bad tls
	"sqs://ferry:PASSWORD@127.0.0.1:9324/queue",                                        // a path
	"amqp://guest:PASSWORD@127.0.0.1:5672/?ca_file=ca.pem",                             // ca_file needs amqps
	"amqps://guest:PASSWORD@127.0.0.1:5671/?ca_file=%2Fnonexistent%2Fca.pem",           // an unreadable ca_file
	"amqp://guest:PASSWORD@127.0.0.1:notaport/",                                        // does not parse
	"nats://ferry:PASSWORD@127.0.0.1:4222",                                             // unknown scheme
	"ferry:PASSWORD@127.0.0.1:9092",                                                    // no scheme
	"mem://ferry:PASSWORD@shared?autocreate=maybe",                                     // bad autocreate
}

// twin returns a password of the same shape as p with other letters and
// digits: each ASCII letter or digit moves on by one within its class
// (a-f, g-z, A-F, G-Z, 0-9, so that hex digits stay hex digits and a
// %XX escape stays one), each other character is kept, and non-ASCII
// runes change to their neighbour. A URL with the twin follows the same
// path through Open as one with p, so a text that holds a piece of p more
// often than the twin's text does holds it because of p.
func twin(p string) string {
	var b strings.Builder
	for i := 0; i < len(p); {
		r, n := utf8.DecodeRuneInString(p[i:])
		i += n
		switch {
		case r == utf8.RuneError && n == 1:
			b.WriteByte(p[i-1])
		case 'a' <= r && r <= 'f':
			b.WriteRune('a' + (r-'a'+1)%6)
		case 'A' <= r && r <= 'F':
			b.WriteRune('A' + (r-'A'+1)%6)
		case 'g' <= r && r <= 'z':
			b.WriteRune('g' + (r-'g'+1)%20)
		case 'G' <= r && r <= 'Z':
			b.WriteRune('G' + (r-'G'+1)%20)
		case '0' <= r && r <= '9':
			b.WriteRune('0' + (r-'0'+1)%10)
		case r >= utf8.RuneSelf && utf8.ValidRune(r^1):
			b.WriteRune(r ^ 1)
		default:
			b.WriteRune(r)
		}
	}
	return b.String()
}

// leaked returns the three-byte pieces of password that text holds more
// often than twinText, the same text made with twin(password). Any longer
// piece that leaked has such a piece in it.
func leaked(password, text, twinText string) []string {
	var out []string
	for i := 0; i+3 <= len(password); i++ {
		piece := password[i : i+3]
		if strings.Count(text, piece) > strings.Count(twinText, piece) {
			out = append(out, piece)
		}
	}
	return out
}

// schemeStart matches a URL's "scheme://".
var schemeStart = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9+.-]*://`)

// openError returns the text of Open's error for raw ("" when it opened).
func openError(t *testing.T, raw string) string {
	t.Helper()
	b, err := ferry.Open(context.Background(), raw)
	if err == nil {
		defer b.Close()
		if !strings.Contains(raw, "127.0.0.1:1/") {
			return ""
		}
		// Open needs no broker: a broker that refuses is met at the first
		// Publish, whose error must hide the password as well.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := b.Publish(ctx, "x", consumer.Message{Body: []byte("x")}); err != nil {
			return err.Error()
		}
		return ""
	}
	return err.Error()
}

// checkOpenHides fails t if Open's error for template with password, or
// any form in which password appears, holds a piece of the password.
func checkOpenHides(t *testing.T, template, password string) {
	t.Helper()
	raw := strings.Replace(template, "PASSWORD", password, 1)
	twinRaw := strings.Replace(template, "PASSWORD", twin(password), 1)
	if !strings.Contains(template, "://") && schemeStart.MatchString(raw) {
		// A password that starts with "//" makes the "user:" of a URL
		// without a scheme a scheme: the URL has no password then.
		return
	}
	got, twinGot := openError(t, raw), openError(t, twinRaw)
	if got == "" {
		t.Errorf("Open(%q) succeeded", raw)
		return
	}
	for _, form := range []string{password, url.PathEscape(password), url.QueryEscape(password)} {
		if pieces := leaked(form, got, twinGot); len(pieces) > 0 {
			t.Errorf("Open(%q): the error holds %q of the password: %s", raw, pieces, got)
		}
	}
}

// No error of Open holds a piece of the URL's password, whatever its shape
// and whatever is wrong with the URL; nor does Redact's output.
func TestOpenAndRedactHideEveryPasswordShape(t *testing.T) {
	for _, s := range passwordShapes {
		t.Run(s.name, func(t *testing.T) {
			for _, tmpl := range leakTemplates {
				checkOpenHides(t, tmpl, s.password)
			}
			for _, tmpl := range []string{
				"amqp://guest:PASSWORD@127.0.0.1:5672/v",
				"kafka://ferry:PASSWORD@127.0.0.1:9094?sasl=NOPE",
				`dial "amqps://guest:PASSWORD@127.0.0.1:5671/": refused`,
				"from kafka://ferry:PASSWORD@a:1,b:2 to amqp://u:PASSWORD@c:3/v",
				"parse \"sqs://k:PASSWORD@h:1\": net/url: invalid userinfo",
			} {
				text := strings.ReplaceAll(tmpl, "PASSWORD", s.password)
				got := ferry.Redact(text)
				twinGot := ferry.Redact(strings.ReplaceAll(tmpl, "PASSWORD", twin(s.password)))
				if pieces := leaked(s.password, got, twinGot); len(pieces) > 0 {
					t.Errorf("Redact(%q) = %q holds %q of the password", text, got, pieces)
				}
			}
		})
	}
}

// rabbit.Dial parses its URL itself: its errors hold no piece of the
// password either, whether the URL reaches it through Open (re-encoded)
// or directly, as written. Port 1 refuses at once.
func TestRabbitDialErrorsHideEveryPasswordShape(t *testing.T) {
	for _, s := range passwordShapes {
		t.Run(s.name, func(t *testing.T) {
			for _, tmpl := range []string{"amqp://guest:PASSWORD@127.0.0.1:1/", "amqp://guest:PASSWORD@127.0.0.1:notaport/v"} {
				raw := strings.Replace(tmpl, "PASSWORD", s.password, 1)
				twinRaw := strings.Replace(tmpl, "PASSWORD", twin(s.password), 1)
				dialErr := func(raw string) string {
					b, err := rabbit.Dial(raw)
					if err == nil {
						b.Close()
						return ""
					}
					return err.Error()
				}
				got, twinGot := dialErr(raw), dialErr(twinRaw)
				if got == "" {
					t.Fatalf("rabbit.Dial(%q) succeeded", raw)
				}
				if pieces := leaked(s.password, got, twinGot); len(pieces) > 0 {
					t.Errorf("rabbit.Dial(%q): the error holds %q of the password: %s", raw, pieces, got)
				}
				checkOpenHides(t, tmpl, s.password)
				if got := rabbit.Redact(raw); len(leaked(s.password, got, rabbit.Redact(twinRaw))) > 0 {
					t.Errorf("rabbit.Redact(%q) = %q", raw, got)
				}
			}
		})
	}
}

// FuzzOpenNeverLeaksPassword: for any password, written into a URL as it
// is, no error Open returns holds a piece of it (three bytes or more).
// Its seeds are passwordShapes, so that go test runs them.
func FuzzOpenNeverLeaksPassword(f *testing.F) {
	for _, s := range passwordShapes {
		f.Add(s.password)
	}
	f.Fuzz(func(t *testing.T, password string) {
		if len(password) > 256 {
			t.Skip("long passwords add nothing but time")
		}
		for _, tmpl := range leakTemplates {
			checkOpenHides(t, tmpl, password)
		}
	})
}

// A password of any shape works once percent-encoded, as
// url.UserPassword encodes it; an "@" or ":" in it works even unencoded.
func TestOpenTakesAnyPasswordPercentEncoded(t *testing.T) {
	for _, s := range passwordShapes {
		raw := "kafka://" + url.UserPassword("ferry", s.password).String() + "@127.0.0.1:9094?sasl=PLAIN"
		b, err := ferry.Open(context.Background(), raw)
		if err != nil {
			t.Errorf("%s: Open(%q) = %v", s.name, raw, err)
			continue
		}
		b.Close()
	}
	for _, raw := range []string{
		"kafka://ferry:Qz7@Wk9@127.0.0.1:9094?sasl=PLAIN",
		"kafka://ferry:Qz7:Wk9@127.0.0.1:9094?sasl=PLAIN",
		"kafka://127.0.0.1:9092?client_id=a%40b", // an "@" in the query, encoded
	} {
		b, err := ferry.Open(context.Background(), raw)
		if err != nil {
			t.Errorf("Open(%q) = %v", raw, err)
			continue
		}
		b.Close()
	}
}

// Where url.Parse and the last-"@" rule disagree on where the password
// ends, Open refuses the URL, naming the user and password, and says what
// to encode.
func TestOpenRefusesAmbiguousUserInformation(t *testing.T) {
	for _, raw := range []string{
		"amqp://guest:Qz7/Wk9@127.0.0.1:5672/",
		"kafka://ferry:123/Qz7@127.0.0.1:9094?sasl=PLAIN",
		"kafka://ferry:1?group_protocol=Qz7@127.0.0.1:9094?sasl=PLAIN",
		"kafka://127.0.0.1:9092?client_id=a@b", // or an "@" in the query: which is it?
		"amqp://guest:Qz7 Wk9@127.0.0.1:5672/",
		"amqp://guest:Qzä7@127.0.0.1:5672/",
		"amqp://guest:Qz7%zz@127.0.0.1:5672/",
	} {
		_, err := ferry.Open(context.Background(), raw)
		var ue *ferry.URLError
		if !errors.As(err, &ue) || ue.Part != "user and password" {
			t.Errorf("Open(%q) = %v, want a URLError naming the user and password", raw, err)
			continue
		}
		if !strings.Contains(ue.Reason, "percent-encode") {
			t.Errorf("Open(%q): %q does not say to percent-encode", raw, ue.Reason)
		}
	}
}

func TestRedactLeavesURLsWithoutPasswordAlone(t *testing.T) {
	for _, s := range []string{
		"kafka://127.0.0.1:9092,127.0.0.1:9093?client_id=x",
		"amqp://guest@127.0.0.1:5672/v",
		"no URL here: user@example.com, a:b",
		"sqs://127.0.0.1:9324?tls=false",
	} {
		if got := ferry.Redact(s); got != s {
			t.Errorf("Redact(%q) = %q", s, got)
		}
	}
	if got, want := ferry.Redact(`open "amqps://u:Qz7@Wk9@h:5671/v": refused`), `open "amqps://u:xxxxx@h:5671/v": refused`; got != want {
		t.Errorf("Redact = %q, want %q", got, want)
	}
}
