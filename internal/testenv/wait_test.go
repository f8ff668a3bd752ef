package testenv

import (
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"
)

// fatalTB records the message of a Fatalf and ends the goroutine, as
// testing.T does, so that WaitFor's failure can be read.
type fatalTB struct {
	testing.TB
	msg string
}

func (f *fatalTB) Helper() {}

func (f *fatalTB) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// waitForFailure runs WaitFor on a fatalTB and returns its failure message
// ("" when it returned without failing).
func waitForFailure(t *testing.T, cond func() bool, state ...func() string) string {
	t.Helper()
	f := &fatalTB{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		WaitFor(f, 30*time.Millisecond, "the thing", cond, state...)
	}()
	<-done
	return f.msg
}

func TestWaitForReturnsOnceTheConditionHolds(t *testing.T) {
	n := 0
	if msg := waitForFailure(t, func() bool { n++; return n == 3 }); msg != "" {
		t.Fatalf("WaitFor failed: %s", msg)
	}
}

func TestWaitForSaysWhatItWaitedFor(t *testing.T) {
	msg := waitForFailure(t, func() bool { return false })
	if want := "timed out after 30ms waiting for the thing"; msg != want {
		t.Fatalf("failure %q, want %q", msg, want)
	}
}

func TestWaitForAddsTheStateAtTheTimeout(t *testing.T) {
	calls := 0
	msg := waitForFailure(t, func() bool { return false },
		func() string { calls++; return "acked 7" },
		func() string { return "breaker open" })
	if !strings.HasSuffix(msg, "waiting for the thing; then: acked 7; breaker open") {
		t.Fatalf("failure %q does not end with the state", msg)
	}
	if calls != 1 {
		t.Fatalf("state called %d times, want once, at the timeout", calls)
	}
}
