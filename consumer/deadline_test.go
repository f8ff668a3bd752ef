package consumer

import (
	"context"
	"errors"
	"testing"
	"time"
)

func TestLazyDeadlineEndsAtItsDeadline(t *testing.T) {
	ctx, release := withLazyDeadline(context.Background(), 30*time.Millisecond)
	defer release()
	if ctx.Err() != nil {
		t.Fatal("ended before its deadline")
	}
	select {
	case <-ctx.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("Done never closed")
	}
	if !errors.Is(ctx.Err(), context.DeadlineExceeded) || !ctx.expired() {
		t.Fatalf("Err = %v, want DeadlineExceeded", ctx.Err())
	}
}

func TestLazyDeadlineAnswersErrWithoutDone(t *testing.T) {
	ctx, release := withLazyDeadline(context.Background(), time.Millisecond)
	defer release()
	time.Sleep(5 * time.Millisecond)
	if !errors.Is(ctx.Err(), context.DeadlineExceeded) {
		t.Fatalf("Err = %v after the deadline, want DeadlineExceeded", ctx.Err())
	}
	select {
	case <-ctx.Done():
	default:
		t.Fatal("Done asked after expiry is not closed")
	}
}

func TestLazyDeadlineFollowsItsParent(t *testing.T) {
	parent, cancel := context.WithCancel(context.WithValue(context.Background(), nameKey{}, "x"))
	ctx, release := withLazyDeadline(parent, time.Hour)
	defer release()
	done := ctx.Done()
	child, cancelChild := context.WithCancel(ctx) // a user's own child context
	defer cancelChild()
	cancel()
	for _, c := range []<-chan struct{}{done, child.Done()} {
		select {
		case <-c:
		case <-time.After(10 * time.Second):
			t.Fatal("parent's cancellation did not reach the deadline context and its child")
		}
	}
	if !errors.Is(ctx.Err(), context.Canceled) || ctx.expired() {
		t.Fatalf("Err = %v, expired %v; want Canceled, not expired", ctx.Err(), ctx.expired())
	}
	if ctx.Value(nameKey{}) != "x" {
		t.Fatal("values of the parent are lost")
	}
	p2, c2 := context.WithTimeout(context.Background(), time.Minute)
	defer c2()
	d2, r2 := withLazyDeadline(p2, time.Hour)
	defer r2()
	pd, _ := p2.Deadline()
	if dl, ok := d2.Deadline(); !ok || !dl.Equal(pd) {
		t.Fatalf("Deadline = %v, want the parent's earlier %v", dl, pd)
	}
}

func TestLazyDeadlineReleaseCancels(t *testing.T) {
	ctx, release := withLazyDeadline(context.Background(), time.Hour)
	done := ctx.Done()
	release()
	select {
	case <-done:
	default:
		t.Fatal("release did not close Done")
	}
	if !errors.Is(ctx.Err(), context.Canceled) {
		t.Fatalf("Err after release = %v", ctx.Err())
	}
}

func TestLazyDeadlineExpiredWhenItsOwnDeadlinePassedBeforeTheParentEnded(t *testing.T) {
	parent, cancel := context.WithCancel(context.Background())
	ctx, release := withLazyDeadline(parent, 5*time.Millisecond)
	defer release()
	time.Sleep(20 * time.Millisecond) // the handler runs past its own deadline...
	cancel()                          // ...and only then is the parent cancelled
	if !ctx.expired() {
		t.Fatal("a run past its own deadline is not reported as expired because the parent ended later")
	}
}
