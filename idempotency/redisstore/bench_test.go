package redisstore_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ferrymq/ferry/idempotency"
	"github.com/ferrymq/ferry/idempotency/redisstore"
	"github.com/ferrymq/ferry/internal/testenv"
)

// BenchmarkClaimComplete measures the store's claim+complete cycle against
// the raw SET NX PX on the same server, interleaved in the same run, one at a
// time (so the ratio counts round trips). ratio = cycles/s ÷ raw/s; two round
// trips give about 0.5.
func BenchmarkClaimComplete(b *testing.B) {
	c := newClient(b, testenv.RequireRedis(b))
	ctx := context.Background()
	prefix := testenv.UniqueName(b, "idem") + ":"
	cleanPrefix(b, c, prefix)
	s, err := redisstore.NewStore(c, redisstore.WithPrefix(prefix+"k:"))
	if err != nil {
		b.Fatal(err)
	}
	var rawDur, cycleDur time.Duration
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		key := fmt.Sprint(i)
		i++
		t0 := time.Now()
		if err := c.SetNX(ctx, prefix+"raw:"+key, "x", time.Minute).Err(); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		cl, err := s.Claim(ctx, key, time.Minute)
		if err != nil || cl.Status != idempotency.Claimed {
			b.Fatalf("claim: %v %v", cl.Status, err)
		}
		if err := s.Complete(ctx, key, cl.Token, time.Minute); err != nil {
			b.Fatal(err)
		}
		t2 := time.Now()
		rawDur += t1.Sub(t0)
		cycleDur += t2.Sub(t1)
	}
	if i > 0 {
		raw, cyc := float64(i)/rawDur.Seconds(), float64(i)/cycleDur.Seconds()
		b.ReportMetric(raw, "raw/s")
		b.ReportMetric(cyc, "cycles/s")
		b.ReportMetric(cyc/raw, "ratio")
	}
}
