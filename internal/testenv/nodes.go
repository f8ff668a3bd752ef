package testenv

import (
	"context"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// KillNode SIGKILLs the process whose pid the file pidFile holds (a node
// of a cluster that integration/brokers.sh started) and waits until addr,
// the node's client address, refuses connections.
func KillNode(t testing.TB, pidFile, addr string) {
	t.Helper()
	b, err := os.ReadFile(pidFile)
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatalf("%s: %v", pidFile, err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatalf("kill %d (%s): %v", pid, pidFile, err)
	}
	WaitFor(t, 10*time.Second, "the killed node's port "+addr+" to refuse connections", func() bool {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
		}
		return err != nil
	})
}

// RunCommand runs cmdline (words separated by spaces, no quoting) for at
// most timeout, failing t with its output when it fails: the command a
// make target gives a test to start the nodes of a cluster that are down.
func RunCommand(t testing.TB, cmdline string, timeout time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	f := strings.Fields(cmdline)
	if len(f) == 0 {
		t.Fatal("RunCommand: no command")
	}
	if out, err := exec.CommandContext(ctx, f[0], f[1:]...).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", cmdline, err, out)
	}
}
