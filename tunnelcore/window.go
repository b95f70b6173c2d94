package tunnelcore

import "time"

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

	sinceDecision int64 // bytes consumed since the last decision
	peerBlocked   bool  // the peer said it ran out of credit since the last decision
	readerWaited  bool  // the reader found the buffer empty since the last decision
	idleDecisions int   // decisions in a row without the peer being blocked

	// Reclaiming the credit of an idle reader (Session.reclaimIdle).
	lastConsume    time.Time // when the reader last took bytes
	reclaimPending bool      // a reclaim request is outstanding
	reclaimSettled bool      // reclaimed since the reader last took bytes: do not ask again
}

func newRecvWindow(initial int64) recvWindow {
	return recvWindow{size: initial, granted: initial}
}

// receive accounts n bytes that arrived and reports false when they exceed
// the credit the peer held.
func (w *recvWindow) receive(n int64) bool {
	if w.received+n > w.granted {
		return false
	}
	w.received += n
	return true
}

// consume accounts n bytes the reader took and returns the credit to grant
// back (0: grant nothing now). The window is re-decided every half window.
func (w *recvWindow) consume(n int64, budget *Budget, maxWindow int64) int64 {
	w.consumed += n
	w.sinceDecision += n
	if w.sinceDecision < w.size/2 {
		return 0
	}
	w.decide(budget, maxWindow)
	inc := w.size - (w.granted - w.consumed)
	if inc <= 0 {
		return 0
	}
	w.granted += inc
	return inc
}

// decide doubles the window while the writer is blocked and the reader keeps
// up, and halves it when the reader falls behind or the writer stops
// needing it.
func (w *recvWindow) decide(budget *Budget, maxWindow int64) {
	buffered := w.received - w.consumed
	switch {
	case w.peerBlocked && w.readerWaited && w.size < maxWindow:
		grow := min(w.size, maxWindow-w.size)
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
		if w.idleDecisions >= 2 {
			w.shrink(budget)
			w.idleDecisions = 0
		}
	default:
		w.idleDecisions = 0
	}
	w.sinceDecision = 0
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
