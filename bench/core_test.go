package bench

import (
	"context"
	"testing"
	"time"
)

var keep [][]byte

// TestMeasureStopsAtTheLastMessage: a consume's figures cover the part
// until its handler saw the last message; what the consumer spends on
// shutdown afterwards (here 5,000 allocations and 400 ms) is not counted.
func TestMeasureStopsAtTheLastMessage(t *testing.T) {
	const n = 10
	tr := NewTracker(n)
	elapsed, span, _, err := measure(Variant{}, tr, func() error {
		for i := range 1000 {
			keep = append(keep, make([]byte, 64))
			if i%100 == 0 && i/100 < n-1 {
				tr.Mark(Body(i / 100))
			}
		}
		// Long enough for /proc/stat's 10 ms ticks.
		time.Sleep(100 * time.Millisecond)
		tr.Mark(Body(n - 1))
		time.Sleep(50 * time.Millisecond)
		// The shutdown, after the last message.
		for range 5000 {
			keep = append(keep, make([]byte, 64))
		}
		time.Sleep(400 * time.Millisecond)
		return nil
	})
	keep = nil
	if err != nil {
		t.Fatal(err)
	}
	if elapsed < 100*time.Millisecond || elapsed >= 300*time.Millisecond || span.Wall >= 300*time.Millisecond {
		t.Errorf("timed %v, the figures span %v: the shutdown after the last message counted", elapsed, span.Wall)
	}
	if span.Mallocs < 1000 || span.Mallocs >= 3000 {
		t.Errorf("%d allocations counted; the part until the last message made 1000 and the shutdown 5000 more", span.Mallocs)
	}
	if !span.CPUKnown || span.Cores < 1 {
		t.Errorf("CPU not measured: %+v", span)
	}
}

// TestMeasureCountsAPublish: a publish's figures cover its whole run.
func TestMeasureCountsAPublish(t *testing.T) {
	_, span, _, err := measure(Variant{}, nil, func() error {
		for end := time.Now().Add(200 * time.Millisecond); time.Now().Before(end); {
			keep = append(keep, make([]byte, 64))
			if len(keep) > 1000 {
				keep = keep[:0]
			}
		}
		return context.Canceled
	})
	keep = nil
	if err != context.Canceled {
		t.Errorf("measure returned %v, want f's error", err)
	}
	if span.Wall < 200*time.Millisecond || span.CPU < 20*time.Millisecond || span.Mallocs < 1000 {
		t.Errorf("a 200 ms busy publish measured as %+v", span)
	}
}
