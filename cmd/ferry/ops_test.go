package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"net"
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
	"unicode"

	"github.com/ferrymq/ferry/cmd/ferry/internal/cli"
	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/kafka"
)

// ferry help lists the operating commands, and each has its help.
func TestHelpListsTheOperatingCommands(t *testing.T) {
	code, out, _ := ferry(t, nil, "help")
	for _, cmd := range []string{"lag", "dlq peek", "dlq redrive", "Exit status: 0 success, 1 failure, 2 bad usage"} {
		if code != exitOK || !strings.Contains(out, cmd) {
			t.Errorf("ferry help (exit %d) does not list %q:\n%s", code, cmd, out)
		}
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"help", "lag"}, "Usage: ferry lag SOURCE"},
		{[]string{"help", "dlq"}, "Usage: ferry dlq"},
		{[]string{"help", "dlq", "peek"}, "Usage: ferry dlq peek"},
		{[]string{"help", "dlq", "redrive"}, "Usage: ferry dlq redrive"},
	} {
		code, out, errOut := ferry(t, nil, tc.args...)
		if code != exitOK || !strings.Contains(out, tc.want) {
			t.Errorf("%v: exit %d, want 0 and %q:\n%s%s", tc.args, code, tc.want, out, errOut)
		}
	}
	for _, args := range [][]string{{"lag"}, {"dlq"}, {"dlq", "peek", "x"}, {"help", "dlq", "purge"}} {
		if code, _, _ := ferry(t, nil, args...); code != exitUsage {
			t.Errorf("%v: exit %d, want %d", args, code, exitUsage)
		}
	}
}

// helps are the help texts of every command.
var helps = [][]string{{"help"}, {"help", "demo"}, {"help", "lag"}, {"help", "dlq"}, {"help", "dlq", "peek"}, {"help", "dlq", "redrive"}}

// lag and dlq cannot read a mem:// broker (a new process's is empty), so
// their help does not offer one; the command refuses it, saying why.
func TestLagAndDLQOfferNoMemoryBroker(t *testing.T) {
	for _, args := range helps[2:] {
		_, out, _ := ferry(t, nil, args...)
		if strings.Contains(out, "mem://") {
			t.Errorf("ferry %s offers mem://:\n%s", strings.Join(args, " "), out)
		}
	}
	for _, args := range [][]string{{"lag", "orders", "--broker", "mem://orders"}, {"dlq", "peek", "orders-dlq", "--broker", "mem://"}} {
		code, _, errOut := ferry(t, nil, args...)
		if code != exitUsage || !strings.Contains(errOut, "a new ferry process has its own, empty one") {
			t.Errorf("%v: exit %d, stderr %q", args, code, errOut)
		}
	}
}

// Every help text fits 100 columns, and its prose is filled: no line of a
// paragraph runs past 80 columns (a line the wrap forgot, like "... at the
// end the" running on), and none but a paragraph's last, or one that opens
// a list with ':', ends short of 50 (a line broken mid-sentence).
func TestHelpTextIsWrapped(t *testing.T) {
	for _, args := range helps {
		_, out, _ := ferry(t, nil, args...)
		name := strings.Join(args, " ")
		lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
		for i, l := range lines {
			l = expandTabs(l)
			lines[i] = l
			if n := len([]rune(l)); n > 100 {
				t.Errorf("ferry %s: line %d is %d columns:\n%s", name, i+1, n, l)
			}
		}
		for _, para := range paragraphs(lines) {
			for j, l := range para {
				n := len([]rune(l))
				if n > 80 {
					t.Errorf("ferry %s: a line of prose is %d columns:\n%s", name, n, strings.Join(para, "\n"))
				}
				text := strings.TrimSpace(l)
				if j < len(para)-1 && len([]rune(text)) < 50 && !strings.HasSuffix(text, ":") {
					t.Errorf("ferry %s: a paragraph breaks after %d columns, mid-sentence:\n%s", name, len([]rune(text)), strings.Join(para, "\n"))
				}
			}
		}
	}
}

