package ratelog

import (
	"strconv"
	"testing"
	"time"
)

func TestLimiterLogsTheFirstOfEachKindPerWindowAndCountsTheRest(t *testing.T) {
	now := time.Unix(0, 0)
	l := New(3, time.Minute)
	l.now = func() time.Time { return now }
	logged := 0
	for range 10_000 {
		if ok, _ := l.Allow("handler failed: timeout"); ok {
			logged++
		}
	}
	if logged != 3 {
		t.Fatalf("logged %d of 10,000 in one window, want 3", logged)
	}
	if ok, _ := l.Allow("another kind"); !ok {
		t.Fatal("the first event of another kind was left out")
	}
	now = now.Add(time.Minute)
	ok, suppressed := l.Allow("handler failed: timeout")
	if !ok || suppressed != 9_997 {
		t.Fatalf("first event of the next window: logged %v, left out %d; want true, 9997", ok, suppressed)
	}
	if _, s := l.Allow("handler failed: timeout"); s != 0 {
		t.Fatalf("left out %d reported twice", s)
	}
}

func TestLimiterForgetsOldKindsPastItsBound(t *testing.T) {
	now := time.Unix(0, 0)
	l := New(1, time.Second)
	l.now = func() time.Time { return now }
	for i := range 3 * maxKinds {
		if i%maxKinds == 0 {
			now = now.Add(time.Second)
		}
		if ok, _ := l.Allow(strconv.Itoa(i)); !ok {
			t.Fatalf("the first event of kind %d was left out", i)
		}
	}
	if len(l.kinds) > maxKinds {
		t.Fatalf("%d kinds kept, want at most %d", len(l.kinds), maxKinds)
	}
}
