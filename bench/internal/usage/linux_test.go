package usage

import (
	"math"
	"runtime"
	"syscall"
	"testing"
	"time"
	"unsafe"
)

// threadCPU is the calling thread's CPU time (clock_gettime with
// CLOCK_THREAD_CPUTIME_ID): the goroutine must be locked to its thread.
func threadCPU(t *testing.T) time.Duration {
	const clockThreadCPUTimeID = 3
	var ts syscall.Timespec
	if _, _, errno := syscall.Syscall(syscall.SYS_CLOCK_GETTIME, clockThreadCPUTimeID, uintptr(unsafe.Pointer(&ts)), 0); errno != 0 {
		t.Errorf("clock_gettime: %v", errno)
	}
	return time.Duration(ts.Nano())
}

// TestCPUCountsThisProcess: a goroutine that burns CPU during the span
// moves this process's CPU by what its thread used (as the kernel's
// per-thread clock says, a source independent of getrusage), plus at most
// a little for the test's other threads.
func TestCPUCountsThisProcess(t *testing.T) {
	var thread time.Duration
	m := Start()
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		t0 := threadCPU(t)
		spin(300 * time.Millisecond)
		thread = threadCPU(t) - t0
	}()
	<-done
	s := m.Stop()
	t.Logf("the spinning thread used %v; span: wall %v, own %v, others %v", thread, s.Wall, s.CPU, s.Others)
	if !s.CPUKnown {
		t.Fatal("CPUKnown false on a unix")
	}
	if thread < 50*time.Millisecond {
		t.Fatalf("the spinning thread used only %v of CPU in 300ms", thread)
	}
	if s.CPU < thread-time.Millisecond {
		t.Errorf("own CPU %v, less than the %v one of its threads used", s.CPU, thread)
	}
	if s.CPU > thread+50*time.Millisecond {
		t.Errorf("own CPU %v, far more than the %v its only busy thread used", s.CPU, thread)
	}
	if got, want := s.CPUPerMsg(1000), float64(s.CPU)/1e3/1000; math.Abs(got-want) > 1e-9 {
		t.Errorf("CPUPerMsg(1000) = %v µs, want %v", got, want)
	}
	if !math.IsNaN(s.CPUPerMsg(0)) {
		t.Errorf("CPUPerMsg(0) = %v, want NaN", s.CPUPerMsg(0))
	}
}

// TestOthersLeavesOutThisProcess: with this process spinning on every
// core, Others is what the cores did besides it, so the two together never
// come to more than the cores had (a few ticks aside). Counted in Others
// too, this process's CPU would make them twice the cores on a quiet
// machine, and the cores plus this process's CPU on a loaded one.
func TestOthersLeavesOutThisProcess(t *testing.T) {
	m := Start()
	done := make(chan struct{})
	for range runtime.GOMAXPROCS(0) {
		go func() {
			defer func() { done <- struct{}{} }()
			spin(300 * time.Millisecond)
		}()
	}
	for range runtime.GOMAXPROCS(0) {
		<-done
	}
	s := m.Stop()
	capacity := s.Wall * time.Duration(s.Cores)
	t.Logf("span: wall %v, own %v, others %v on %d cores", s.Wall, s.CPU, s.Others, s.Cores)
	if s.Cores < 1 {
		t.Fatalf("Cores %d: /proc/stat not read", s.Cores)
	}
	if s.CPU < 100*time.Millisecond {
		t.Fatalf("own CPU %v with every core spinning for 300ms", s.CPU)
	}
	if slack := capacity/20 + 20*time.Millisecond; s.CPU+s.Others > capacity+slack {
		t.Errorf("own CPU %v + others %v = %v: more than the %v the cores had", s.CPU, s.Others, s.CPU+s.Others, capacity)
	}
}