// paragraphs groups lines of prose: runs of lines of one indentation,
// ended by a blank line or another indentation. Usage lines, flags, and
// the rows of a list or a table (text aligned with a run of spaces, or a
// single word such as a URL), are no prose.
func paragraphs(lines []string) [][]string {
	var out [][]string
	var cur []string
	indent := -1
	flush := func() {
		if len(cur) > 0 {
			out = append(out, cur)
		}
		cur, indent = nil, -1
	}
	for _, l := range lines {
		text := strings.TrimLeftFunc(l, unicode.IsSpace)
		in := len(l) - len(text)
		if text == "" || strings.HasPrefix(text, "Usage:") || strings.Contains(text, "  ") || !strings.Contains(text, " ") || strings.HasPrefix(text, "-") {
			flush()
			continue
		}
		if in != indent {
			flush()
		}
		indent = in
		cur = append(cur, l)
	}
	flush()
	return out
}

func expandTabs(s string) string {
	var b strings.Builder
	col := 0
	for _, r := range s {
		if r == '\t' {
			n := 8 - col%8
			b.WriteString(strings.Repeat(" ", n))
			col += n
			continue
		}
		b.WriteRune(r)
		col++
	}
	return b.String()
}

// The broken wrap the test exists for is found.
func TestHelpTextCheckFindsABrokenWrap(t *testing.T) {
	broken := strings.Split(`Runs an order service that writes orders and their events through a
published twice on purpose, and one consumer is killed mid-handler. A status line shows the progress every second; at the end the
verdict checks that every order was paid exactly once, every poison message is
in the dead-letter queue with its reason.`, "\n")
	paras := paragraphs(broken)
	if len(paras) != 1 || len(paras[0]) != 4 {
		t.Fatalf("paragraphs: %q", paras)
	}
	long := 0
	for _, l := range paras[0] {
		if len(l) > 80 {
			long++
		}
	}
	if long != 1 {
		t.Errorf("%d lines past 80 columns, want the broken one", long)
	}
}

var (
	buildOnce sync.Once
	binDir    string // holds the built ferry
	binErr    error
)

// ferryBinary builds the ferry command once per test run and returns its
// path.
func ferryBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		goTool, err := exec.LookPath("go")
		if err != nil {
			binErr = err
			return
		}
		if binDir, binErr = os.MkdirTemp("", "ferry-bin-"); binErr != nil {
			return
		}
		out, err := exec.Command(goTool, "build", "-o", filepath.Join(binDir, "ferry"), "github.com/ferrymq/ferry/cmd/ferry").CombinedOutput()
		if err != nil {
			binErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if binErr != nil {
		t.Fatal(binErr)
	}
	return filepath.Join(binDir, "ferry")
}

// rawLogLine is a line in the log package's default format, which slog's
// default handler writes too: what must not reach a command's stderr.
var rawLogLine = regexp.MustCompile(`^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d `)

// What a library logs (here franz-go, through the Kafka adapter, failing
// to reach a broker that is not there) comes out through the command's
// own slog handler on stderr, not in the log package's raw format, and
// never on stdout.
func TestLibraryLogsGoThroughTheCommandsHandler(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens there now
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, ferryBinary(t), "lag", "orders", "--group", "billing", "--broker", "kafka://"+addr, "--samples", "2", "--interval", "100ms")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err = cmd.Run()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != exitFailed {
		t.Errorf("exit %v, want %d (no broker there)", err, exitFailed)
	}
	lines := strings.Split(strings.TrimSpace(stderr.String()), "\n")
	for _, l := range lines {
		if rawLogLine.MatchString(l) {
			t.Errorf("a line in the log package's raw format: %s", l)
		}
	}
	if !slices.ContainsFunc(lines, func(l string) bool {
		return strings.HasPrefix(l, "time=") && strings.Contains(l, `level=WARN msg="franz-go: unable to open connection to broker" addr=`+addr)
	}) {
		t.Errorf("franz-go's warning is not a line of the command's handler:\n%s", stderr.String())
	}
	if stdout.Len() != 0 {
		t.Errorf("the logs reached stdout: %q", stdout.String())
	}
}

