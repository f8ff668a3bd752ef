package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/ferrymq/ferry/cmd/ferry/internal/demo"
)

func TestMain(m *testing.M) {
	code := m.Run()
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// short are the flags of a whole run in a few seconds.
var short = []string{"-orders", "40", "-steady", "1s", "-slow", "1s", "-failing", "500ms", "-protected", "1s", "-recovered", "30s"}

func ferry(t *testing.T, tweak func(*demo.Config), args ...string) (code int, stdout, stderr string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out, errOut bytes.Buffer
	code = runWith(ctx, args, &out, &errOut, tweak)
	return code, out.String(), errOut.String()
}

// A usage error prints the error and one line naming the help, not the
// whole help: the error stays in sight.
func TestBadUsageExitsTwoWithTheErrorAndWhereTheHelpIs(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		want string // in stderr
		help string // the help its last line names
	}{
		{"unknown command", []string{"deploy"}, `unknown command "deploy"`, "ferry help"},
		{"unknown flag", []string{"demo", "-fast"}, "flag provided but not defined: -fast", "ferry help demo"},
		{"unknown double-dash flag", []string{"demo", "--turbo"}, "flag provided but not defined: -turbo", "ferry help demo"},
		{"orders not a number", []string{"demo", "-orders", "many"}, `invalid value "many" for flag -orders`, "ferry help demo"},
		{"too few orders", []string{"demo", "-orders", "3"}, "invalid value for -orders: must be at least 20, got 3", "ferry help demo"},
		{"zero phase", []string{"demo", "-slow", "0s"}, "invalid value for -slow: must be > 0", "ferry help demo"},
		{"negative phase", []string{"demo", "-recovered", "-1s"}, "invalid value for -recovered: must be > 0", "ferry help demo"},
		{"duration without unit", []string{"demo", "-steady", "5"}, `invalid value "5" for flag -steady`, "ferry help demo"},
		{"bad seed", []string{"demo", "-seed", "-1"}, `invalid value "-1" for flag -seed`, "ferry help demo"},
		{"stray argument", []string{"demo", "now"}, `unexpected argument "now"`, "ferry help demo"},
		{"help for an unknown command", []string{"help", "deploy"}, `unknown command "deploy"`, "ferry help"},
		{"lag without a source", []string{"lag"}, "want one SOURCE", "ferry help lag"},
		{"dlq peek without a broker", []string{"dlq", "peek", "x"}, "--broker URL is required", "ferry help dlq peek"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, stdout, stderr := ferry(t, nil, tc.args...)
			if code != exitUsage {
				t.Errorf("exit %d, want %d", code, exitUsage)
			}
			lines := strings.Split(strings.TrimSpace(stderr), "\n")
			if len(lines) != 2 || !strings.Contains(lines[0], tc.want) || lines[1] != "run '"+tc.help+"' for its usage and flags" {
				t.Errorf("stderr is not the error (%q) and the line naming %s:\n%s", tc.want, tc.help, stderr)
			}
			if stdout != "" {
				t.Errorf("stdout not empty: %q", stdout)
			}
		})
	}
	// With nothing to go on, the whole usage is the answer.
	if code, _, stderr := ferry(t, nil); code != exitUsage || !strings.Contains(stderr, "Usage: ferry <command>") {
		t.Errorf("ferry alone: exit %d, stderr %q", code, stderr)
	}
}

func TestHelpExitsZero(t *testing.T) {
	for _, args := range [][]string{{"help"}, {"-h"}, {"--help"}, {"help", "demo"}} {
		code, stdout, _ := ferry(t, nil, args...)
		if code != exitOK || !strings.Contains(stdout, "Usage: ferry") {
			t.Errorf("%v: exit %d, stdout %q; want 0 and the usage", args, code, stdout)
		}
	}
	code, stdout, _ := ferry(t, nil, "help", "demo")
	for _, flag := range []string{"-broker", "-db", "-orders", "-steady", "-slow", "-failing", "-protected", "-recovered", "-seed", "-quiet"} {
		if code != exitOK || !strings.Contains(stdout, flag) {
			t.Errorf("ferry help demo does not document %s", flag)
		}
	}
	// demo -h prints the demo's usage to stderr (flag's convention) and exits 0.
	code, _, stderr := ferry(t, nil, "demo", "-h")
	if code != exitOK || !strings.Contains(stderr, "Usage: ferry demo") {
		t.Errorf("demo -h: exit %d, stderr %q", code, stderr)
	}
}

