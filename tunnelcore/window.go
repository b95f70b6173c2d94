package tunnelcore

import (
	"sync/atomic"
	"time"
)

// recvWindow is the receiving end of one direction of a connection: it
// decides how much credit the peer holds, as HTTP/2 stream windows do, but
// resizes the window to what the reader sustains.
//
// Invariant: outstanding credit plus buffered bytes never exceed size, where
// outstanding = granted - received and buffered = received - consumed.
type recvWindow struct {
	size     int64 // current window
	granted  int64 // credit granted to the peer in total, the initial window included
	received int64 // bytes received in total
	consumed int64 // bytes the reader took in total
	charged  int64 // bytes of size charged to the budget (size - InitialWindow)

	sinceDecision int64     // bytes consumed since the last decision
	lastDecision  time.Time // when the last decision was made (zero: none yet)
	peerBlocked   bool      // the peer said it ran out of credit since the last decision
	readerWaited  bool      // the reader found the buffer empty since the last decision
	idleDecisions int       // decisions in a row without the peer being blocked

	// The tunnel's round trip as this connection sees it (rttProbe).
	probeAt   time.Time     // when the probing grant was made (zero: no probe out)
	probeMark int64         // granted before that grant
	minRTT    time.Duration // smallest grant-to-data time measured (0: none yet)
	// sessionRTT is the session's smallest measured round trip (ns), which
	// a new connection starts from and every probe lowers: a connection
	// opened on a long path grows at once rather than after measuring it.
	sessionRTT *atomic.Int64

	// Reclaiming the credit of an idle reader (Session.reclaimIdle).
	lastConsume    time.Time // when the reader last took bytes
	reclaimPending bool      // a reclaim request is outstanding
	reclaimSettled bool      // reclaimed since the reader last took bytes: do not ask again
}

func newRecvWindow(initial int64) recvWindow {
	return recvWindow{size: initial, granted: initial}
}

// newSessionRecvWindow is newRecvWindow for a connection of a session
// whose smallest measured round trip is sessionRTT (ns, 0: none yet), or
// failing that whose owner estimated seed (0: none).
func newSessionRecvWindow(initial int64, sessionRTT *atomic.Int64, seed time.Duration) recvWindow {
	w := newRecvWindow(initial)
	w.sessionRTT = sessionRTT
	w.minRTT = time.Duration(sessionRTT.Load())
	if w.minRTT == 0 {
		w.minRTT = seed
	}
	return w
}

// receive accounts n bytes that arrived and reports false when they exceed
// the credit the peer held.
func (w *recvWindow) receive(n int64) bool {
	if w.received+n > w.granted {
		return false
	}
	if w.received == 0 {
		w.lastDecision = time.Now() // the first decision measures from the first byte
	}
	w.rttProbe(n)
	w.received += n
	return true
}

// windowLimits are the sizes a receive window grows within
// (Config.MaxWindow, Config.MaxBDPWindow).
type windowLimits struct {
	max    int64 // by doubling alone
	bdpMax int64 // while the measured bandwidth-delay product asks for more
}

// openWindowLongPath is the window a connection opens with on a session
// whose measured round trip is long (openWindow): a request of a few MiB
// then takes two or three round trips instead of six or seven.
const openWindowLongPath = 1 << 20

// openWindowSeedMin is the estimated round trip (SeedRoundTrip) from which
// connections open at openWindowLongPath before one was measured: an
// estimate includes the peer's own delays, which on a busy host reach a
// millisecond or more, but not ten.
const openWindowSeedMin = 10 * time.Millisecond

// openWindow returns the receive window a connection opening on its
// session announces: InitialWindow, or on a session whose connections
// measured a long round trip (or, with none measured yet, whose estimate
// is at least openWindowSeedMin) openWindowLongPath within limits.max,
// when the budget grants it. An idle reader gives the credit back as any
// grown window does (Session.reclaimIdle).
func (w *recvWindow) openWindow(measured, seed time.Duration, budget *Budget, limits windowLimits) int64 {
	size := min(int64(openWindowLongPath), limits.max)
	long := measured >= longRoundTrip || (measured == 0 && seed >= openWindowSeedMin)
	if !long || size <= w.size || !budget.grow(w.charged, size-w.size) {
		return w.size
	}
	w.charged += size - w.size
	w.size, w.granted = size, size
	return size
}

// lowerRoundTrip stores d (ns) in rtt if rtt holds none yet or a longer one.
func lowerRoundTrip(rtt *atomic.Int64, d time.Duration) {
	for {
		old := rtt.Load()
		if (old != 0 && old <= int64(d)) || rtt.CompareAndSwap(old, int64(d)) {
			return
		}
	}
}

// rttProbe records the round trip a pending probe measured when n more
// bytes arrive. The first byte past probeMark could only be sent once the
// probing grant reached the writer, so the time from that grant to its
// arrival is one round trip of the tunnel plus the writer's own delay; the
// smallest such time is the round trip. The session learns every
// measurement, also one above what this window started from (an estimate,
// SeedRoundTrip): a measured round trip is what opens windows larger.
func (w *recvWindow) rttProbe(n int64) {
	if w.probeAt.IsZero() || w.received+n <= w.probeMark {
		return
	}
	rtt := time.Since(w.probeAt)
	if w.minRTT == 0 || rtt < w.minRTT {
		w.minRTT = rtt
	}
	if w.sessionRTT != nil {
		lowerRoundTrip(w.sessionRTT, rtt)
	}
	w.probeAt = time.Time{}
}

