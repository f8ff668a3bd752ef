// Package utf8cut cuts strings to a byte length without cutting a
// character in two, for header values and names that a broker bounds.
package utf8cut

import "unicode/utf8"

// Cut returns s cut to at most n bytes, at a rune boundary.
func Cut(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}
