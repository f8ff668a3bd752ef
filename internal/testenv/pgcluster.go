package testenv

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// A PostgresCluster is a PostgreSQL server of one test's own: a fresh data
// folder under the temporary directory, listening on a free port of
// 127.0.0.1, with trust authentication for the user postgres and a database
// named ferry. A test may stop, start and restart it (what the shared server
// on 127.0.0.1:5432 must never be, since other packages' tests run against it
// at the same time). It is stopped and its folder deleted when the test ends.
//
// It needs the PostgreSQL server binaries (initdb, pg_ctl, postgres), which
// `make brokers` installs: the newest /usr/lib/postgresql/*/bin, or else the
// folder of pg_ctl on PATH. Those programs refuse to run as root; a test
// running as root runs them as the user postgres (with runuser), any other
// user runs them as itself.
//
// The server is set up for tests: fsync and full-page writes are off, so a
// crash of the machine may lose data, but synchronous commit stays on, so a
// crash of the server (Stop with StopImmediate) loses no committed
// transaction, as with a production configuration.
type PostgresCluster struct {
	bin  string   // folder of initdb, pg_ctl, postgres
	dir  string   // root of the cluster's files; deleted at the end
	data string   // data folder
	sock string   // unix socket folder
	log  string   // server log
	as   []string // prefix that runs a command as the cluster's owner
	port int
}

// StopMode is how PostgresCluster.Stop shuts the server down; the values are
// those of pg_ctl's -m flag.
type StopMode string

const (
	// StopSmart waits for every client to disconnect.
	StopSmart StopMode = "smart"
	// StopFast rolls back open transactions, disconnects the clients and
	// shuts down cleanly: what a service manager's restart does.
	StopFast StopMode = "fast"
	// StopImmediate kills the server without a clean shutdown, as a crash
	// does; it recovers from its WAL at the next start.
	StopImmediate StopMode = "immediate"
)

// postgresBinDirs is where the server binaries are looked for, newest
// version first (a variable so that tests can point it elsewhere).
var postgresBinDirs = "/usr/lib/postgresql/*/bin"

// postgresUser is the user that runs the server when the test runs as root.
var postgresUser = "postgres"

// clusterOpTimeout bounds one pg_ctl or initdb call.
const clusterOpTimeout = 90 * time.Second

// postgresBinDir finds a folder that holds initdb, pg_ctl and postgres.
func postgresBinDir() (string, error) {
	dirs, _ := filepath.Glob(postgresBinDirs)
	// Newest version first: compare the number in .../postgresql/NN/bin.
	version := func(d string) int {
		n, _ := strconv.Atoi(filepath.Base(filepath.Dir(d)))
		return n
	}
	slices.SortFunc(dirs, func(a, b string) int { return version(b) - version(a) })
	if p, err := exec.LookPath("pg_ctl"); err == nil {
		dirs = append(dirs, filepath.Dir(p))
	}
	for _, d := range dirs {
		if hasServerBinaries(d) {
			return d, nil
		}
	}
	return "", fmt.Errorf("no PostgreSQL server binaries (initdb, pg_ctl, postgres) in %s or on PATH", postgresBinDirs)
}

func hasServerBinaries(dir string) bool {
	for _, name := range []string{"initdb", "pg_ctl", "postgres"} {
		fi, err := os.Stat(filepath.Join(dir, name))
		if err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
			return false
		}
	}
	return true
}

// unavailable skips t, or fails it when FERRY_REQUIRE_BROKERS=1, because a
// private cluster cannot be started; the message names the command that
// installs PostgreSQL.
func unavailable(t testing.TB, err error) {
	t.Helper()
	msg := fmt.Sprintf("cannot start a private PostgreSQL cluster: %v; install PostgreSQL with make brokers (integration/brokers.sh up)", err)
	if RequireBrokers() {
		t.Fatalf("%s (%s=1 makes this a failure)", msg, EnvRequireBrokers)
		return
	}
	t.Skipf("%s, or set %s=1 to fail instead of skipping", msg, EnvRequireBrokers)
}