// started runs the built ferry with args until its output holds want.
func started(t *testing.T, want string, args ...string) (*exec.Cmd, *syncBuffer) {
	t.Helper()
	cmd := exec.Command(ferryBinary(t), args...)
	out := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	deadline := time.Now().Add(time.Minute)
	for !strings.Contains(out.String(), want) {
		if time.Now().After(deadline) || cmd.ProcessState != nil {
			t.Fatalf("ferry %s did not print %q:\n%s", strings.Join(args, " "), want, out)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return cmd, out
}

// SIGTERM (a Kubernetes Job's deadline, timeout(1)) stops every command as
// SIGINT does, saying so, with exit 143. (The redrive's own test, which
// also checks that nothing in flight is lost, is in dlqcmd.)
func TestSIGTERMStopsEveryCommand(t *testing.T) {
	t.Run("demo", func(t *testing.T) {
		cmd, out := started(t, "-- phase slow", append([]string{"demo"}, short...)...)
		if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		err := cmd.Wait()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != cli.ExitTerminated || !strings.Contains(out.String(), "ferry demo: terminated (SIGTERM)") {
			t.Errorf("exit %v, want %d saying so:\n%s", err, cli.ExitTerminated, out)
		}
	})
	t.Run("lag", func(t *testing.T) {
		seeds := testenv.RequireKafka(t)
		kb, err := kafka.New(seeds)
		if err != nil {
			t.Fatal(err)
		}
		defer kb.Close()
		topic := testenv.UniqueName(t, "lag")
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := kb.CreateTopic(ctx, topic, kafka.TopicConfig{Partitions: 1}); err != nil {
			t.Fatal(err)
		}
		defer kb.DeleteTopic(context.Background(), topic)
		cmd, out := started(t, "verdict", "lag", topic, "--group", "billing", "--broker", "kafka://"+strings.Join(seeds, ","), "--samples", "2", "--interval", "200ms", "--watch")
		if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
			t.Fatal(err)
		}
		if err := cmd.Wait(); err != nil {
			t.Errorf("--watch ended by SIGINT: %v, want exit 0:\n%s", err, out)
		}
		// Without --watch, a command stopped before it is done says so.
		cmd, out = started(t, "", "lag", topic, "--group", "billing", "--broker", "kafka://"+strings.Join(seeds, ","), "--samples", "100", "--interval", "200ms")
		time.Sleep(time.Second)
		if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		err = cmd.Wait()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != cli.ExitTerminated || !strings.Contains(out.String(), "ferry lag: terminated (SIGTERM)") {
			t.Errorf("exit %v, want %d saying so:\n%s", err, cli.ExitTerminated, out)
		}
	})
}

// syncBuffer is a bytes.Buffer that a child's output and the test share.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// SetLogging routes slog's default and the log package through the
// command's handler.
func TestSetLoggingRoutesTheLogPackage(t *testing.T) {
	prev := slog.Default()
	flags, prefix := log.Flags(), log.Prefix()
	t.Cleanup(func() {
		slog.SetDefault(prev)
		log.SetFlags(flags)
		log.SetPrefix(prefix)
		log.SetOutput(os.Stderr)
	})
	var buf bytes.Buffer
	cli.SetLogging(&buf)
	log.Print("from the log package")
	slog.Warn("from a default slog", "k", "v")
	slog.Debug("below the level")
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 2 ||
		!regexp.MustCompile(`^time=\S+ level=INFO msg="from the log package"$`).MatchString(lines[0]) ||
		!regexp.MustCompile(`^time=\S+ level=WARN msg="from a default slog" k=v$`).MatchString(lines[1]) {
		t.Errorf("the handler wrote:\n%s", buf.String())
	}
}
