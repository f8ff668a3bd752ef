package bench

import (
	"fmt"
	"html"
	"io"
	"math"
	"slices"
	"strings"

	"github.com/ferrymq/ferry/ferrytest"
)

// isConsume tells whether op consumes (and so is checked for lost
// messages).
func isConsume(op Op) bool { return op != Publish && op != Backlog }

// Row is one variant's samples summarised.
type Row struct {
	Broker ferrytest.Kind
	Op     Op
	Impl   Impl
	N      int
	Runs   int
	// Median, Min and Max are msgs/s over the runs.
	Median, Min, Max float64
	// CallsPerMsg is the median of API calls per message (-1: not counted).
	CallsPerMsg float64
	// HeapPerMsg is the median live heap a backlog message takes (Backlog).
	HeapPerMsg float64
	// AllocsPerMsg is the median of heap allocations per message, in the
	// whole process (the broker client's and, for memory, the broker's).
	AllocsPerMsg float64
	// BytesPerMsg is the median of heap bytes allocated per message, in
	// the whole process (NaN: not measured).
	BytesPerMsg float64
	// CPUPerMsg is the median of this process's CPU time per message, in
	// microseconds (NaN: not measured).
	CPUPerMsg float64
	// Others, OthersMin and OthersMax are the median, least and greatest
	// share of the machine's cores (0 to 1) that other processes, the
	// broker among them, took during a run (NaN: not measured).
	Others, OthersMin, OthersMax float64
}

// median is the median of xs (NaN when there are none).
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// Summarize turns samples into rows, in the order their variants first
// appear.
func Summarize(samples []Sample) []Row {
	type key struct {
		b  ferrytest.Kind
		op Op
		im Impl
	}
	var order []key
	rates, calls, allocs, heap := map[key][]float64{}, map[key][]float64{}, map[key][]float64{}, map[key][]float64{}
	// Samples saved before CPU and bytes were measured have none: those
	// stay out, and a row with none says "-".
	cpu, bytes, others := map[key][]float64{}, map[key][]float64{}, map[key][]float64{}
	measured := func(m map[key][]float64, k key, v float64) {
		if !math.IsNaN(v) {
			m[k] = append(m[k], v)
		}
	}
	ns := map[key]int{}
	for _, s := range samples {
		k := key{s.Broker, s.Op, s.Impl}
		if _, ok := rates[k]; !ok {
			order = append(order, k)
		}
		rates[k] = append(rates[k], s.Rate())
		ns[k] = s.N
		if s.Calls >= 0 {
			calls[k] = append(calls[k], float64(s.Calls)/float64(s.N))
		}
		allocs[k] = append(allocs[k], float64(s.Mallocs)/float64(s.N))
		heap[k] = append(heap[k], float64(s.HeapBytes)/float64(s.N))
		measured(cpu, k, s.CPUPerMsg())
		measured(bytes, k, s.BytesPerMsg())
		measured(others, k, s.OthersShare())
	}
	var rows []Row
	for _, k := range order {
		r := Row{Broker: k.b, Op: k.op, Impl: k.im, N: ns[k], Runs: len(rates[k]),
			Median: median(rates[k]), Min: slices.Min(rates[k]), Max: slices.Max(rates[k]),
			CallsPerMsg: -1, AllocsPerMsg: median(allocs[k]), HeapPerMsg: median(heap[k]),
			BytesPerMsg: median(bytes[k]), CPUPerMsg: median(cpu[k]),
			Others: median(others[k]), OthersMin: math.NaN(), OthersMax: math.NaN()}
		if len(others[k]) > 0 {
			r.OthersMin, r.OthersMax = slices.Min(others[k]), slices.Max(others[k])
		}
		if len(calls[k]) > 0 {
			r.CallsPerMsg = median(calls[k])
		}
		rows = append(rows, r)
	}
	return rows
}

// find returns the row of broker, op and impl.
func find(rows []Row, broker ferrytest.Kind, op Op, impl Impl) (Row, bool) {
	for _, r := range rows {
		if r.Broker == broker && r.Op == op && r.Impl == impl {
			return r, true
		}
	}
	return Row{}, false
}

