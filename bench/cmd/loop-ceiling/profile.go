package main

import (
	"bytes"
	"fmt"
	"os"
	"runtime"
	"runtime/pprof"

	"github.com/google/pprof/profile"
)

// profiler writes one CPU profile and one allocation profile of the timed
// parts of every run, and of nothing else: the messages built between runs
// and each run's shutdown stay out. runtime/pprof cannot pause a profile, so
// each timed part is profiled on its own and the parts are merged.
type profiler struct {
	cpuPath, memPath string
	cpuBuf           bytes.Buffer
	memBefore        *profile.Profile
	cpu, mem         []*profile.Profile
}

// start begins profiling a timed part. With an allocation profile it runs
// a GC first: the allocation profile holds what was allocated up to the
// last completed GC, so one just before and one just after the part make
// the difference of the two the part's own allocations.
func (p *profiler) start() error {
	if p.memPath != "" {
		runtime.GC()
		before, err := allocs()
		if err != nil {
			return err
		}
		p.memBefore = before
	}
	if p.cpuPath != "" {
		p.cpuBuf.Reset()
		if err := pprof.StartCPUProfile(&p.cpuBuf); err != nil {
			return fmt.Errorf("-cpuprofile: %w", err)
		}
	}
	return nil
}

// stop ends profiling the timed part started last, and labels its
// samples handler=handler, so that one handler's runs can be picked out of
// the merged profile (go tool pprof -tagfocus handler=full).
func (p *profiler) stop(handler string) error {
	if p.cpuPath != "" {
		pprof.StopCPUProfile()
		prof, err := profile.Parse(&p.cpuBuf)
		if err != nil {
			return fmt.Errorf("-cpuprofile: reading the run's profile: %w", err)
		}
		p.cpu = append(p.cpu, label(prof, handler))
	}
	if p.memPath != "" {
		runtime.GC()
		after, err := allocs()
		if err != nil {
			return err
		}
		p.memBefore.Scale(-1)
		diff, err := profile.Merge([]*profile.Profile{after, p.memBefore})
		if err != nil {
			return fmt.Errorf("-memprofile: %w", err)
		}
		p.mem = append(p.mem, label(diff, handler))
	}
	return nil
}

// write merges the parts' profiles and writes them.
func (p *profiler) write() error {
	for _, f := range []struct {
		flag, path string
		parts      []*profile.Profile
	}{{"-cpuprofile", p.cpuPath, p.cpu}, {"-memprofile", p.memPath, p.mem}} {
		if f.path == "" || len(f.parts) == 0 {
			continue
		}
		merged, err := profile.Merge(f.parts)
		if err == nil {
			err = writeProfile(f.path, merged)
		}
		if err != nil {
			return fmt.Errorf("%s: %w", f.flag, err)
		}
	}
	return nil
}

// label sets the label handler on every sample of prof.
func label(prof *profile.Profile, handler string) *profile.Profile {
	for _, s := range prof.Sample {
		if s.Label == nil {
			s.Label = map[string][]string{}
		}
		s.Label["handler"] = []string{handler}
	}
	return prof
}

// allocs reads the allocation profile so far.
func allocs() (*profile.Profile, error) {
	var b bytes.Buffer
	if err := pprof.Lookup("allocs").WriteTo(&b, 0); err != nil {
		return nil, fmt.Errorf("-memprofile: %w", err)
	}
	prof, err := profile.Parse(&b)
	if err != nil {
		return nil, fmt.Errorf("-memprofile: reading the allocation profile: %w", err)
	}
	return prof, nil
}

func writeProfile(path string, prof *profile.Profile) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := prof.Write(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
