// Command bench-compare runs the bench module's comparison of Ferry with
// the raw broker clients and Watermill on every broker, and writes
// BENCHMARKS.md and its chart from the same samples. make bench-compare
// runs it from the repository root; the brokers must be up (make brokers).
//
//	go run ./cmd/bench-compare -n 50000 -runs 3 -out ../BENCHMARKS.md -chart ../docs/benchmarks.svg
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/ferrymq/ferry/bench"
	"github.com/ferrymq/ferry/ferrytest"
)

func main() {
	n := flag.Int("n", 50_000, "messages per consume and publish variant and run")
	perBroker := flag.String("n-broker", "memory=200000,kafka=150000", "messages per variant for some brokers instead of -n: broker=n,... (the fast ones need more to time more than start-up)")
	runs := flag.Int("runs", 3, "runs (rounds) of every variant")
	backlog := flag.Int("backlog", 1_000_000, "messages of the memory backlog whose heap is measured")
	keys := flag.Int("keys", 1000, "records of the Kafka key-order comparison")
	var all []string
	for _, b := range bench.Brokers {
		all = append(all, string(b))
	}
	brokers := flag.String("brokers", strings.Join(all, ","), "brokers to run, comma-separated")
	out := flag.String("out", "BENCHMARKS.md", "the markdown to write")
	chart := flag.String("chart", "benchmarks.svg", "the SVG chart to write")
	note := flag.String("note", "", "a note to put at the top of the markdown (how the machine was loaded, say)")
	profile := flag.String("profile", "", "a directory to write a CPU profile of each variant's timed part to")
	notesFile := flag.String("notes", "NOTES.md", "hand-written notes (on the goals, from profiles) to append, if the file exists")
	data := flag.String("data", "", "a JSON file to save the run's samples and metadata to (for -from)")
	from := flag.String("from", "", "render the markdown and chart from a JSON file saved with -data, measuring nothing")
	timeout := flag.Duration("timeout", 5*time.Minute, "the longest one variant may take")
	only := flag.String("only", "", "run only these variants, comma-separated; each picks the variants whose operation or implementation contains all its +-joined words (publish+ferry,publish+raw); for working on one comparison, not for BENCHMARKS.md")
	flag.Parse()
	if *only != "" {
		// A part of the comparison must not take the whole one's place.
		set := map[string]bool{}
		flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
		if !set["out"] || !set["chart"] {
			log.Fatal("-only: give -out and -chart too (a partial run must not overwrite BENCHMARKS.md and its chart)")
		}
	}
	log.SetFlags(log.Ltime)
	bench.KeyRecords = *keys
	bench.BacklogRecords = *backlog
	if *profile != "" {
		if err := os.MkdirAll(*profile, 0o755); err != nil {
			log.Fatal(err)
		}
		bench.ProfileDir = *profile
	}

	if *from != "" {
		var saved record
		b, err := os.ReadFile(*from)
		if err == nil {
			err = json.Unmarshal(b, &saved)
		}
		if err != nil {
			log.Fatalf("-from: %v", err)
		}
		render(saved, *out, *chart, *notesFile)
		return
	}

	counts := map[string]int{}
	for _, b := range bench.Brokers {
		counts[string(b)] = *n
	}
	if *perBroker != "" {
		for _, kv := range strings.Split(*perBroker, ",") {
			k, v, ok := strings.Cut(kv, "=")
			c, err := strconv.Atoi(v)
			if !ok || err != nil || c <= 0 {
				log.Fatalf("-n-broker: %q is not broker=n", kv)
			}
			counts[strings.TrimSpace(k)] = c
		}
	}
	start := time.Now()
	ctx := context.Background()
	var samples []bench.Sample
	ran := map[string]int{}
	var notes []string
	run := fmt.Sprintf("%d", time.Now().Unix())
	for _, b := range strings.Split(*brokers, ",") {
		s, err := bench.NewSuite(ferrytest.Kind(strings.TrimSpace(b)), run)
		if err != nil {
			log.Fatalf("%s: %v (are the brokers up? make brokers)", b, err)
		}
		if *only != "" {
			if s.Variants = bench.Only(s.Variants, strings.Split(*only, ",")); len(s.Variants) == 0 {
				log.Fatalf("-only %q picks no variant of %s", *only, b)
			}
		}
		got, err := bench.Run(ctx, s, counts[strings.TrimSpace(b)], *runs, *timeout, log.Printf)
		s.Close()
		if err != nil {
			log.Fatal(err)
		}
		samples = append(samples, got...)
		ran[strings.TrimSpace(b)] = counts[strings.TrimSpace(b)]
		notes = append(notes, s.Notes...)
	}
	meta := bench.Meta{
		Date:       time.Now().UTC().Format("2006-01-02 15:04 UTC"),
		Command:    command(),
		Machine:    machine(),
		GoVersion:  runtime.Version(),
		Versions:   versions(),
		N:          *n,
		Counts:     ran,
		Runs:       *runs,
		KeyRecords: *keys,
		Note:       *note,
		Elapsed:    time.Since(start).Round(time.Second).String(),
	}
	rec := record{Meta: meta, Samples: samples, Notes: notes}
	if *data != "" {
		if err := write(*data, func(f *os.File) error {
			enc := json.NewEncoder(f)
			enc.SetIndent("", " ")
			return enc.Encode(rec)
		}); err != nil {
			log.Fatal(err)
		}
	}
	render(rec, *out, *chart, *notesFile)
}

