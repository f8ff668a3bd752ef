package testenv

import (
	"errors"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

func TestPostgresClusterKeepsDataOverStopStartAndRestart(t *testing.T) {
	c := StartPostgresCluster(t)
	ctx := Context(t, 3*time.Minute)
	if !strings.HasPrefix(c.URL(), "postgres://postgres@127.0.0.1:") || strings.HasSuffix(c.Addr(), ":5432") {
		t.Fatalf("URL %s, Addr %s: want a port of its own on 127.0.0.1", c.URL(), c.Addr())
	}
	conn, err := pgx.Connect(ctx, c.URL())
	if err != nil {
		t.Fatalf("connect %s: %v", c.URL(), err)
	}
	if _, err := conn.Exec(ctx, `CREATE TABLE kept (v text); INSERT INTO kept VALUES ('hello')`); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)
	read := func() (string, error) {
		conn, err := pgx.Connect(ctx, c.URL())
		if err != nil {
			return "", err
		}
		defer conn.Close(ctx)
		var v string
		err = conn.QueryRow(ctx, `SELECT v FROM kept`).Scan(&v)
		return v, err
	}

	pid, err := c.PID()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Stop(ctx, StopFast); err != nil {
		t.Fatal(err)
	}
	if _, err := read(); err == nil {
		t.Fatal("connected to a stopped server")
	}
	if _, err := c.PID(); err == nil {
		t.Fatal("PID of a stopped server: no error")
	}
	if err := c.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if v, err := read(); err != nil || v != "hello" {
		t.Fatalf("after stop and start: %q, %v", v, err)
	}

	before, err := c.PID()
	if err != nil {
		t.Fatal(err)
	}
	// A commit acknowledged right before a crash survives it.
	conn, err = pgx.Connect(ctx, c.URL())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `UPDATE kept SET v = 'committed before the crash'`); err != nil {
		t.Fatal(err)
	}
	if err := c.Restart(ctx, StopImmediate); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)
	after, err := c.PID()
	if err != nil {
		t.Fatal(err)
	}
	if before == after || pid == after {
		t.Fatalf("server process %d before the restart, %d after: not restarted", before, after)
	}
	if v, err := read(); err != nil || v != "committed before the crash" {
		t.Fatalf("after a crash restart: %q, %v: a committed transaction was lost", v, err)
	}
	if err := c.Stop(ctx, "gently"); err == nil {
		t.Fatal("Stop with an unknown mode: no error")
	}
}

// gone reports whether process pid has ended (a zombie counts: it runs no
// more and waits only for its parent to reap it).
func gone(pid int) bool {
	if err := syscall.Kill(pid, 0); errors.Is(err, syscall.ESRCH) {
		return true
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return true
	}
	// pid (comm) state ...: the state follows the last ')'.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i >= 0 && i+2 < len(s) && (s[i+2] == 'Z' || s[i+2] == 'X')
}

func TestPostgresClusterStoppedAndDeletedWhenTheTestEnds(t *testing.T) {
	var (
		pid int
		dir string
	)
	t.Run("cluster", func(t *testing.T) {
		c := StartPostgresCluster(t)
		var err error
		if pid, err = c.PID(); err != nil {
			t.Fatal(err)
		}
		dir = c.dir
	})
	if pid == 0 {
		t.Skip("no cluster was started")
	}
	if !gone(pid) {
		t.Errorf("server process %d still runs after its test ended", pid)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("cluster folder %s still there after its test ended: %v", dir, err)
	}
}

func TestPostgresClusterWithoutBinariesSkipsOrFails(t *testing.T) {
	old := postgresBinDirs
	postgresBinDirs = "/nonexistent/postgresql/*/bin"
	t.Cleanup(func() { postgresBinDirs = old })
	t.Setenv("PATH", t.TempDir())

	t.Setenv(EnvRequireBrokers, "")
	r := &recorder{TB: t}
	if c := StartPostgresCluster(r); c != nil || r.failed != "" || !strings.Contains(r.skipped, "make brokers") {
		t.Errorf("without %s: cluster %v, skipped %q, failed %q", EnvRequireBrokers, c, r.skipped, r.failed)
	}

	t.Setenv(EnvRequireBrokers, "1")
	r = &recorder{TB: t}
	if c := StartPostgresCluster(r); c != nil || r.skipped != "" || !strings.Contains(r.failed, "make brokers") {
		t.Errorf("with %s=1: cluster %v, skipped %q, failed %q", EnvRequireBrokers, c, r.skipped, r.failed)
	}
}