// Ratio is Ferry's median rate over another's, for one broker and op.
type Ratio struct {
	Broker ferrytest.Kind
	Op     Op
	// OverRaw and OverWatermill are NaN where there is no such row. For
	// the full stack, OverRaw is over the raw loop with a no-op handler
	// (the raw client has no stack).
	OverRaw, OverWatermill float64
	// FerryCPU and RawCPU are the medians of CPU µs per message of Ferry
	// and of the raw row OverRaw is over; FerryOthers and RawOthers the
	// medians of the share of the cores the other processes took during
	// their runs (NaN where not measured or no such row).
	FerryCPU, RawCPU, FerryOthers, RawOthers float64
}

// Ratios returns Ferry's ratios for each broker and op it has rows for.
func Ratios(rows []Row) []Ratio {
	var out []Ratio
	for _, r := range rows {
		if r.Impl != Ferry || r.Op == ByPartition || r.Op == ByKey || r.Op == Backlog {
			continue
		}
		rt := Ratio{Broker: r.Broker, Op: r.Op, OverRaw: math.NaN(), OverWatermill: math.NaN(),
			FerryCPU: r.CPUPerMsg, RawCPU: math.NaN(), FerryOthers: r.Others, RawOthers: math.NaN()}
		rawOp := r.Op
		if rawOp == ConsumeFull {
			rawOp = ConsumeNoop
		}
		if raw, ok := find(rows, r.Broker, rawOp, Raw); ok {
			rt.OverRaw = r.Median / raw.Median
			rt.RawCPU, rt.RawOthers = raw.CPUPerMsg, raw.Others
		}
		if wm, ok := find(rows, r.Broker, r.Op, Watermill); ok {
			rt.OverWatermill = r.Median / wm.Median
		}
		out = append(out, rt)
	}
	return out
}

// Goal is one of issue 17's goals, checked against the rows.
type Goal struct {
	What     string
	Measured string
	Met      string // "met", "MISSED" or "not measured"
}

// Goals checks the goals the numbers are held to.
func Goals(rows []Row) []Goal {
	var out []Goal
	check := func(what string, v float64, ok bool, want float64, atMost bool, format string) {
		g := Goal{What: what, Met: "not measured", Measured: "-"}
		if ok && !math.IsNaN(v) {
			g.Measured = fmt.Sprintf(format, v)
			if (atMost && v <= want) || (!atMost && v >= want) {
				g.Met = "met"
			} else {
				g.Met = "MISSED"
			}
		}
		out = append(out, g)
	}
	for _, b := range Brokers[1:] { // memory has no raw client (its raw row is the driver alone)
		full, ok1 := find(rows, b, ConsumeFull, Ferry)
		raw, ok2 := find(rows, b, ConsumeNoop, Raw)
		check(fmt.Sprintf("%s: Ferry full stack ≥ 0.9× raw client", b), full.Median/raw.Median, ok1 && ok2, 0.9, false, "%.2f×")
	}
	for _, b := range []ferrytest.Kind{ferrytest.Kafka, ferrytest.RabbitMQ} {
		full, ok1 := find(rows, b, ConsumeFull, Ferry)
		wm, ok2 := find(rows, b, ConsumeFull, Watermill)
		check(fmt.Sprintf("%s: Ferry full stack ≥ 1.5× Watermill full stack", b), full.Median/wm.Median, ok1 && ok2, 1.5, false, "%.2f×")
	}
	full, ok := find(rows, ferrytest.SQS, ConsumeFull, Ferry)
	check("sqs: Ferry ≤ 0.25 API calls per message (consume, full stack)", full.CallsPerMsg, ok && full.CallsPerMsg >= 0, 0.25, true, "%.3f")
	wm, okw := find(rows, ferrytest.SQS, ConsumeFull, Watermill)
	_ = wm
	if !okw {
		out = append(out, Goal{What: "sqs: Watermill's calls per message (about 2)", Measured: "-", Met: "not measured (watermill-aws not fetchable)"})
	}
	mf, ok1 := find(rows, ferrytest.Memory, ConsumeFull, Ferry)
	mw, ok2 := find(rows, ferrytest.Memory, ConsumeFull, Watermill)
	check("memory: Ferry full stack ≥ 3× Watermill GoChannel full stack", mf.Median/mw.Median, ok1 && ok2, 3, false, "%.2f×")
	return out
}

