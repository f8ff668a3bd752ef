// Package exampletest builds and runs an example program, for the tests
// that check the examples work.
package exampletest

import (
	"bytes"
	"context"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// Run builds the example in the test's working directory (its package
// folder), runs it with args for at most timeout, and returns its standard
// output. The test fails when the build fails or the program does not exit
// 0; what it printed to standard error is in the failure.
func Run(t *testing.T, timeout time.Duration, args ...string) string {
	t.Helper()
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the go command is needed to build the example: %v", err)
	}
	bin := filepath.Join(t.TempDir(), "example")
	if out, err := exec.Command(goTool, "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err = cmd.Run()
	t.Logf("%s %v: %s\nstdout:\n%s\nstderr:\n%s", filepath.Base(bin), args, time.Since(start).Round(100*time.Millisecond), stdout.String(), stderr.String())
	if err != nil {
		t.Fatalf("the example failed: %v", err)
	}
	return stdout.String()
}
