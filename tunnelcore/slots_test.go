package tunnelcore

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/sluice-tunnel/sluice/internal/testwait"
)

// waitFreeAsync runs WaitFree on its own goroutine and returns its answer.
func waitFreeAsync(ctx context.Context, s *Slots, d time.Duration) <-chan bool {
	out := make(chan bool, 1)
	go func() { out <- s.WaitFree(ctx, d) }()
	return out
}

// fullOneClosing returns a limit of one slot, taken by a connection that
// is closing.
func fullOneClosing() *Slots {
	s := NewSlots(1)
	s.TryAcquire()
	s.beginClosing()
	return s
}

// waitingCaller starts WaitFree and returns once it is waiting.
func waitingCaller(t *testing.T, ctx context.Context, s *Slots, d time.Duration) <-chan bool {
	t.Helper()
	before := s.waiting.Load()
	ch := waitFreeAsync(ctx, s, d)
	testwait.Until(t, 10*time.Second, "WaitFree waiting", func() bool { return s.waiting.Load() == before+1 })
	return ch
}

// answer waits for a WaitFree answer; the bound only keeps a broken
// WaitFree from hanging the test.
func answer(t *testing.T, ch <-chan bool) bool {
	t.Helper()
	select {
	case ok := <-ch:
		return ok
	case <-time.After(10 * time.Second):
		t.Fatal("WaitFree did not return")
		return false
	}
}

func TestSlotsWaitFree(t *testing.T) {
	t.Run("a free slot at once", func(t *testing.T) {
		s := NewSlots(2)
		s.TryAcquire()
		if !answer(t, waitFreeAsync(context.Background(), s, time.Hour)) {
			t.Fatal("WaitFree = false with a slot free")
		}
	})
	t.Run("none closing: no wait", func(t *testing.T) {
		s := NewSlots(1)
		s.TryAcquire()
		// An hour-long wait would time the helper out: false must come at once.
		if answer(t, waitFreeAsync(context.Background(), s, time.Hour)) {
			t.Fatal("WaitFree = true with every slot taken")
		}
	})
	t.Run("a closing slot comes back", func(t *testing.T) {
		s := fullOneClosing()
		ch := waitingCaller(t, context.Background(), s, time.Hour)
		s.Release()
		s.endClosing()
		if !answer(t, ch) {
			t.Fatal("WaitFree = false after the closing slot came back")
		}
		if s.Closing() != 0 {
			t.Fatalf("Closing = %d", s.Closing())
		}
	})
	t.Run("bounded by its wait", func(t *testing.T) {
		if answer(t, waitFreeAsync(context.Background(), fullOneClosing(), 20*time.Millisecond)) {
			t.Fatal("WaitFree = true with the slot never released")
		}
	})
	t.Run("bounded by its context", func(t *testing.T) {
		s := fullOneClosing()
		ctx, cancel := context.WithCancel(context.Background())
		ch := waitingCaller(t, ctx, s, time.Hour)
		cancel()
		if answer(t, ch) {
			t.Fatal("WaitFree = true after its context ended")
		}
	})
	t.Run("no more waiters than slots coming back", func(t *testing.T) {
		s := fullOneClosing()
		first := waitingCaller(t, context.Background(), s, time.Hour)
		if answer(t, waitFreeAsync(context.Background(), s, time.Hour)) {
			t.Fatal("a second caller waits for the one slot coming back")
		}
		s.Release()
		s.endClosing()
		if !answer(t, first) {
			t.Fatal("the first caller did not get the slot")
		}
	})
	t.Run("a slot taken by another: gives up when none is closing", func(t *testing.T) {
		s := fullOneClosing()
		ch := waitingCaller(t, context.Background(), s, time.Hour)
		// The slot comes back and another Open takes it at once; the
		// waiter must not sleep out its hour once nothing is closing.
		s.used.Add(-1)
		s.TryAcquire()
		s.endClosing()
		if answer(t, ch) {
			t.Fatal("WaitFree = true with every slot taken")
		}
	})
	t.Run("no limit", func(t *testing.T) {
		var s *Slots
		if !s.WaitFree(context.Background(), time.Hour) || !NewSlots(0).WaitFree(context.Background(), time.Hour) {
			t.Fatal("WaitFree = false without a limit")
		}
	})
}

// TestClosingConnCountsUntilItsSlotIsBack: a connection that has begun to
// end is counted as closing until its slot is released, and only once.
func TestClosingConnCountsUntilItsSlotIsBack(t *testing.T) {
	slots := NewSlots(1)
	c := &Conn{s: &Session{cfg: Config{Slots: slots}}, slot: true}
	if !slots.TryAcquire() {
		t.Fatal("no slot")
	}
	c.markSlotClosing()
	c.markSlotClosing()
	if slots.Closing() != 1 || slots.InUse() != 1 {
		t.Fatalf("closing %d, in use %d; want 1, 1", slots.Closing(), slots.InUse())
	}
	c.releaseSlot()
	c.releaseSlot()
	c.markSlotClosing() // after the release: no effect
	if slots.Closing() != 0 || slots.InUse() != 0 {
		t.Fatalf("closing %d, in use %d after the release; want 0, 0", slots.Closing(), slots.InUse())
	}
}

// TestClosingCountSurvivesRaces: marking slots closing while they are
// released, from many goroutines, leaves no slot counted closing or in use.
func TestClosingCountSurvivesRaces(t *testing.T) {
	const n = 200
	slots := NewSlots(n)
	sess := &Session{cfg: Config{Slots: slots}}
	var wg sync.WaitGroup
	for range n {
		if !slots.TryAcquire() {
			t.Fatal("no slot")
		}
		c := &Conn{s: sess, slot: true}
		wg.Add(2)
		go func() { defer wg.Done(); c.markSlotClosing() }()
		go func() { defer wg.Done(); c.releaseSlot() }()
	}
	wg.Wait()
	if slots.Closing() != 0 || slots.closing.Load() != 0 || slots.InUse() != 0 {
		t.Fatalf("closing %d, in use %d; want 0, 0", slots.closing.Load(), slots.InUse())
	}
}
