package testenv

import (
	"crypto/rand"
	"encoding/hex"
	"strings"
	"testing"
)

// UniqueName returns a name for a topic, queue, exchange, consumer group or
// key that no other test and no earlier run uses: "ferry-", a short form of
// prefix (or of the test's name when prefix is empty), and a random suffix.
// It holds only lower-case letters, digits and '-', and is at most 60
// characters long, which every broker here accepts (SQS allows 80, and a
// FIFO queue adds ".fifo").
func UniqueName(t testing.TB, prefix string) string {
	t.Helper()
	if prefix == "" {
		prefix = t.Name()
	}
	return uniqueName(prefix)
}

// NewName is UniqueName for code that has no testing.TB: prefix must not be
// empty to say what the name is for.
func NewName(prefix string) string { return uniqueName(prefix) }

func uniqueName(prefix string) string {
	var b strings.Builder
	dash := false
	for _, r := range strings.ToLower(prefix) {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9':
			b.WriteRune(r)
			dash = false
		default:
			if !dash && b.Len() > 0 {
				b.WriteByte('-')
				dash = true
			}
		}
	}
	p := strings.Trim(b.String(), "-")
	const maxPrefix = 60 - len("ferry-") - 1 - 12
	if len(p) > maxPrefix {
		p = strings.TrimRight(p[:maxPrefix], "-")
	}
	var rnd [6]byte
	if _, err := rand.Read(rnd[:]); err != nil {
		panic("testenv: crypto/rand: " + err.Error())
	}
	if p == "" {
		return "ferry-" + hex.EncodeToString(rnd[:])
	}
	return "ferry-" + p + "-" + hex.EncodeToString(rnd[:])
}
