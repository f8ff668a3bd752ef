package bench

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/ferrymq/ferry/bench/internal/usage"
)

// sample is a kafka consume's run of n messages in elapsed, costing
// cpuPerMsg µs and bytesPerMsg bytes a message, with the other processes
// on 2 cores taking share of them.
func sample(op Op, impl Impl, round int, elapsed time.Duration, cpuPerMsg, bytesPerMsg, share float64) Sample {
	const n = 1000
	return Sample{Broker: "kafka", Op: op, Impl: impl, Round: round, N: n, Elapsed: elapsed, Calls: -1, Mallocs: 3 * n, Consumed: n,
		Usage: &usage.Span{Wall: elapsed, CPU: time.Duration(cpuPerMsg * n * float64(time.Microsecond)), CPUKnown: true,
			Others: time.Duration(share * 2 * float64(elapsed)), Cores: 2, Mallocs: 3 * n, Bytes: uint64(bytesPerMsg * n)}}
}

// TestMarkdownCarriesCPUAndOthers: BENCHMARKS.md's ratio table gives the
// medians of CPU µs/msg of Ferry and of raw and of the others' share, and
// its table of all rows each row's medians with the share's range.
func TestMarkdownCarriesCPUAndOthers(t *testing.T) {
	var samples []Sample
	for i, f := range []struct{ cpu, share float64 }{{2, 0.10}, {4, 0.30}, {3, 0.20}} {
		samples = append(samples,
			sample(ConsumeNoop, Ferry, i+1, 2*time.Second, f.cpu, 500+100*float64(i), f.share),
			sample(ConsumeNoop, Raw, i+1, time.Second, 1, 200, 0.05))
	}
	rows := Summarize(samples)
	if len(rows) != 2 {
		t.Fatalf("%d rows, want 2", len(rows))
	}
	var b strings.Builder
	if err := WriteMarkdown(&b, Meta{}, rows, nil); err != nil {
		t.Fatal(err)
	}
	md := b.String()
	for _, want := range []string{
		"| broker | operation | Ferry / raw | Ferry / Watermill | CPU µs/msg Ferry | CPU µs/msg raw | others' share Ferry / raw |",
		"| kafka | consume (no-op handler) | 0.50× | - | 3.00 | 1.00 | 20% / 5% |",
		"| API calls/msg | allocs/msg | bytes/msg | CPU µs/msg | others' share (min–max) |",
		"| kafka | consume (no-op handler) | ferry | 1000 | 3 | 500 | 500 | 500 | - | 3.0 | 600 | 3.00 | 20% (10–30%) |",
		"| kafka | consume (no-op handler) | raw | 1000 | 3 | 1000 | 1000 | 1000 | - | 3.0 | 200 | 1.00 | 5% (5–5%) |",
		"the broker's own work",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("BENCHMARKS.md lacks %q:\n%s", want, md)
		}
	}
}

// TestSamplesSavedBeforeUsage: samples saved (docs/benchmarks.json)
// before CPU was measured render, with -from, a "-" where the new figures
// go; samples saved now keep each run's figures.
func TestSamplesSavedBeforeUsage(t *testing.T) {
	const old = `[{"Broker":"kafka","Op":"consume (no-op handler)","Impl":"ferry","Round":1,"N":1000,"Elapsed":2000000000,"Calls":-1,"Mallocs":3000,"Consumed":1000,"HeapBytes":0},
{"Broker":"kafka","Op":"consume (no-op handler)","Impl":"raw","Round":1,"N":1000,"Elapsed":1000000000,"Calls":-1,"Mallocs":3000,"Consumed":1000,"HeapBytes":0}]`
	var samples []Sample
	if err := json.Unmarshal([]byte(old), &samples); err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	if err := WriteMarkdown(&b, Meta{}, Summarize(samples), nil); err != nil {
		t.Fatal(err)
	}
	md := b.String()
	for _, want := range []string{
		"| kafka | consume (no-op handler) | 0.50× | - | - | - | - |",
		"| kafka | consume (no-op handler) | ferry | 1000 | 1 | 500 | 500 | 500 | - | 3.0 | - | - | - |",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("BENCHMARKS.md from old samples lacks %q:\n%s", want, md)
		}
	}

	now := sample(ConsumeNoop, Ferry, 1, time.Second, 2.5, 700, 0.4)
	j, err := json.Marshal(now)
	if err != nil {
		t.Fatal(err)
	}
	var back Sample
	if err := json.Unmarshal(j, &back); err != nil {
		t.Fatal(err)
	}
	if back.Usage == nil || *back.Usage != *now.Usage {
		t.Fatalf("saved %s, read back %+v", j, back.Usage)
	}
	if got := back.CPUPerMsg(); got != 2.5 {
		t.Errorf("CPUPerMsg read back %v, want 2.5", got)
	}
	if got := back.OthersShare(); got < 0.3999 || got > 0.4001 {
		t.Errorf("OthersShare read back %v, want 0.4", got)
	}
}
