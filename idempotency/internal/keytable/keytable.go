// Package keytable holds what the SQL idempotency stores (pgstore and
// sqlitestore) share: the options that name their keys table and configure
// their inbox, and the rendering of their schema for a chosen table name.
package keytable

import (
	"crypto/sha256"
	"io/fs"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/ferrymq/ferry/consumer"
	"github.com/ferrymq/ferry/idempotency"
)

// Config is a SQL store's configuration.
type Config struct {
	Table     string
	Retention time.Duration
	Key       idempotency.KeyFunc
}

// Option sets a field of Config, or fails with a *consumer.ConfigError
// naming it.
type Option func(*Config) error

var tableName = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,39}$`)

// Table sets the keys table: lower-case letters, digits and '_', at most 40
// characters (it is spliced into SQL, so nothing else is allowed).
func Table(name string) Option {
	return func(c *Config) error {
		if !tableName.MatchString(name) {
			return consumer.ConfigErrorf("Table", "must match %s, got %q", tableName, name)
		}
		c.Table = name
		return nil
	}
}

// Retention sets how long an inbox keeps a key.
func Retention(d time.Duration) Option {
	return func(c *Config) error {
		if d <= 0 {
			return consumer.ConfigErrorf("Retention", "must be > 0, got %s", d)
		}
		c.Retention = d
		return nil
	}
}

// Key sets how an inbox derives a message's key.
func Key(f idempotency.KeyFunc) Option {
	return func(c *Config) error {
		if f == nil {
			return consumer.ConfigErrorf("Key", "must not be nil")
		}
		c.Key = f
		return nil
	}
}

// Build applies opts (nil ones are skipped) over the defaults: the table
// defaultTable, idempotency.DefaultRetention and idempotency.DefaultKey.
func Build[O ~func(*Config) error](defaultTable string, opts []O) (Config, error) {
	c := Config{Table: defaultTable, Retention: idempotency.DefaultRetention, Key: idempotency.DefaultKey}
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o(&c); err != nil {
			return c, err
		}
	}
	return c, nil
}

// Render returns the migrations matching pattern in fsys, in name order,
// with defaultTable replaced by table.
func Render(fsys fs.FS, pattern, defaultTable, table string) (string, error) {
	names, err := fs.Glob(fsys, pattern)
	if err != nil {
		return "", err
	}
	sort.Strings(names)
	var b strings.Builder
	for _, n := range names {
		text, err := fs.ReadFile(fsys, n)
		if err != nil {
			return "", err
		}
		b.WriteString(strings.ReplaceAll(string(text), defaultTable, table))
		b.WriteString("\n")
	}
	return b.String(), nil
}

// Hash returns the form in which the SQL stores keep a namespaced key: its
// SHA-256, 32 bytes in a bytea or BLOB column.
//
// Keys are arbitrary bytes (a Kafka key, an event id from anywhere): NUL,
// invalid UTF-8, any length. A text column refuses some of them (PostgreSQL
// fails on NUL and on invalid UTF-8), and a raw bytea key would fail beyond
// the size of an index entry (about 2.7 kB in PostgreSQL). The hash takes
// any bytes, is the same size for every key, keeps the primary key small,
// and two keys share a hash only by a SHA-256 collision. The price is that
// the table no longer shows the keys in clear.
func Hash(key string) []byte {
	h := sha256.Sum256([]byte(key))
	return h[:]
}

// quoteMax bounds how much of a key an error message quotes.
const quoteMax = 64

// Quote returns key quoted for an error message, cut after quoteMax bytes
// (keys may be long, and a dead-letter header carries the error).
func Quote(key string) string {
	if len(key) <= quoteMax {
		return strconv.Quote(key)
	}
	return strconv.Quote(key[:quoteMax]) + "... (" + strconv.Itoa(len(key)) + " bytes)"
}
