// Package urlsecret finds the password of a URL by one rule, so that every
// package that takes a broker URL (the root package's Open and Redact,
// rabbit.Dial and rabbit.Redact) hides the same characters.
//
// The rule, for a string that is one URL: its user information runs from
// after "scheme://" (or from the start, without a scheme) to the LAST "@"
// of the string, and its password from the first ":" of it to that "@".
// So a password holding "@", ":", "/", "?", "#", whitespace or anything
// else is found whole; where the rule reaches too far (an "@" in a path or
// a query), it hides too much, never too little.
//
// url.Parse reads a URL otherwise when a "/", "?" or "#" comes before the
// last "@" (it ends the host there), and refuses one whose user
// information holds whitespace or a non-ASCII letter, with an error that
// quotes the URL. Check refuses both, so that what a caller's code sees of
// an accepted URL past its user information (the host, the path, the
// query, which error messages do quote) holds no part of the password.
package urlsecret

import (
	"errors"
	"net/url"
	"regexp"
	"slices"
	"strings"
)

// Redacted is what replaces a password.
const Redacted = "xxxxx"

// schemePrefix matches a URL's "scheme://" at its start.
var schemePrefix = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9+.-]*://`)

// HasScheme reports whether rawURL starts with "scheme://".
func HasScheme(rawURL string) bool { return schemePrefix.MatchString(rawURL) }

// span returns where the user information of rawURL, one URL, starts, and
// where its password starts and ends; ok is false when it has no password
// (no "@", or no ":" before it).
func span(rawURL string) (userinfo, start, end int, ok bool) {
	if m := schemePrefix.FindStringIndex(rawURL); m != nil {
		userinfo = m[1]
	}
	at := strings.LastIndexByte(rawURL, '@')
	if at < userinfo {
		return 0, 0, 0, false
	}
	colon := strings.IndexByte(rawURL[userinfo:at], ':')
	if colon < 0 {
		return 0, 0, 0, false
	}
	return userinfo, userinfo + colon + 1, at, true
}

// Redact returns rawURL, one URL, with its password replaced by Redacted.
func Redact(rawURL string) string {
	_, start, end, ok := span(rawURL)
	if !ok {
		return rawURL
	}
	return rawURL[:start] + Redacted + rawURL[end:]
}

// schemeInText finds where a URL starts in a text.
var schemeInText = regexp.MustCompile(`[A-Za-z][A-Za-z0-9+.-]*://`)

// RedactText returns s, a text that may hold URLs, with their passwords
// replaced. A password may hold whitespace, so where a URL ends in a text
// cannot be told: the first "scheme://" and everything after it is taken
// as one URL, whose password runs to the last "@" of s (a later URL's
// password is inside what is hidden).
func RedactText(s string) string {
	loc := schemeInText.FindStringIndex(s)
	if loc == nil {
		return s
	}
	return s[:loc[0]] + Redact(s[loc[0]:])
}

// Errors of Check, worded to follow "user and password".
var (
	// ErrAmbiguous: a "/", "?" or "#" comes before the URL's last "@".
	ErrAmbiguous = errors.New(`cannot be told apart from the rest: the URL has a "/", "?" or "#" before its last "@"; ` +
		`percent-encode them in the user and password (%2F, %3F, %23), and an "@" in the path or query as %40`)
	// ErrNotEncoded: the user information holds a character that must be
	// percent-encoded.
	ErrNotEncoded = errors.New(`hold a character a URL does not allow there (such as whitespace, a non-ASCII letter, "[", "]", or a "%" not followed by two hex digits): ` +
		`percent-encode them, as url.UserPassword(user, password).String() does`)
)

// Check returns ErrAmbiguous or ErrNotEncoded for a URL with a password
// that url.Parse would read otherwise than the rule, or refuse with a
// message quoting it, and nil for any other URL. Neither error quotes the
// URL.
func Check(rawURL string) error {
	userinfo, _, end, ok := span(rawURL)
	if !ok {
		return nil // no password to keep
	}
	info := rawURL[userinfo:end]
	if strings.ContainsAny(info, "/?#") {
		// url.Parse ends the host at the first of them, so it would take
		// the rest of the password for the path or the query, and connect
		// elsewhere with a part of it.
		return ErrAmbiguous
	}
	if !validUserinfo(info) {
		return ErrNotEncoded
	}
	return nil
}

// validUserinfo reports whether s is user information that url.Parse
// takes and decodes: RFC 3986's unreserved and sub-delims characters,
// ":", well-formed %XX escapes, and the "@" url.Parse allows.
func validUserinfo(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case strings.IndexByte("-._~!$&'()*+,;=:@", c) >= 0:
		case c == '%':
			if i+2 >= len(s) || !isHex(s[i+1]) || !isHex(s[i+2]) {
				return false
			}
			i += 2
		default:
			return false
		}
	}
	return true
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

// Forms returns the spellings of rawURL's password that an error could
// quote: as written, decoded, and encoded as url.UserPassword,
// url.PathEscape and url.QueryEscape encode it; none when it has no
// password.
func Forms(rawURL string) []string {
	_, start, end, ok := span(rawURL)
	if !ok {
		return nil
	}
	written := rawURL[start:end]
	forms := []string{written}
	decoded := written
	if d, err := url.PathUnescape(written); err == nil {
		decoded = d
		forms = append(forms, d)
	}
	forms = append(forms,
		strings.TrimPrefix(url.UserPassword("", decoded).String(), ":"),
		url.PathEscape(decoded),
		url.QueryEscape(decoded))
	var out []string
	for _, f := range forms {
		if f != "" && !slices.Contains(out, f) {
			out = append(out, f)
		}
	}
	return out
}

// MinBare is the length from which Scrub replaces a password's spelling
// wherever it occurs. A shorter one is replaced only where it stands as a
// URL's password, between ":" and "@": replacing every "ab" of a message
// would wreck it and hide nothing.
const MinBare = 4

// Scrub returns s with every form of a password (from Forms) replaced.
func Scrub(s string, forms []string) string {
	for _, f := range forms {
		if len(f) >= MinBare {
			s = strings.ReplaceAll(s, f, Redacted)
		} else {
			s = strings.ReplaceAll(s, ":"+f+"@", ":"+Redacted+"@")
		}
	}
	return s
}