// record is what -data saves and -from reads: one run, whole.
type record struct {
	Meta    bench.Meta
	Samples []bench.Sample
	Notes   []string
}

// render writes the markdown and the chart of rec.
func render(rec record, out, chart, notesFile string) {
	rows := bench.Summarize(rec.Samples)
	meta := rec.Meta
	rel, err := filepath.Rel(filepath.Dir(out), chart)
	if err != nil {
		rel = chart
	}
	meta.Chart = filepath.ToSlash(rel)
	meta.Closing = ""
	if b, err := os.ReadFile(notesFile); err == nil {
		meta.Closing = string(b)
	}
	if err := write(out, func(f *os.File) error { return bench.WriteMarkdown(f, meta, rows, rec.Notes) }); err != nil {
		log.Fatal(err)
	}
	if err := write(chart, func(f *os.File) error { return bench.WriteSVG(f, rows) }); err != nil {
		log.Fatal(err)
	}
	log.Printf("wrote %s and %s (the run took %s)", out, chart, meta.Elapsed)
}

// command is the make command that repeats this run's measurements (the
// output paths and the note left out).
func command() string {
	var flags []string
	flag.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "out", "chart", "note", "notes", "profile", "data", "from":
			return
		}
		flags = append(flags, "-"+f.Name+" "+f.Value.String())
	})
	if len(flags) == 0 {
		return "make bench-compare"
	}
	return "make bench-compare BENCH_FLAGS='" + strings.Join(flags, " ") + "'"
}

func write(path string, f func(*os.File) error) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	fh, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := f(fh); err != nil {
		fh.Close()
		return err
	}
	return fh.Close()
}

// machine describes the CPU, the core count and the OS.
func machine() string {
	model := "unknown CPU"
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				model = strings.TrimSpace(v)
				break
			}
		}
	}
	mem := ""
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		var kb int
		if _, err := fmt.Sscanf(string(b), "MemTotal: %d kB", &kb); err == nil {
			mem = fmt.Sprintf(", %.1f GiB RAM", float64(kb)/(1<<20))
		}
	}
	return fmt.Sprintf("%s, %d logical CPUs (GOMAXPROCS %d)%s, %s/%s", model, runtime.NumCPU(), runtime.GOMAXPROCS(0), mem, runtime.GOOS, runtime.GOARCH)
}

// versions lists the compared modules' versions from the build.
func versions() []string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return nil
	}
	want := []string{"github.com/ferrymq/ferry", "github.com/twmb/franz-go", "github.com/aws/aws-sdk-go-v2/service/sqs",
		"github.com/rabbitmq/amqp091-go", "github.com/ThreeDotsLabs/watermill", "github.com/ThreeDotsLabs/watermill-kafka/v3",
		"github.com/ThreeDotsLabs/watermill-amqp/v3", "github.com/IBM/sarama"}
	var out []string
	for _, w := range want {
		for _, d := range bi.Deps {
			if d.Path == w {
				v := d.Version
				if d.Replace != nil {
					v = "this checkout (" + d.Replace.Path + ")"
				}
				out = append(out, "`"+w+"` "+v)
			}
		}
	}
	return out
}
