package consumer

import (
	"math"
	"testing"
	"time"
)

// chiSquareUniform returns the chi-square statistic of samples against a
// uniform distribution over [lo, hi), in bins.
func chiSquareUniform(samples []time.Duration, lo, hi time.Duration, bins int) float64 {
	counts := make([]int, bins)
	width := float64(hi-lo) / float64(bins)
	for _, s := range samples {
		i := int(float64(s-lo) / width)
		i = min(max(i, 0), bins-1)
		counts[i]++
	}
	want := float64(len(samples)) / float64(bins)
	var chi float64
	for _, c := range counts {
		chi += (float64(c) - want) * (float64(c) - want) / want
	}
	return chi
}

// chiSquareLimit is far above the 99.99th percentile of chi-square with 9
// degrees of freedom (33.7): a uniform sample fails it about never, a fixed
// delay always.
const chiSquareLimit = 45

func TestBackoffStepGrowsExponentiallyAndIsCapped(t *testing.T) {
	b := backoff{initial: 100 * time.Millisecond, multiplier: 2, max: time.Second}
	want := []time.Duration{100, 200, 400, 800, 1000, 1000}
	for i, w := range want {
		if got := b.step(i+1, b.max); got != w*time.Millisecond {
			t.Errorf("step(%d) = %s, want %s", i+1, got, w*time.Millisecond)
		}
	}
	if got := b.step(10000, b.max); got != time.Second {
		t.Errorf("step(10000) = %s, want the cap", got)
	}
	if got := b.inProcess(2); got != 200*time.Millisecond {
		t.Errorf("without jitter inProcess(2) = %s, want the step", got)
	}
}

func TestInProcessDelaysAreSpreadOverTheWholeInterval(t *testing.T) {
	b := backoff{initial: 100 * time.Millisecond, multiplier: 2, max: time.Second, jitter: true}
	const n = 20000
	step := b.step(3, b.max)
	samples := make([]time.Duration, n)
	for i := range samples {
		d := b.inProcess(3)
		if d < 0 || d >= step {
			t.Fatalf("delay %s outside [0, %s)", d, step)
		}
		samples[i] = d
	}
	if chi := chiSquareUniform(samples, 0, step, 10); chi > chiSquareLimit {
		t.Errorf("delays are not uniform over [0, %s): chi-square %.1f > %d", step, chi, chiSquareLimit)
	}
	// The same test rejects a fixed delay: it is not a test that anything passes.
	fixed := make([]time.Duration, n)
	for i := range fixed {
		fixed[i] = backoff{initial: b.initial, multiplier: 2, max: time.Second}.inProcess(3)
	}
	if chi := chiSquareUniform(fixed, 0, step, 10); chi <= chiSquareLimit {
		t.Errorf("a fixed delay passed the spread test (chi-square %.1f)", chi)
	}
}

func TestRedeliveryDelaysGrowAreNeverImmediateAndAreSpread(t *testing.T) {
	b := backoff{initial: 100 * time.Millisecond, multiplier: 2, max: time.Second, jitter: true}
	limit := time.Hour
	prevMean := 0.0
	for tries := 1; tries <= 8; tries++ {
		step := b.step(tries, limit)
		samples := make([]time.Duration, 5000)
		var sum float64
		for i := range samples {
			d := b.redelivery(tries, limit)
			if d < step/2 || d > step {
				t.Fatalf("redelivery(%d) = %s, outside [%s, %s]", tries, d, step/2, step)
			}
			samples[i] = d
			sum += float64(d)
		}
		mean := sum / float64(len(samples))
		if mean <= prevMean {
			t.Errorf("mean redelivery delay after %d tries %.0f did not grow over %.0f", tries, mean, prevMean)
		}
		prevMean = mean
		if chi := chiSquareUniform(samples, step/2, step+1, 10); chi > chiSquareLimit {
			t.Errorf("redelivery delays after %d tries are not spread over [%s, %s]: chi-square %.1f", tries, step/2, step, chi)
		}
	}
	if got := b.redelivery(1000, 5*time.Second); got > 5*time.Second || got < 2500*time.Millisecond {
		t.Errorf("redelivery is not capped: %s", got)
	}
}

func TestBackoffSurvivesHugeExponents(t *testing.T) {
	b := backoff{initial: time.Second, multiplier: 1e6, max: time.Minute, jitter: true}
	for _, n := range []int{0, 1, 50, 1 << 30, math.MaxInt} {
		if d := b.inProcess(n); d < 0 || d > time.Minute {
			t.Errorf("inProcess(%d) = %s", n, d)
		}
	}
}
