// Package usage measures what a timed part of a benchmark cost: this
// process's CPU time and heap allocations, and the CPU that the other
// processes on the machine took meanwhile.
//
// The other processes' share tells a quiet run from a loaded one. On a
// machine whose cores the brokers share, a broker is one of those other
// processes: for a consume of Kafka, SQS or RabbitMQ the share holds the
// broker's own work (which the run causes) as well as whatever else ran.
// The kernel counts the machine's busy time in ticks of 10 ms on each core,
// so over a span of well under a second the share is coarse; this
// process's own CPU time is exact.
package usage

import (
	"bufio"
	"bytes"
	"fmt"
	"math"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"
)

// Meter is a measurement started by Start and ended by Stop.
type Meter struct {
	start   time.Time
	own     time.Duration
	ownOK   bool
	machine machineTicks
	mem     runtime.MemStats
}

// Span is what a timed part cost.
type Span struct {
	// Wall is the time from Start to Stop.
	Wall time.Duration
	// CPU is this process's user and system CPU time, in every thread
	// (the garbage collector's too). Zero when the OS does not say
	// (CPUKnown false).
	CPU      time.Duration
	CPUKnown bool
	// Others is the CPU time every other process (and the kernel's
	// interrupt handling) took on all cores: the machine's busy time
	// from /proc/stat less CPU. Cores is how many cores the machine has
	// online; zero when /proc/stat could not be read or the span was too
	// short for its 10 ms ticks, and then Others is unknown.
	Others time.Duration
	Cores  int
	// Steal is the time the hypervisor gave this machine's cores to
	// other machines, on all cores (zero outside a VM).
	Steal time.Duration
	// Mallocs and Bytes are the heap allocations this process made, and
	// their bytes (runtime.MemStats Mallocs and TotalAlloc).
	Mallocs, Bytes uint64
}

// Start starts a measurement. It reads the heap statistics, which stops
// the world for a moment: call it outside the part it measures, just
// before it.
func Start() *Meter {
	m := &Meter{}
	runtime.ReadMemStats(&m.mem)
	m.own, m.ownOK = ownCPU()
	m.machine, _ = readMachine()
	m.start = time.Now()
	return m
}

// Stop ends the measurement and returns what the part cost.
func (m *Meter) Stop() Span {
	wall := time.Since(m.start)
	machine, machineErr := readMachine()
	own, ownOK := ownCPU()
	var mem runtime.MemStats
	runtime.ReadMemStats(&mem)
	s := Span{Wall: wall, Mallocs: mem.Mallocs - m.mem.Mallocs, Bytes: mem.TotalAlloc - m.mem.TotalAlloc}
	if ownOK && m.ownOK {
		s.CPU, s.CPUKnown = own-m.own, true
	}
	if machineErr == nil && m.machine.cores > 0 && machine.cores == m.machine.cores {
		total := machine.total - m.machine.total
		if total > 0 {
			// The ticks' unit (USER_HZ) is not needed: the ticks of all
			// cores over the span are the span's wall time on each core.
			capacity := float64(wall) * float64(machine.cores)
			busy := time.Duration(capacity * float64(machine.busy-m.machine.busy) / float64(total))
			s.Steal = time.Duration(capacity * float64(machine.steal-m.machine.steal) / float64(total))
			s.Cores = machine.cores
			// Ticks sample what ran when each one fired, and CPU is
			// exact, so a quiet machine can come out a little below 0.
			s.Others = max(busy-s.CPU, 0)
		}
	}
	return s
}

// CPUPerMsg is this process's CPU time per message, in microseconds
// (NaN when unknown or n is not positive).
func (s Span) CPUPerMsg(n int) float64 {
	if !s.CPUKnown || n <= 0 {
		return math.NaN()
	}
	return float64(s.CPU) / float64(time.Microsecond) / float64(n)
}

// OthersShare is the share of the machine's cores (0 to 1) the other
// processes took during the span (NaN when unknown).
func (s Span) OthersShare() float64 {
	return Share(s.Others, s.Wall, s.Cores)
}

// Share is the share of cores cores over wall that cpu is (NaN when
// cores or wall is not positive), capped at 1.
func Share(cpu, wall time.Duration, cores int) float64 {
	if cores <= 0 || wall <= 0 {
		return math.NaN()
	}
	return min(float64(cpu)/(float64(wall)*float64(cores)), 1)
}

// machineTicks is the first line of /proc/stat, summed over all cores.
type machineTicks struct {
	busy, steal, total uint64
	cores              int
}

// readMachine reads /proc/stat.
func readMachine() (machineTicks, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return machineTicks{}, err
	}
	return parseStat(b)
}

// parseStat reads the all-cores line and counts the per-core lines of
// /proc/stat (proc(5)): cpu user nice system idle iowait irq softirq steal
// guest guest_nice, in ticks. Guest time is already inside user and nice.
func parseStat(b []byte) (machineTicks, error) {
	var t machineTicks
	found := false
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 || !strings.HasPrefix(f[0], "cpu") {
			continue
		}
		if f[0] != "cpu" {
			t.cores++
			continue
		}
		if len(f) < 5 {
			return machineTicks{}, fmt.Errorf("/proc/stat: the cpu line has %d fields, want at least 4 counters", len(f)-1)
		}
		var v [8]uint64
		for i := range min(len(f)-1, len(v)) {
			n, err := strconv.ParseUint(f[i+1], 10, 64)
			if err != nil {
				return machineTicks{}, fmt.Errorf("/proc/stat: the cpu line's field %d: %w", i+1, err)
			}
			v[i] = n
		}
		user, nice, system, idle, iowait, irq, softirq, steal := v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]
		t.busy = user + nice + system + irq + softirq
		t.steal = steal
		t.total = t.busy + idle + iowait + steal
		found = true
	}
	if err := sc.Err(); err != nil {
		return machineTicks{}, fmt.Errorf("/proc/stat: %w", err)
	}
	if !found {
		return machineTicks{}, fmt.Errorf("/proc/stat: no cpu line")
	}
	return t, nil
}