// Meta is what BENCHMARKS.md says about the run.
type Meta struct {
	Date, Command, Machine, GoVersion string
	Versions                          []string // "module version"
	N, Runs, KeyRecords               int
	Counts                            map[string]int // messages per variant of each broker
	Note                              string
	Chart                             string // the chart's path, relative to the markdown
	Elapsed                           string
	// Closing is hand-written markdown (bench/NOTES.md) appended at the end.
	Closing string
}

func fmtRate(v float64) string {
	switch {
	case math.IsNaN(v):
		return "-"
	case v >= 100:
		return fmt.Sprintf("%.0f", v)
	default:
		return fmt.Sprintf("%.1f", v)
	}
}

// fmtMicros formats a CPU time a message in µs ("-" for NaN).
func fmtMicros(v float64) string {
	if math.IsNaN(v) {
		return "-"
	}
	return fmt.Sprintf("%.2f", v)
}

// fmtShare formats a share of the cores as a percentage ("-" for NaN).
func fmtShare(v float64) string {
	if math.IsNaN(v) {
		return "-"
	}
	return fmt.Sprintf("%.0f%%", 100*v)
}

// fmtSpread formats a median share with its range, as "31% (18–44%)".
func fmtSpread(med, lo, hi float64) string {
	if math.IsNaN(med) {
		return "-"
	}
	return fmt.Sprintf("%s (%.0f–%s)", fmtShare(med), 100*lo, fmtShare(hi))
}

// fmtBytes formats bytes a message ("-" for NaN).
func fmtBytes(v float64) string {
	if math.IsNaN(v) {
		return "-"
	}
	return fmt.Sprintf("%.0f", v)
}

func fmtRatio(v float64) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "-"
	}
	return fmt.Sprintf("%.2f×", v)
}

