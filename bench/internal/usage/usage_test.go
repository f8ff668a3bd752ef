package usage

import (
	"math"
	"os"
	"os/exec"
	"runtime"
	"sync/atomic"
	"testing"
	"time"
)

// burnEnv, when set to a duration, makes the test binary a child that
// spins on one core for that long and exits: the other process of
// TestOthersCountsAChildProcess.
const burnEnv = "FERRY_USAGE_TEST_BURN"

func TestMain(m *testing.M) {
	if v := os.Getenv(burnEnv); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			os.Exit(2)
		}
		spin(d)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

var sink atomic.Uint64

// spin keeps one core busy for d of wall time.
func spin(d time.Duration) {
	x := uint64(1)
	for end := time.Now().Add(d); time.Now().Before(end); {
		for range 10_000 {
			x = x*6364136223846793005 + 1442695040888963407
		}
	}
	sink.Add(x)
}

// TestOthersCountsAChildProcess: a child process that burns CPU during the
// span shows in Others (at least the CPU the kernel says it used, less a
// few 10 ms ticks; other engineers' load on the machine can only add), and
// not in this process's CPU.
func TestOthersCountsAChildProcess(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	m := Start()
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), burnEnv+"=400ms")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("child: %v: %s", err, out)
	}
	s := m.Stop()
	child := cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
	t.Logf("child used %v of CPU; span: wall %v, own %v, others %v on %d cores (share %.2f), steal %v", child, s.Wall, s.CPU, s.Others, s.Cores, s.OthersShare(), s.Steal)
	if child < 100*time.Millisecond {
		t.Fatalf("the child used only %v of CPU in 400ms: it did not spin", child)
	}
	if s.Cores < 1 {
		t.Fatalf("Cores %d: /proc/stat not read", s.Cores)
	}
	if s.Others < child*8/10-30*time.Millisecond {
		t.Errorf("Others %v: less than the child's %v of CPU", s.Others, child)
	}
	if s.CPU > child/2 {
		t.Errorf("own CPU %v while waiting for a child that used %v: the child's CPU counted as this process's", s.CPU, child)
	}
	capacity := s.Wall * time.Duration(s.Cores)
	if s.Others > capacity {
		t.Errorf("Others %v is more than the %v the cores had", s.Others, capacity)
	}
	if want := float64(s.Others) / float64(capacity); math.Abs(s.OthersShare()-want) > 1e-9 {
		t.Errorf("OthersShare %v, want Others/(Wall×Cores) = %v", s.OthersShare(), want)
	}
}

// TestAllocationsCounted: the span counts the allocations made in it and
// their bytes.
func TestAllocationsCounted(t *testing.T) {
	const n, size = 1000, 1024
	keep := make([][]byte, n)
	m := Start()
	for i := range keep {
		keep[i] = make([]byte, size)
	}
	s := m.Stop()
	if s.Mallocs < n || s.Mallocs > n+200 {
		t.Errorf("Mallocs %d for %d allocations", s.Mallocs, n)
	}
	if s.Bytes < n*size || s.Bytes > n*size+200*1024 {
		t.Errorf("Bytes %d for %d allocations of %d bytes", s.Bytes, n, size)
	}
	runtime.KeepAlive(keep)
}

func TestParseStat(t *testing.T) {
	const stat = `cpu  1121906 7 227398 1340798 132041 3 11841 14717 500 0
cpu0 560534 0 111343 690304 51882 0 5037 7334 0 0
cpu1 561371 7 116054 650493 80159 3 6804 7383 0 0
intr 1234
ctxt 5678
`
	got, err := parseStat([]byte(stat))
	if err != nil {
		t.Fatal(err)
	}
	busy := uint64(1121906 + 7 + 227398 + 3 + 11841)
	want := machineTicks{busy: busy, steal: 14717, total: busy + 1340798 + 132041 + 14717, cores: 2}
	if got != want {
		t.Errorf("parseStat = %+v, want %+v", got, want)
	}
	// An old kernel's line, without irq, softirq and steal.
	got, err = parseStat([]byte("cpu 10 0 5 100\ncpu0 10 0 5 100\n"))
	if err != nil {
		t.Fatal(err)
	}
	if want := (machineTicks{busy: 15, total: 115, cores: 1}); got != want {
		t.Errorf("old kernel: parseStat = %+v, want %+v", got, want)
	}
	for _, bad := range []string{"", "intr 1\n", "cpu 1 2\n", "cpu 1 x 3 4\n"} {
		if _, err := parseStat([]byte(bad)); err == nil {
			t.Errorf("parseStat(%q): no error", bad)
		}
	}
}

func TestShare(t *testing.T) {
	if got := Share(time.Second, time.Second, 2); got != 0.5 {
		t.Errorf("Share(1s, 1s, 2) = %v, want 0.5", got)
	}
	if got := Share(3*time.Second, time.Second, 2); got != 1 {
		t.Errorf("Share(3s, 1s, 2) = %v, want 1 (capped)", got)
	}
	if got := Share(time.Second, time.Second, 0); !math.IsNaN(got) {
		t.Errorf("Share with no cores = %v, want NaN", got)
	}
}