// StartPostgresCluster creates, starts and returns a private PostgreSQL
// cluster for t, and stops it (immediately: nothing of it is kept) and
// deletes its files when t ends. Without the server binaries, or running as
// root without a postgres user, t is skipped, or fails when
// FERRY_REQUIRE_BROKERS=1; the message names `make brokers`. A cluster that
// does not come up fails t with the end of the server's log. It returns nil
// only when t was skipped or failed.
func StartPostgresCluster(t testing.TB) *PostgresCluster {
	t.Helper()
	bin, err := postgresBinDir()
	if err != nil {
		unavailable(t, err)
		return nil
	}
	c := &PostgresCluster{bin: bin}
	var uid, gid = -1, -1
	if os.Geteuid() == 0 {
		u, err := user.Lookup(postgresUser)
		if err != nil {
			unavailable(t, fmt.Errorf("running as root, and initdb refuses root: no user %q to run the server as: %w", postgresUser, err))
			return nil
		}
		uid, _ = strconv.Atoi(u.Uid)
		gid, _ = strconv.Atoi(u.Gid)
		c.as = []string{"runuser", "-u", postgresUser, "--"}
	}

	// The server's user must reach the folder, and a unix socket path must
	// stay under ~107 bytes: a short folder in /tmp.
	tmp := os.TempDir()
	if uid >= 0 {
		tmp = "/tmp"
	}
	c.dir, err = os.MkdirTemp(tmp, "ferry-pg-")
	if err != nil {
		t.Fatalf("private PostgreSQL cluster: %v", err)
		return nil
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), clusterOpTimeout)
		defer cancel()
		if err := c.Stop(ctx, StopImmediate); err != nil && c.running() {
			t.Errorf("private PostgreSQL cluster: stopping it at the end of the test: %v", err)
			return // keep the folder for a look
		}
		os.RemoveAll(c.dir)
	})
	c.data = filepath.Join(c.dir, "data")
	c.sock = filepath.Join(c.dir, "run")
	c.log = filepath.Join(c.dir, "postgres.log")
	if err := os.Mkdir(c.sock, 0o700); err != nil {
		t.Fatalf("private PostgreSQL cluster: %v", err)
		return nil
	}
	if err := os.WriteFile(c.log, nil, 0o600); err != nil {
		t.Fatalf("private PostgreSQL cluster: %v", err)
		return nil
	}
	if uid >= 0 {
		for _, p := range []string{c.dir, c.sock, c.log} {
			if err := os.Chown(p, uid, gid); err != nil {
				t.Fatalf("private PostgreSQL cluster: give %s to %s: %v", p, postgresUser, err)
				return nil
			}
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), 2*clusterOpTimeout)
	defer cancel()
	if out, err := c.run(ctx, "initdb", "-D", c.data, "-U", "postgres", "-E", "UTF8", "--locale=C",
		"--auth=trust", "--no-sync", "--no-instructions"); err != nil {
		t.Fatalf("private PostgreSQL cluster: initdb: %v\n%s", err, out)
		return nil
	}
	// A port picked free can be taken before the server binds it: try again
	// with another.
	for try := 1; ; try++ {
		if c.port, err = freePort(); err != nil {
			t.Fatalf("private PostgreSQL cluster: %v", err)
			return nil
		}
		if err = c.Start(ctx); err == nil {
			break
		}
		if try == 3 {
			t.Fatalf("private PostgreSQL cluster: %v", err)
			return nil
		}
	}
	if err := c.createDatabase(ctx, "ferry"); err != nil {
		t.Fatalf("private PostgreSQL cluster: %v", err)
		return nil
	}
	return c
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("pick a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// run runs one of the server binaries as the cluster's owner and returns
// its combined output.
func (c *PostgresCluster) run(ctx context.Context, prog string, args ...string) ([]byte, error) {
	argv := append(append(slices.Clone(c.as), filepath.Join(c.bin, prog)), args...)
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Dir = "/" // a folder every user can enter
	cmd.Env = append(os.Environ(), "LC_ALL=C")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	// The server started by pg_ctl writes to its log, not to our pipes; do
	// not wait for it should it hold them anyway.
	cmd.WaitDelay = 5 * time.Second
	err := cmd.Run()
	return out.Bytes(), err
}

// URL returns the connection URL of the cluster's database ferry, as user
// postgres over TCP.
func (c *PostgresCluster) URL() string {
	return fmt.Sprintf("postgres://postgres@%s/ferry?sslmode=disable", c.Addr())
}

// Addr returns the host:port the server listens on.
func (c *PostgresCluster) Addr() string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(c.port))
}

// Start starts the server and waits until it accepts connections.
func (c *PostgresCluster) Start(ctx context.Context) error {
	opts := strings.Join([]string{
		"-c listen_addresses=127.0.0.1",
		"-p " + strconv.Itoa(c.port),
		"-c unix_socket_directories=" + c.sock,
		"-c fsync=off -c full_page_writes=off",
		"-c max_connections=50 -c shared_buffers=16MB",
	}, " ")
	out, err := c.run(ctx, "pg_ctl", "start", "-D", c.data, "-l", c.log, "-w",
		"-t", strconv.Itoa(int(clusterOpTimeout/time.Second)), "-o", opts)
	if err != nil {
		return fmt.Errorf("pg_ctl start on port %d: %w\n%s\nserver log:\n%s", c.port, err, out, c.LogTail(20))
	}
	return nil
}

// Stop shuts the server down in mode and waits until it has stopped.
func (c *PostgresCluster) Stop(ctx context.Context, mode StopMode) error {
	switch mode {
	case StopSmart, StopFast, StopImmediate:
	default:
		return fmt.Errorf("testenv: unknown stop mode %q", mode)
	}
	out, err := c.run(ctx, "pg_ctl", "stop", "-D", c.data, "-m", string(mode), "-w",
		"-t", strconv.Itoa(int(clusterOpTimeout/time.Second)))
	if err != nil {
		return fmt.Errorf("pg_ctl stop -m %s: %w\n%s", mode, err, out)
	}
	return nil
}

// Restart stops the server in mode and starts it again on the same port,
// with its data.
func (c *PostgresCluster) Restart(ctx context.Context, mode StopMode) error {
	if err := c.Stop(ctx, mode); err != nil {
		return err
	}
	return c.Start(ctx)
}

// PID returns the process id of the running server (the postmaster).
func (c *PostgresCluster) PID() (int, error) {
	b, err := os.ReadFile(filepath.Join(c.data, "postmaster.pid"))
	if err != nil {
		return 0, fmt.Errorf("testenv: the server is not running: %w", err)
	}
	first, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(first))
	if err != nil {
		return 0, fmt.Errorf("testenv: postmaster.pid: %w", err)
	}
	return pid, nil
}

// running reports whether pg_ctl finds the server running.
func (c *PostgresCluster) running() bool {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := c.run(ctx, "pg_ctl", "status", "-D", c.data)
	return err == nil
}

// LogTail returns the last n lines of the server's log.
func (c *PostgresCluster) LogTail(n int) string {
	b, err := os.ReadFile(c.log)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

func (c *PostgresCluster) createDatabase(ctx context.Context, name string) error {
	conn, err := pgx.Connect(ctx, fmt.Sprintf("postgres://postgres@%s/postgres?sslmode=disable", c.Addr()))
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return fmt.Errorf("create database %s: %w", name, err)
	}
	return nil
}
