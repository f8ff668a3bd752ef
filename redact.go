package ferry

import (
	"errors"

	"github.com/ferrymq/ferry/internal/urlsecret"
)

// This file keeps passwords out of what Open returns and Redact prints,
// by the rule of internal/urlsecret: a URL's user information runs from
// after "scheme://" to the last "@".

// Redact replaces with "xxxxx" the password of the URLs in s, a URL or a
// text such as an error's message that holds some.
//
// A password may hold any character, "@" and whitespace included, when it
// was not percent-encoded, so Redact cannot tell where a URL in a text
// ends: it takes the first "scheme://" of s and everything after it as one
// URL, whose user information runs to the last "@" of s, and hides from
// the user's ":" to that "@". No part of the password is left, and a
// second URL's password is inside what is hidden; but an "@" later in the
// text (in a path, a query, an e-mail address) makes it hide more than
// the password. A text without "://" is returned as it is.
func Redact(s string) string { return urlsecret.RedactText(s) }

// withoutPassword returns err with no form of rawURL's password in its
// text. A *URLError's own fields hold none (its URL is redacted, and its
// Part and Reason quote only what follows the user information, once
// urlsecret.Check passed), but its Err, like any other error, comes from
// code that may quote the URL: an error whose text holds the password is
// replaced by one that does not.
func withoutPassword(err error, rawURL string) error {
	forms := urlsecret.Forms(rawURL)
	if ue, ok := err.(*URLError); ok {
		if ue.Err != nil {
			ue.Err = scrub(ue.Err, forms)
		}
		return ue
	}
	return scrub(err, forms)
}

// scrub returns err itself when its text holds no form of the password
// and no URL with one, or else a *scrubbedError.
func scrub(err error, forms []string) error {
	msg := err.Error()
	clean := Redact(urlsecret.Scrub(msg, forms))
	if clean == msg {
		return err
	}
	return &scrubbedError{msg: clean, err: err}
}

// scrubbedError is an error whose text had a password taken out. It
// matches what the original matches through errors.Is, but does not
// unwrap to it: the original's text holds the password.
type scrubbedError struct {
	msg string
	err error
}

func (e *scrubbedError) Error() string { return e.msg }

// Is reports whether the original error matches target.
func (e *scrubbedError) Is(target error) bool { return errors.Is(e.err, target) }
