package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"
)

// proc is one child process the run starts, kills and restarts.
type proc struct {
	name string
	role string
	cfg  childConfig
	log  *os.File

	mu          sync.Mutex
	cmd         *exec.Cmd
	done        chan struct{} // closed when cmd exits
	incarnation int
	killed      int  // SIGKILLs sent
	crashes     int  // exits nobody asked for
	stopping    bool // SIGTERM sent: the run is ending
	killing     bool // SIGKILL sent to the current incarnation
	selfExit    bool // the current incarnation exited and nobody asked it to
	exitCode    int
}

func newProc(role, name string, cfg childConfig, runDir string) (*proc, error) {
	f, err := os.OpenFile(runDir+"/"+name+".log", os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	cfg.Name = name
	return &proc{name: name, role: role, cfg: cfg, log: f}, nil
}

// start starts a new incarnation; it must not be running.
func (p *proc) start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	cfg := p.cfg
	cfg.Incarnation = p.incarnation
	raw, err := json.Marshal(cfg)
	if err != nil {
		return err
	}
	cmd := exec.Command(exe, "-test.run=^$") // a test binary runs no test; main ignores it
	cmd.Env = append(os.Environ(), envRole+"="+p.role, envConfig+"="+string(raw))
	cmd.Stdout = p.log
	cmd.Stderr = p.log
	fmt.Fprintf(p.log, "=== %s incarnation %d at %s\n", p.name, p.incarnation, time.Now().Format(time.RFC3339Nano))
	if err := cmd.Start(); err != nil {
		return err
	}
	p.incarnation++
	p.cmd = cmd
	p.killing, p.selfExit = false, false
	done := make(chan struct{})
	p.done = done
	go func() {
		_ = cmd.Wait()
		p.mu.Lock()
		p.exitCode = cmd.ProcessState.ExitCode()
		if !p.stopping && !p.killing {
			p.selfExit = true
			p.crashes++
		}
		p.mu.Unlock()
		close(done)
	}()
	return nil
}

// exitedByItself reports whether the current incarnation exited without
// being asked to.
func (p *proc) exitedByItself() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.selfExit
}

// running reports whether the current incarnation is alive.
func (p *proc) running() bool {
	p.mu.Lock()
	done := p.done
	p.mu.Unlock()
	if done == nil {
		return false
	}
	select {
	case <-done:
		return false
	default:
		return true
	}
}

// kill SIGKILLs the current incarnation and waits for it to be gone.
func (p *proc) kill() {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	if cmd != nil {
		p.killed++
		p.killing = true
	}
	p.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(syscall.SIGKILL)
	<-done
}

// stop asks the current incarnation to shut down (SIGTERM: it drains), and
// kills it after grace.
func (p *proc) stop(grace time.Duration) {
	p.mu.Lock()
	p.stopping = true
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-done:
	case <-time.After(grace):
		_ = cmd.Process.Signal(syscall.SIGKILL)
		<-done
	}
}

// wait waits for the current incarnation to exit.
func (p *proc) wait() int {
	p.mu.Lock()
	done := p.done
	p.mu.Unlock()
	<-done
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.exitCode
}

func (p *proc) counts() (killed, crashes, incarnations int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.killed, p.crashes, p.incarnation
}
