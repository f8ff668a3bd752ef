package sqs_test

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
)

// records is a slog.Handler that keeps every record, for tests that read
// what an operator would see in the logs.
type records struct {
	mu   sync.Mutex
	recs []record
}

// record is one log record, its attributes flattened to text.
type record struct {
	level slog.Level
	msg   string
	attrs map[string]string
}

func (r record) String() string { return fmt.Sprintf("%s %q %v", r.level, r.msg, r.attrs) }

func (h *records) logger() *slog.Logger { return slog.New(h) }

func (h *records) Enabled(context.Context, slog.Level) bool { return true }

func (h *records) Handle(_ context.Context, r slog.Record) error {
	rec := record{level: r.Level, msg: r.Message, attrs: map[string]string{}}
	r.Attrs(func(a slog.Attr) bool {
		rec.attrs[a.Key] = a.Value.String()
		return true
	})
	h.mu.Lock()
	h.recs = append(h.recs, rec)
	h.mu.Unlock()
	return nil
}

func (h *records) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *records) WithGroup(string) slog.Handler      { return h }

// find returns the records at level whose message contains msg.
func (h *records) find(level slog.Level, msg string) []record {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []record
	for _, r := range h.recs {
		if r.level == level && strings.Contains(r.msg, msg) {
			out = append(out, r)
		}
	}
	return out
}

// contains reports whether any record holds s, in its message or an
// attribute.
func (h *records) contains(s string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, r := range h.recs {
		if strings.Contains(r.String(), s) {
			return true
		}
	}
	return false
}

// tcpProxy forwards TCP connections from a local address to target, and
// fails on demand the way a network does: refusing connections (the
// listener closed and every connection cut: a broker restarting, a pod
// gone) or swallowing them (every byte held, nothing answered: a
// partition, a dropped route). SQS is plain HTTP to one endpoint, so a
// client through the proxy sees what it would see of SQS itself.
type tcpProxy struct {
	t      testing.TB
	target string
	addr   string

	mu      sync.Mutex
	ln      net.Listener
	conns   map[net.Conn]struct{}
	silent  bool
	resumed chan struct{} // closed when a silence ends
	wg      sync.WaitGroup
}

// freeAddr returns a local address nothing listens on.
func freeAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// newTCPProxy starts a proxy to target listening on addr ("" for any free
// port), stopped when the test ends.
func newTCPProxy(t testing.TB, addr, target string) *tcpProxy {
	t.Helper()
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	p := &tcpProxy{t: t, target: target, conns: map[net.Conn]struct{}{}, resumed: make(chan struct{})}
	if err := p.listen(addr); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.close)
	return p
}

func (p *tcpProxy) listen(addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	p.mu.Lock()
	p.ln, p.addr = ln, ln.Addr().String()
	p.mu.Unlock()
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.wg.Add(1)
			go func() { defer p.wg.Done(); p.serve(c) }()
		}
	}()
	return nil
}

func (p *tcpProxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.conns == nil {
		c.Close()
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *tcpProxy) untrack(c net.Conn) {
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
	c.Close()
}

func (p *tcpProxy) serve(c net.Conn) {
	if !p.track(c) {
		return
	}
	defer p.untrack(c)
	up, err := net.Dial("tcp", p.target)
	if err != nil {
		return
	}
	if !p.track(up) {
		return
	}
	defer p.untrack(up)
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		defer func() { done <- struct{}{} }()
		buf := make([]byte, 32<<10)
		for {
			n, err := src.Read(buf)
			if n > 0 {
				if !p.pass() {
					return
				}
				if _, werr := dst.Write(buf[:n]); werr != nil {
					return
				}
			}
			if err != nil {
				return
			}
		}
	}
	go pipe(up, c)
	go pipe(c, up)
	<-done // one side ended: end both
}

// pass waits while the proxy is silent; it reports false when the
// connection must end instead (the silence ended: its client gave up on
// it long ago).
func (p *tcpProxy) pass() bool {
	p.mu.Lock()
	silent, resumed := p.silent, p.resumed
	p.mu.Unlock()
	if !silent {
		return true
	}
	<-resumed
	return false
}

// refuse closes the listener and cuts every connection: dials are refused
// until restore.
func (p *tcpProxy) refuse() {
	p.mu.Lock()
	ln := p.ln
	p.ln = nil
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	if ln != nil {
		ln.Close()
	}
}

// silence keeps connections open and accepts new ones, but passes no byte
// either way until restore.
func (p *tcpProxy) silence() {
	p.mu.Lock()
	p.silent = true
	p.mu.Unlock()
}

// restore ends a refusal or a silence: the connections held silent are
// closed, and new ones are forwarded again.
func (p *tcpProxy) restore() {
	p.mu.Lock()
	if p.silent {
		p.silent = false
		close(p.resumed)
		p.resumed = make(chan struct{})
		for c := range p.conns {
			c.Close()
		}
	}
	ln, addr := p.ln, p.addr
	p.mu.Unlock()
	if ln == nil {
		if err := p.listen(addr); err != nil {
			p.t.Fatalf("proxy: listening again on %s: %v", addr, err)
		}
	}
}

func (p *tcpProxy) close() {
	p.refuse()
	p.mu.Lock()
	if p.silent {
		p.silent = false
		close(p.resumed)
	}
	conns := p.conns
	p.conns = nil
	p.mu.Unlock()
	for c := range conns {
		c.Close()
	}
	p.wg.Wait()
}
