package main

import (
	"strings"
	"testing"
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
