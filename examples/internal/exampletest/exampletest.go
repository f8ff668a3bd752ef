// Package exampletest builds and runs an example program, for the tests
// that check the examples work.
package exampletest

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Build builds the program in the test's working directory (its package
// folder) and returns the path of the binary, in a folder removed when the
// test ends.
func Build(t *testing.T) string {
	t.Helper()
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the go command is needed to build the example: %v", err)
	}
	bin := filepath.Join(t.TempDir(), "example")
	if out, err := exec.Command(goTool, "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// Run builds the example in the test's working directory (its package
// folder), runs it with args for at most timeout, and returns its standard
// output. The test fails when the build fails or the program does not exit
// 0; what it printed to standard error is in the failure.
func Run(t *testing.T, timeout time.Duration, args ...string) string {
	t.Helper()
	bin := Build(t)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err := cmd.Run()
	t.Logf("%s %v: %s\nstdout:\n%s\nstderr:\n%s", filepath.Base(bin), args, time.Since(start).Round(100*time.Millisecond), stdout.String(), stderr.String())
	if err != nil {
		t.Fatalf("the example failed: %v", err)
	}
	return stdout.String()
}

// Process is a program started by Start: its output is recorded line by
// line as it comes.
type Process struct {
	t     *testing.T
	cmd   *exec.Cmd
	start time.Time
	done  chan struct{} // closed once the program exited and its output is read
	err   error         // the program's exit, once done is closed

	mu      sync.Mutex
	stdout  []string
	stderr  bytes.Buffer
	changed chan struct{} // closed and replaced on every new line of stdout
}

// Start starts the program bin with args and env added to the test's
// environment. The program is killed, if it still runs, when the test ends;
// its output is then in the test's log.
func Start(t *testing.T, bin string, env []string, args ...string) *Process {
	t.Helper()
	p := &Process{t: t, cmd: exec.Command(bin, args...), done: make(chan struct{}), changed: make(chan struct{})}
	p.cmd.Env = append(os.Environ(), env...)
	out, err := p.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	p.cmd.Stderr = lockedWriter{&p.mu, &p.stderr}
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	p.start = time.Now()
	go func() {
		sc := bufio.NewScanner(out)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			p.mu.Lock()
			p.stdout = append(p.stdout, sc.Text())
			close(p.changed)
			p.changed = make(chan struct{})
			p.mu.Unlock()
		}
		_, _ = io.Copy(io.Discard, out)
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = p.cmd.Process.Kill()
			<-p.done
		}
		t.Logf("%s %v: ran %s, %v\nstdout:\n%s\nstderr:\n%s", filepath.Base(bin), args,
			time.Since(p.start).Round(100*time.Millisecond), p.err, strings.Join(p.Stdout(), "\n"), p.Stderr())
	})
	return p
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(b)
}

// Stdout returns the lines the program printed to standard output so far.
func (p *Process) Stdout() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.stdout...)
}

// Stderr returns what the program printed to standard error so far.
func (p *Process) Stderr() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stderr.String()
}

// WaitFor waits until a line of standard output matches re, and returns
// it. The test fails when the program exits first or timeout passes.
func (p *Process) WaitFor(re *regexp.Regexp, timeout time.Duration) string {
	p.t.Helper()
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	seen := 0
	for {
		p.mu.Lock()
		lines, changed := p.stdout[seen:], p.changed
		seen = len(p.stdout)
		for _, l := range lines {
			if re.MatchString(l) {
				p.mu.Unlock()
				return l
			}
		}
		p.mu.Unlock()
		select {
		case <-changed:
		case <-p.done:
			// The last lines may have come with the exit.
			for _, l := range p.Stdout()[seen:] {
				if re.MatchString(l) {
					return l
				}
			}
			p.t.Fatalf("the program exited (%v) before printing a line matching %q", p.err, re)
		case <-deadline.C:
			p.t.Fatalf("no line matching %q within %s", re, timeout)
		}
	}
}

// Signal sends sig to the program.
func (p *Process) Signal(sig syscall.Signal) {
	p.t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		p.t.Fatalf("signal %v: %v", sig, err)
	}
}

// Wait waits for the program to exit, at most timeout, and returns how it
// exited: nil for status 0. The test fails when it is still running then.
func (p *Process) Wait(timeout time.Duration) error {
	p.t.Helper()
	select {
	case <-p.done:
		return p.err
	case <-time.After(timeout):
		p.t.Fatalf("the program still runs %s later", timeout)
		return nil
	}
}

// Unfinished returns the IDs named by the lines matching started that no
// line matching finished names: the work a program began and did not end.
// Each regular expression has one group, the ID.
func Unfinished(lines []string, started, finished *regexp.Regexp) []string {
	open := map[string]bool{}
	var order []string
	for _, l := range lines {
		if m := started.FindStringSubmatch(l); m != nil {
			if !open[m[1]] {
				order = append(order, m[1])
			}
			open[m[1]] = true
		}
		if m := finished.FindStringSubmatch(l); m != nil {
			open[m[1]] = false
		}
	}
	var out []string
	for _, id := range order {
		if open[id] {
			out = append(out, id)
		}
	}
	return out
}

// CheckDrainsOnSIGTERM runs one of the order examples (bin, with args, which
// must make each payment slow enough that some are in flight at any time),
// sends it SIGTERM once it paid its first order, and checks that it exits 0,
// saying it stopped, that payments begun before the signal finished after
// it, and that no payment it began was left unfinished: the consumer
// drained before the program ended.
func CheckDrainsOnSIGTERM(t *testing.T, bin string, args ...string) {
	t.Helper()
	p := Start(t, bin, nil, args...)
	began := regexp.MustCompile(`^billing: paying (o-\d+)$`)
	ended := regexp.MustCompile(`^billing: paid (o-\d+) `)
	p.WaitFor(ended, 60*time.Second)
	// Signal while the output shows payments begun and not finished.
	var inFlight []string
	atSignal := 0
	for deadline := time.Now().Add(10 * time.Second); len(inFlight) == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("no payment in flight for 10s after the first one finished: make each payment slower")
		}
		lines := p.Stdout()
		atSignal, inFlight = len(lines), Unfinished(lines, began, ended)
	}
	p.Signal(syscall.SIGTERM)
	if err := p.Wait(45 * time.Second); err != nil {
		t.Fatalf("after SIGTERM the example exited with %v, want status 0", err)
	}
	lines := p.Stdout()
	if last := lines[len(lines)-1]; !strings.HasPrefix(last, "stopped (terminated signal received): ") {
		t.Errorf("last line %q, want the example to say SIGTERM stopped it before every order was paid", last)
	}
	if open := Unfinished(lines, began, ended); len(open) > 0 {
		t.Errorf("payments begun and never finished (the consumer did not drain): %v", open)
	}
	drained := 0
	for _, l := range lines[atSignal:] {
		if m := ended.FindStringSubmatch(l); m != nil && slices.Contains(inFlight, m[1]) {
			drained++
		}
	}
	if drained == 0 {
		t.Errorf("no payment in flight at SIGTERM (%v) finished after it", inFlight)
	}
	t.Logf("%d payments in flight at SIGTERM, %d finished after it", len(inFlight), drained)
}
