package consumer

import (
	"context"
	"math"
	"testing"
	"time"
	"unsafe"
)

// A Timeout of the largest Duration means no deadline in practice: the
// deadline saturates instead of wrapping to the past, where every run
// would end at once as a TimeoutError (found by review of the monotonic
// deadlines).
func TestLazyDeadlineOfAHugeTimeoutDoesNotWrap(t *testing.T) {
	time.Sleep(time.Millisecond) // monoNow() > 0, as in any running process
	ctx := withLazyDeadline(context.Background(), time.Duration(math.MaxInt64))
	defer ctx.release()
	if err := ctx.Err(); err != nil || ctx.expired() {
		t.Fatalf("Err = %v, expired = %v; want nil, false (a deadline centuries away)", err, ctx.expired())
	}
	if dl, _ := ctx.Deadline(); !dl.After(time.Now().Add(100 * 365 * 24 * time.Hour)) {
		t.Fatalf("Deadline = %v, want centuries from now", dl)
	}
	h := Timeout(time.Duration(math.MaxInt64))(HandlerFunc(func(ctx context.Context, _ *Message) error {
		return ctx.Err()
	}))
	if err := h.Handle(context.Background(), &Message{}); err != nil {
		t.Fatalf("a handler under Timeout(MaxInt64): %v, want nil", err)
	}
}

// timeLayout is time.Time's layout (wall, ext, loc), to move monoBase's
// wall clock reading without its monotonic one.
type timeLayout struct {
	wall uint64
	ext  int64
	loc  *time.Location
}

// A parent deadline without a monotonic reading (time.Date, Round(0), a
// deadline decoded from a message) is a wall-clock time: it is placed by
// the wall clock as it reads now, so a wall-clock step since monoBase was
// read (NTP, a host resuming from suspend) does not move it. Here the wall
// clock is made to have stepped back a minute since monoBase: a parent
// deadline 30 s away was taken as 30 s past, and the context ended at once
// (found by review).
func TestLazyDeadlinePlacesAWallClockParentDeadlineByTheClockNow(t *testing.T) {
	if unsafe.Sizeof(time.Time{}) != unsafe.Sizeof(timeLayout{}) {
		t.Skip("time.Time's layout changed: cannot move monoBase's wall clock reading")
	}
	saved := monoBase
	t.Cleanup(func() { monoBase = saved })
	now := time.Now()
	shifted, base := now.Add(time.Minute), now
	(*timeLayout)(unsafe.Pointer(&base)).wall = (*timeLayout)(unsafe.Pointer(&shifted)).wall
	monoBase = base
	if got := time.Since(monoBase); got < 0 || got > time.Second {
		t.Fatalf("setup: monoBase lost its monotonic reading (Since = %v)", got)
	}

	pd := time.Now().Add(30 * time.Second).Round(0) // wall clock only
	parent, cancel := context.WithDeadline(context.Background(), pd)
	defer cancel()
	ctx := withLazyDeadline(parent, time.Hour)
	defer ctx.release()
	if err := ctx.Err(); err != nil {
		t.Fatalf("Err = %v with the parent's deadline 30s away; want nil", err)
	}
	if dl, ok := ctx.Deadline(); !ok || !dl.Equal(pd) {
		t.Fatalf("Deadline = %v, want the parent's %v", dl, pd)
	}
}