// consume accounts n bytes the reader took at now and returns the credit
// to grant back (0: grant nothing now). The window is re-decided every half
// window.
func (w *recvWindow) consume(n int64, now time.Time, budget *Budget, limits windowLimits) int64 {
	w.consumed += n
	w.sinceDecision += n
	if w.sinceDecision < w.size/2 {
		return 0
	}
	w.decide(now, budget, limits)
	inc := w.size - (w.granted - w.consumed)
	if inc <= 0 {
		return 0
	}
	if w.probeAt.IsZero() {
		w.probeAt, w.probeMark = now, w.granted
	}
	w.granted += inc
	return inc
}

// perRTT returns the bytes the reader took per round trip of the tunnel
// since the last decision (0: not measured yet).
func (w *recvWindow) perRTT(now time.Time) int64 {
	elapsed := now.Sub(w.lastDecision)
	if w.minRTT == 0 || w.lastDecision.IsZero() || elapsed <= 0 {
		return 0
	}
	return int64(float64(w.sinceDecision) * float64(w.minRTT) / float64(elapsed))
}

// A window returns its credit every half window, so the credit a writer
// holds arrives half a round trip late: a connection held back by its
// window moves about half of it per round trip. Past limits.max the window
// grows while the reader takes more than a third of it per round trip
// (bdpGrowShare) and is kept while it takes more than a sixth
// (bdpKeepShare), so it settles at two to six times the path's
// bandwidth-delay product. On one host the round trip is microseconds and
// neither applies; over a WAN they let one connection fill the path, as
// TCP's window scaling does.
// A window held back by a round trip of at least longRoundTrip grows
// eightfold per decision instead of doubling: each decision waits for half
// a window to arrive, about a round trip, so doubling from InitialWindow to
// the 16 MiB a 100 MB/s path needs at 50 ms would take eight of them, and
// a transfer of a few MiB would be over before its window fit the path.
const (
	bdpGrowShare  = 3
	bdpKeepShare  = 6
	longRoundTrip = time.Millisecond
)

// decide doubles the window while the writer is blocked and the reader keeps
// up, and halves it when the reader falls behind or the writer stops
// needing it.
func (w *recvWindow) decide(now time.Time, budget *Budget, limits windowLimits) {
	buffered := w.received - w.consumed
	perRTT := w.perRTT(now)
	windowBound := bdpGrowShare*perRTT > w.size
	ceiling := limits.max
	if w.size >= limits.max && windowBound {
		ceiling = limits.bdpMax
	}
	switch {
	case w.peerBlocked && w.readerWaited && w.size < ceiling:
		grow := w.size
		if windowBound && w.minRTT >= longRoundTrip {
			grow = 7 * w.size // each decision costs a round trip here
		}
		grow = min(grow, ceiling-w.size)
		if budget.grow(w.charged, grow) {
			w.size += grow
			w.charged += grow
		}
		w.idleDecisions = 0
	case w.peerBlocked && !w.readerWaited && buffered > w.size/4:
		w.shrink(budget)
		w.idleDecisions = 0
	case !w.peerBlocked:
		w.idleDecisions++
		pathNeedsIt := w.size > limits.max && bdpKeepShare*perRTT > w.size
		if w.idleDecisions >= 2 && !pathNeedsIt {
			w.shrink(budget)
			w.idleDecisions = 0
		}
	default:
		w.idleDecisions = 0
	}
	w.sinceDecision = 0
	w.lastDecision = now
	w.peerBlocked = false
	w.readerWaited = false
}

func (w *recvWindow) shrink(budget *Budget) {
	if w.size <= InitialWindow {
		return
	}
	give := min(w.size/2, w.charged)
	budget.shrink(w.charged, give)
	w.size -= give
	w.charged -= give
}

// release gives the whole budget charge back (the connection ended).
func (w *recvWindow) release(budget *Budget) {
	budget.shrink(w.charged, w.charged)
	w.charged = 0
}

// reclaimed takes back the credit the peer released after a reclaim
// request and shrinks the window to InitialWindow, releasing its budget.
// What is in flight or buffered is still counted, so grants stay withheld
// until the reader has drained below the new window.
func (w *recvWindow) reclaimed(released int64, budget *Budget) {
	w.granted -= released
	// Keep the charge for what is still held (buffered, or in flight
	// against credit granted earlier); release the rest.
	keep := max(0, min(w.charged, w.granted-w.consumed-InitialWindow))
	budget.shrink(w.charged, w.charged-keep)
	w.charged = keep
	w.size = InitialWindow + keep
	w.sinceDecision = 0
	w.idleDecisions = 0
}

// topUp grants what the window lacks when the peer's credit and the
// buffered bytes together fell below half of it with no decision to come:
// an answer to a reclaim request may arrive after the peer spent the credit
// it kept and the reader took it, and then no byte can arrive to trigger
// the next grant. It returns the increment to send (0: none).
func (w *recvWindow) topUp() int64 {
	out := w.granted - w.consumed
	if out >= w.size/2 {
		return 0
	}
	inc := w.size - out
	w.granted += inc
	return inc
}
