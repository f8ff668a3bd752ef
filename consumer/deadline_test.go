package consumer

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

func TestLazyDeadlineEndsAtItsDeadline(t *testing.T) {
	ctx := withLazyDeadline(context.Background(), 30*time.Millisecond)
	release := ctx.release
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
	ctx := withLazyDeadline(context.Background(), time.Millisecond)
	release := ctx.release
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
	parent, cancel := context.WithCancel(context.WithValue(context.Background(), nameKey{}, &loopInfo{name: "x"}))
	ctx := withLazyDeadline(parent, time.Hour)
	release := ctx.release
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
	if Name(ctx) != "x" {
		t.Fatal("values of the parent are lost")
	}
	p2, c2 := context.WithTimeout(context.Background(), time.Minute)
	defer c2()
	d2 := withLazyDeadline(p2, time.Hour)
	r2 := d2.release
	defer r2()
	pd, _ := p2.Deadline()
	if dl, ok := d2.Deadline(); !ok || !dl.Equal(pd) {
		t.Fatalf("Deadline = %v, want the parent's earlier %v", dl, pd)
	}
}

func TestLazyDeadlineReleaseCancels(t *testing.T) {
	ctx := withLazyDeadline(context.Background(), time.Hour)
	release := ctx.release
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
	ctx := withLazyDeadline(parent, 5*time.Millisecond)
	release := ctx.release
	defer release()
	time.Sleep(20 * time.Millisecond) // the handler runs past its own deadline...
	cancel()                          // ...and only then is the parent cancelled
	if !ctx.expired() {
		t.Fatal("a run past its own deadline is not reported as expired because the parent ended later")
	}
}

// release() ends the context in the same critical section in which it
// stops the timer, so a Done() racing with it starts no timer and registers
// nothing on the parent.
func TestLazyDeadlineReleaseRacingDoneLeaksNothing(t *testing.T) {
	parent, cancel := context.WithCancel(context.Background())
	defer cancel()
	leakedTimers, leakedLinks := 0, 0
	for i := 0; i < 20000; i++ {
		c := withLazyDeadline(parent, time.Hour)
		release := c.release
		var wg sync.WaitGroup
		wg.Add(2)
		go func() { defer wg.Done(); release() }()
		go func() { defer wg.Done(); <-c.Done() }()
		wg.Wait()
		a := c.state.Load()
		if a == nil {
			t.Fatal("neither armed nor ended after Done and release")
		}
		a.mu.Lock()
		if a.timer != nil && a.timer.Stop() { // still pending: release never stopped it
			leakedTimers++
		}
		if a.stop != nil && a.stop() { // still linked into the parent
			leakedLinks++
		}
		a.mu.Unlock()
	}
	if leakedTimers+leakedLinks > 0 {
		t.Errorf("after release: %d timers still pending, %d AfterFunc registrations still on the parent", leakedTimers, leakedLinks)
	}
}

// When the parent's deadline comes first, its expiry is not Timeout's own:
// expired() stays false, so Timeout does not blame the handler for an outer
// deadline.
func TestLazyDeadlineDoesNotClaimTheParentsDeadline(t *testing.T) {
	wrong := 0
	for i := 0; i < 2000; i++ {
		parent, cancel := context.WithTimeout(context.Background(), 200*time.Microsecond)
		c := withLazyDeadline(parent, time.Hour)
		release := c.release
		pd, _ := parent.Deadline()
		for time.Now().Before(pd) {
		}
		if c.expired() {
			wrong++
		}
		release()
		cancel()
	}
	if wrong > 0 {
		t.Errorf("%d of 2000: expired() true though only the parent's (outer) deadline passed", wrong)
	}
}

// A context nobody waited on ends without its lock: released, it says
// Canceled and its Done (asked only now) is closed; whichever end it saw
// first it keeps, as a context must, release and a parent's later end
// included.
func TestLazyDeadlineEndsWithoutAWaiterKeepTheirFirstError(t *testing.T) {
	released := withLazyDeadline(context.Background(), time.Hour)
	released.release()
	if !errors.Is(released.Err(), context.Canceled) {
		t.Fatalf("released, never waited on: Err = %v, want Canceled", released.Err())
	}
	select {
	case <-released.Done():
	default:
		t.Fatal("Done asked after release is not closed")
	}
	if first, again := released.Done(), released.Done(); first != again {
		t.Fatal("successive calls to Done return different channels")
	}

	expired := withLazyDeadline(context.Background(), time.Millisecond)
	time.Sleep(3 * time.Millisecond)
	if !errors.Is(expired.Err(), context.DeadlineExceeded) {
		t.Fatalf("past its deadline: Err = %v", expired.Err())
	}
	expired.release()
	if !errors.Is(expired.Err(), context.DeadlineExceeded) {
		t.Fatalf("released after it said DeadlineExceeded: Err = %v, want it to stay DeadlineExceeded", expired.Err())
	}

	parent, cancel := context.WithCancelCause(context.Background())
	child := withLazyDeadline(parent, time.Hour)
	cancel(errors.New("lane revoked"))
	if !errors.Is(child.Err(), context.Canceled) {
		t.Fatalf("parent cancelled: Err = %v, want the parent's Canceled", child.Err())
	}
	child.release()
	select {
	case <-child.Done():
	default:
		t.Fatal("Done of a context whose parent ended is not closed")
	}
	if !errors.Is(child.Err(), context.Canceled) || child.expired() {
		t.Fatalf("after release: Err = %v, expired %v", child.Err(), child.expired())
	}
}

// Err, Done and release racing from many goroutines agree: every Err that
// is not nil is the same error, the Done channel is one and closed after
// release, and nothing is left running.
func TestLazyDeadlineRacingCallersAgree(t *testing.T) {
	for i := range 2000 {
		d := time.Hour
		if i%2 == 1 {
			d = time.Duration(i%50) * time.Microsecond // some end by their deadline mid-race
		}
		c := withLazyDeadline(context.Background(), d)
		var wg sync.WaitGroup
		errs := make([]error, 4)
		dones := make([]<-chan struct{}, 4)
		for g := range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				switch g {
				case 0:
					c.release()
				case 1, 2:
					dones[g] = c.Done()
				default:
					errs[g] = c.Err()
				}
			}()
		}
		wg.Wait()
		final := c.Err()
		if final == nil {
			t.Fatalf("round %d: Err = nil after release", i)
		}
		if e := errs[3]; e != nil && e != final {
			t.Fatalf("round %d: Err said %v, then %v", i, e, final)
		}
		if dones[1] != dones[2] || dones[1] != c.Done() {
			t.Fatalf("round %d: Done returned different channels", i)
		}
		select {
		case <-dones[1]:
		default:
			t.Fatalf("round %d: Done not closed after release", i)
		}
	}
}
