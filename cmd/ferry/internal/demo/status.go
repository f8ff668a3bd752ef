package demo

import (
	"fmt"
	"io"
	"sync"
	"time"
)

// snapshot is what one status line shows.
type snapshot struct {
	elapsed    time.Duration
	phase      Phase
	published  int64
	paid       int64
	lag        int64         // messages in the queue not yet handled: waiting or in flight
	oldest     time.Duration // ageUnknown where the broker does not tell it
	retries    int64
	breaker    string
	dead       int64
	suppressed int64
	health     string // the surviving consumer's health state (consumer.Loop.Health)
}

func (s snapshot) String() string {
	return fmt.Sprintf("%5.1fs %-9s  published %3d  paid %3d  lag %3d  oldest %4s  retries %2d  breaker %-9s  DLQ %d  dups %d  health %s",
		s.elapsed.Seconds(), s.phase, s.published, s.paid, s.lag, roundAge(s.oldest), s.retries, s.breaker, s.dead, s.suppressed, s.health)
}

// compact is the status for a narrow terminal (80 columns).
func (s snapshot) compact() string {
	return fmt.Sprintf("%3.0fs %s pub %d paid %d lag %d/%s retry %d breaker %s dlq %d dup %d %s",
		s.elapsed.Seconds(), s.phase, s.published, s.paid, s.lag, roundAge(s.oldest), s.retries, s.breaker, s.dead, s.suppressed, s.health)
}

// ageUnknown is the oldest message's age where the broker does not tell
// it (RabbitMQ).
const ageUnknown = time.Duration(-1)

// Legend explains the columns of the status line.
const legend = "status: time, phase, events published, payments made, messages waiting or in flight (lag) and the age of the oldest,\n" +
	"        handler retries, breaker state, messages dead-lettered, duplicates suppressed, and the consumer's health"

func roundAge(d time.Duration) string {
	switch {
	case d == ageUnknown:
		return "-"
	case d <= 0:
		return "0s"
	case d < 10*time.Second:
		return d.Round(100 * time.Millisecond).String()
	}
	return d.Round(time.Second).String()
}

// printer writes status lines and events. On a terminal the status is one
// line that is rewritten in place and events are printed above it;
// elsewhere every status and every event is a line of its own.
type printer struct {
	out   io.Writer
	term  bool
	quiet bool
	width int

	mu   sync.Mutex
	last string // the status line on screen (terminal only)
}

// event prints a line that stays.
func (p *printer) event(format string, args ...any) {
	if p.quiet {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	line := fmt.Sprintf(format, args...)
	if !p.term {
		fmt.Fprintln(p.out, line)
		return
	}
	fmt.Fprintf(p.out, "\r\x1b[K%s\n", line)
	if p.last != "" {
		fmt.Fprint(p.out, p.last)
	}
}

// status prints the status line: in place on a terminal.
func (p *printer) status(s snapshot) {
	if p.quiet {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	line := s.String()
	if !p.term {
		fmt.Fprintln(p.out, line)
		return
	}
	if p.width > 1 && len(line) >= p.width {
		line = s.compact()
	}
	if p.width > 1 && len(line) >= p.width {
		line = line[:p.width-1]
	}
	p.last = line
	fmt.Fprintf(p.out, "\r\x1b[K%s", line)
}

// done ends the status line on a terminal, so what follows starts on a
// line of its own.
func (p *printer) done() {
	if p.quiet || !p.term {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.last != "" {
		fmt.Fprintln(p.out)
		p.last = ""
	}
}
