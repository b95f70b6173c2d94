package tunnelcore

import (
	"testing"
	"time"
)

func TestBudgetShareLeavesRoomForOneMore(t *testing.T) {
	const mib = 1 << 20
	b := NewBudget(9 * mib)
	// Alone, a connection may hold up to half: 4.5 MiB.
	if !b.grow(0, 4*mib) {
		t.Fatal("first connection: 4 MiB within a 4.5 MiB share refused")
	}
	if b.grow(4*mib, mib) {
		t.Fatal("first connection grew past its 4.5 MiB share")
	}
	// A second holder's share is a third: 3 MiB.
	if b.grow(0, 4*mib) {
		t.Fatal("second connection took 4 MiB past its 3 MiB share")
	}
	if !b.grow(0, 3*mib) {
		t.Fatal("second connection: 3 MiB within its share refused")
	}
	if got := b.Holders(); got != 2 {
		t.Fatalf("holders = %d, want 2", got)
	}
	// Giving everything back stops holding.
	b.shrink(3*mib, 3*mib)
	b.shrink(4*mib, mib)
	if got := b.Holders(); got != 1 {
		t.Fatalf("holders after one full release = %d, want 1", got)
	}
	b.shrink(3*mib, 3*mib)
	if b.Holders() != 0 || b.InUse() != 0 {
		t.Fatalf("after releasing all: holders %d, in use %d", b.Holders(), b.InUse())
	}
}

// TestBudgetSharedFairlyByGrowingWindows: four connections whose writers
// are blocked and whose readers keep up all grow past InitialWindow on a
// budget that one of them alone could take whole, and none holds more than
// its share.
func TestBudgetSharedFairlyByGrowingWindows(t *testing.T) {
	const conns, maxWindow = 4, 4 << 20
	b := NewBudget(4 << 20) // one 4 MiB window would take it all
	ws := make([]recvWindow, conns)
	for i := range ws {
		ws[i] = newRecvWindow(InitialWindow)
	}
	for range 20 { // decisions, round-robin: every window asks to double
		for i := range ws {
			ws[i].peerBlocked, ws[i].readerWaited = true, true
			ws[i].decide(time.Now(), b, windowLimits{max: maxWindow, bdpMax: maxWindow})
			if share := b.Limit() / (b.Holders() + 1); ws[i].charged > share {
				t.Fatalf("window %d holds %d, above its share %d", i, ws[i].charged, share)
			}
		}
	}
	for i, w := range ws {
		if w.size <= InitialWindow {
			t.Errorf("window %d never grew (size %d): the others took the budget", i, w.size)
		}
	}
	if b.InUse() > b.Limit() {
		t.Fatalf("budget overdrawn: %d of %d", b.InUse(), b.Limit())
	}
}