// A broker URL ferry.Open refuses, or a database URL that is not
// PostgreSQL's, is bad usage: exit 2 with the message that names what is
// wrong, and never the password.
func TestDemoBadURLExitsTwoWithoutThePassword(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--broker", "kafka://"}, `broker URL "kafka://": host is empty`},
		{[]string{"--broker", "ftp://u:s3cret@host/"}, `scheme "ftp" is not one Ferry opens`},
		{[]string{"--broker", "kafka://u:s3cret@127.0.0.1:9092"}, `"kafka://u:xxxxx@127.0.0.1:9092": user is given without sasl`},
		{[]string{"--broker", "sqs://k:s3cret@127.0.0.1:9324?tls=maybe"}, "query parameter tls is maybe"},
		{[]string{"--db", "postgres://u:s3cret@127.0.0.1:5432/ferry?sslmode=sometimes"}, "not a PostgreSQL URL"},
	} {
		code, stdout, stderr := ferry(t, nil, append([]string{"demo", "-quiet"}, tc.args...)...)
		if code != exitUsage {
			t.Errorf("%v: exit %d, want %d; stderr %q", tc.args, code, exitUsage, stderr)
		}
		if !strings.Contains(stderr, tc.want) {
			t.Errorf("%v: stderr lacks %q: %q", tc.args, tc.want, stderr)
		}
		if strings.Contains(stderr+stdout, "s3cret") {
			t.Errorf("%v: the password shows: %q", tc.args, stderr+stdout)
		}
	}
}

// A short run holds every invariant and exits 0, with status lines on a
// non-terminal stdout.
func TestDemoExitsZeroWhenEveryInvariantHolds(t *testing.T) {
	code, stdout, stderr := ferry(t, nil, append([]string{"demo"}, short...)...)
	t.Logf("stdout:\n%s\nstderr:\n%s", stdout, stderr)
	if code != exitOK {
		t.Fatalf("exit %d, want 0", code)
	}
	for _, want := range []string{"-- phase recovered", "breaker", "verdict: all invariants hold"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("stdout lacks %q", want)
		}
	}
	if strings.Contains(stdout, "\r") {
		t.Error("stdout is not a terminal, yet the status line is rewritten in place")
	}
}

// With idempotency switched off the duplicates are paid twice: the demo
// names the broken invariant and exits 1. -quiet prints the verdict only.
func TestDemoExitsOneNamingTheBrokenInvariant(t *testing.T) {
	code, stdout, stderr := ferry(t, func(c *demo.Config) { c.DisableIdempotency = true },
		append([]string{"demo", "-quiet"}, short...)...)
	t.Logf("stdout:\n%s\nstderr:\n%s", stdout, stderr)
	if code != exitFailed {
		t.Fatalf("exit %d, want %d", code, exitFailed)
	}
	if !strings.Contains(stderr, "invariant broken: exactly once") {
		t.Errorf("stderr does not name the invariant: %q", stderr)
	}
	if !strings.HasPrefix(stdout, "verdict: BROKEN: exactly once") {
		t.Errorf("stdout does not begin with the verdict:\n%s", stdout)
	}
	if strings.Contains(stdout, "-- phase") {
		t.Errorf("-quiet printed more than the verdict:\n%s", stdout)
	}
}

// signalWriter closes seen once what was written contains want.
type signalWriter struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	want string
	seen chan struct{}
}

func (w *signalWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	n, err := w.buf.Write(p)
	if w.seen != nil && strings.Contains(w.buf.String(), w.want) {
		close(w.seen)
		w.seen = nil
	}
	return n, err
}

// An interrupted run stops everything it started, says so, and exits 130.
func TestDemoInterruptedExits130(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	seen := make(chan struct{})
	out := &signalWriter{want: "-- phase slow", seen: seen}
	var errOut bytes.Buffer
	done := make(chan int, 1)
	go func() { done <- runWith(ctx, append([]string{"demo"}, short...), out, &errOut, nil) }()
	select {
	case <-seen:
	case <-time.After(time.Minute):
		t.Fatal("the slow phase did not begin within a minute")
	}
	cancel()
	select {
	case code := <-done:
		if code != exitInterrupted || !strings.Contains(errOut.String(), "interrupted") {
			t.Errorf("exit %d, stderr %q; want %d and interrupted", code, errOut.String(), exitInterrupted)
		}
	case <-time.After(time.Minute):
		t.Fatal("an interrupted demo did not stop within a minute")
	}
}

func TestTerminalIsFalseForABuffer(t *testing.T) {
	if term, w := terminal(&bytes.Buffer{}); term || w != 0 {
		t.Errorf("terminal(buffer) = %v, %d", term, w)
	}
}