// WriteMarkdown writes BENCHMARKS.md.
func WriteMarkdown(w io.Writer, m Meta, rows []Row, notes []string) error {
	var b strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	p("# Benchmarks: Ferry against the raw clients and Watermill\n\n")
	p("Generated by `make bench-compare` (the `bench/` module, its own go.mod, so Ferry's module never\n")
	p("depends on Watermill). Do not edit by hand: run it again.\n\n")
	if m.Note != "" {
		p("> **%s**\n\n", m.Note)
	}
	p("- Date: %s; the whole run took %s\n", m.Date, m.Elapsed)
	p("- Command: `%s`\n", m.Command)
	p("- Machine: %s\n", m.Machine)
	p("- Go: %s\n", m.GoVersion)
	p("- Modules: %s\n", strings.Join(m.Versions, ", "))
	var counts []string
	for _, b := range Brokers {
		if c, ok := m.Counts[string(b)]; ok {
			counts = append(counts, fmt.Sprintf("%s %d", b, c))
		}
	}
	p("- Each consume and publish variant moves the same number of messages of %d bytes per run (%s), %d runs, interleaved: in each run every\n", BodySize, strings.Join(counts, ", "), m.Runs)
	p("  variant of a broker runs once, in an order that rotates from run to run, on a fresh queue or topic filled with the same\n")
	p("  numbered messages. The key-order rows handle %d records. Rates are medians over the runs, with the slowest and\n", m.KeyRecords)
	p("  fastest run. A consume is timed from the consumer's start until its handler has seen every one of the messages\n")
	p("  (counted by sequence number; a variant that loses one fails the run); shutdown is not timed.\n")
	p("- Allocations and bytes per message count every heap allocation in the process during the timed part (the client's too).\n")
	p("- CPU µs/msg is this process's CPU time (user and system, every thread, the GC's too) during the timed part, over the\n")
	p("  messages: Ferry's or Watermill's and the client's, and for memory the in-process broker's. Others' share is the CPU\n")
	p("  every other process took on the machine's cores during the timed part (from /proc/stat, less this process's), over\n")
	p("  all the cores: the brokers share the cores, so for Kafka, SQS and RabbitMQ it holds the broker's own work, which the\n")
	p("  run causes, as well as any other load. Within a row, runs with a much larger share than the others were loaded.\n")
	p("  The kernel counts it in 10 ms ticks, so for a run of well under a second it is coarse.\n")
	p("  The figures of each run are in the samples saved with `-data` (`docs/benchmarks.json`: `Usage`, times in ns).\n\n")
	if m.Chart != "" {
		p("![Ferry, raw client and Watermill, msgs/s per broker](%s)\n\n", m.Chart)
	}

	p("## Ratios\n\n")
	p("Ferry's median rate over the raw client's and over Watermill's (> 1 means Ferry is faster). For the full\n")
	p("stack, the raw client is its loop with a no-op handler (it has no stack).\n\n")
	p("CPU µs/msg and others' share of the cores are medians over the runs, of Ferry's row and of the raw row of its ratio.\n\n")
	p("| broker | operation | Ferry / raw | Ferry / Watermill | CPU µs/msg Ferry | CPU µs/msg raw | others' share Ferry / raw |\n|---|---|---:|---:|---:|---:|---:|\n")
	for _, r := range Ratios(rows) {
		raw := fmtRatio(r.OverRaw)
		if r.Broker == ferrytest.Memory && raw != "-" {
			raw += " (driver alone†)"
		}
		others := fmtShare(r.FerryOthers) + " / " + fmtShare(r.RawOthers)
		if math.IsNaN(r.FerryOthers) && math.IsNaN(r.RawOthers) {
			others = "-"
		}
		p("| %s | %s | %s | %s | %s | %s | %s |\n", r.Broker, r.Op, raw, fmtRatio(r.OverWatermill),
			fmtMicros(r.FerryCPU), fmtMicros(r.RawCPU), others)
	}
	if lane, ok := find(rows, ferrytest.Kafka, ByPartition, Ferry); ok {
		if key, ok := find(rows, ferrytest.Kafka, ByKey, Ferry); ok {
			p("| kafka | key order over partition order (1 partition, 100 keys, 5 ms handler) | %s | | | | |\n", fmtRatio(key.Median/lane.Median))
		}
	}

	p("\n† The memory broker has no client of its own: its raw row is Ferry's memory driver alone (Fetch, Settle)\n")
	p("with no delivery loop, a ceiling rather than an alternative; the goals leave it out.\n")
	p("\n## Goals (issue 17)\n\n| goal | measured | |\n|---|---:|---|\n")
	for _, g := range Goals(rows) {
		p("| %s | %s | %s |\n", g.What, g.Measured, g.Met)
	}

	var backlog []Row
	for _, r := range rows {
		if r.Op == Backlog {
			backlog = append(backlog, r)
		}
	}
	if len(backlog) > 0 {
		p("\n## Heap under a backlog\n\n")
		p("The live heap (after a GC) that a backlog of unconsumed messages of %d bytes adds to the process: where it\n", BodySize)
		p("applies, that is for the in-process brokers (on Kafka, SQS and RabbitMQ the backlog is in the broker).\n\n")
		p("| broker | implementation | messages | heap MiB (median) | bytes per message |\n|---|---|---:|---:|---:|\n")
		for _, r := range backlog {
			p("| %s | %s | %d | %.1f | %.0f |\n", r.Broker, r.Impl, r.N, r.HeapPerMsg*float64(r.N)/(1<<20), r.HeapPerMsg)
		}
	}
	p("\n## All rows\n\n")
	p("| broker | operation | implementation | msgs | runs | median msgs/s | min | max | API calls/msg | allocs/msg | bytes/msg | CPU µs/msg | others' share (min–max) |\n")
	p("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range rows {
		if r.Op == Backlog {
			continue
		}
		calls := "-"
		if r.CallsPerMsg >= 0 {
			calls = fmt.Sprintf("%.3f", r.CallsPerMsg)
		}
		p("| %s | %s | %s | %d | %d | %s | %s | %s | %s | %.1f | %s | %s | %s |\n", r.Broker, r.Op, r.Impl, r.N, r.Runs,
			fmtRate(r.Median), fmtRate(r.Min), fmtRate(r.Max), calls, r.AllocsPerMsg,
			fmtBytes(r.BytesPerMsg), fmtMicros(r.CPUPerMsg), fmtSpread(r.Others, r.OthersMin, r.OthersMax))
	}
	p("\n## How each side is set up\n\n")
	p("- Ferry's full stack is `consumer.Standard` (dead letter, retry, breaker, timeout, recover) around `idempotency`\n")
	p("  over its in-memory store, keyed by message id. Watermill's is the router with PoisonQueue, Retry,\n")
	p("  CircuitBreaker, Timeout, Recoverer and the Deduplicator over its in-memory repository, keyed by message UUID.\n")
	for _, n := range notes {
		p("- %s\n", n)
	}
	if m.Closing != "" {
		p("\n%s", m.Closing)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

var implColor = map[Impl]string{Ferry: "#1f77b4", Raw: "#7f7f7f", Watermill: "#ff7f0e"}

// WriteSVG draws the rates as grouped horizontal bars, one group per broker
// and operation, each bar scaled to its group's fastest (rates differ by
// orders of magnitude between brokers), with the min–max spread as a
// whisker and the median written at its end.
func WriteSVG(w io.Writer, rows []Row) error {
	type group struct {
		title string
		rows  []Row
	}
	var groups []group
	idx := map[string]int{}
	for _, r := range rows {
		if r.Op == Backlog {
			continue
		}
		t := string(r.Broker) + " · " + string(r.Op)
		if r.Op == ByKey || r.Op == ByPartition {
			t = string(r.Broker) + " · Ferry, 1 partition, 100 keys, 5 ms handler"
		}
		i, ok := idx[t]
		if !ok {
			i = len(groups)
			idx[t] = i
			groups = append(groups, group{title: t})
		}
		groups[i].rows = append(groups[i].rows, r)
	}
	const width, left, barW, barH, gap = 900, 90, 640, 16, 4
	height := 50
	for _, g := range groups {
		height += 22 + len(g.rows)*(barH+gap) + 10
	}
	var b strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	p(`<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", width, height)
	p(`<rect width="100%%" height="100%%" fill="white"/>` + "\n")
	p(`<text x="10" y="20" font-size="15" font-weight="bold">Ferry, raw client, Watermill: median msgs/s (bars scaled within each group; whiskers: min–max)</text>` + "\n")
	x := 10
	for _, im := range []Impl{Ferry, Raw, Watermill} {
		p(`<rect x="%d" y="30" width="12" height="12" fill="%s"/><text x="%d" y="40">%s</text>`+"\n", x, implColor[im], x+16, im)
		x += 100
	}
	y := 60
	for _, g := range groups {
		top := 0.0
		for _, r := range g.rows {
			top = max(top, r.Max)
		}
		p(`<text x="10" y="%d" font-weight="bold">%s</text>`+"\n", y+12, html.EscapeString(g.title))
		y += 22
		for _, r := range g.rows {
			scale := func(v float64) float64 { return float64(barW) * v / top }
			label, color := string(r.Impl), implColor[r.Impl]
			switch {
			case r.Op == ByPartition:
				label, color = "by partition", "#9ecae1"
			case r.Op == ByKey:
				label = "by key"
			case r.Broker == ferrytest.Memory && r.Impl == Raw:
				label = "driver alone"
			}
			p(`<text x="%d" y="%d" text-anchor="end">%s</text>`+"\n", left-6, y+barH-4, label)
			p(`<rect x="%d" y="%d" width="%.1f" height="%d" fill="%s"/>`+"\n", left, y, scale(r.Median), barH, color)
			p(`<line x1="%.1f" x2="%.1f" y1="%d" y2="%d" stroke="black"/>`+"\n", float64(left)+scale(r.Min), float64(left)+scale(r.Max), y+barH/2, y+barH/2)
			p(`<text x="%.1f" y="%d">%s</text>`+"\n", float64(left)+scale(r.Max)+6, y+barH-4, fmtRate(r.Median))
			y += barH + gap
		}
		y += 10
	}
	p("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}
