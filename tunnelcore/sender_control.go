package tunnelcore

import (
	"math"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// The sender's control queue: frames that go before any connection's
// (window updates, refusals, session frames), how a connection's grants
// and reclaim answers share one entry each, and how a peer that does not
// read them is paced.

// ctrlItem is a control frame, or (answer set) the reclaim answers a
// connection owes, or (grant set) the credit its reader gave back: those
// are built when sent, so each connection holds at most one queue entry of
// each, however many requests the peer sent or however much it pushed
// through a reader while not reading our frames. paced marks a frame that
// counts against controlQueueBound.
//
// Entries of a connection (answer, grant, or owner set) keep it in the
// session's table, holding its slot, until they left: a peer cycling
// connections while it reads nothing cannot leave entries behind beyond
// the connections the slots allow.
type ctrlItem struct {
	env    *tunnelpb.Envelope
	answer *Conn
	grant  *Conn
	owner  *Conn // the connection env belongs to, for frames of one
	paced  bool
	// flushed, on an entry with nothing else set, is closed when the
	// sender reaches it: every entry before it has been sent (Flush).
	flushed chan struct{}
}

// conn returns the connection the entry belongs to, if any.
func (it ctrlItem) conn() *Conn {
	switch {
	case it.answer != nil:
		return it.answer
	case it.grant != nil:
		return it.grant
	}
	return it.owner
}

// controlQueueBound paces a peer by its own reading: a peer can make each
// of its frames cost a control frame that no connection bounds (a refused
// Connect's Error, the answer to a session frame), so one that sends faster
// than it reads the answers would grow the control queue without end. While
// more than this many such frames wait, the receive loop takes no further
// frame from the peer, until they are down to half: the peer's sends then
// wait on gRPC's flow control, as its data would. Failing the session
// instead would cut every connection of an agent for a burst of refusals on
// a slow uplink. A peer that stops reading altogether is cut by the stall
// watchdog.
//
// Frames that belong to a live connection (grants, blocked notices,
// reclaim requests and answers) do not count: each connection queues a
// few at a time (its grants and its reclaim answers share one entry each,
// its blocked notices follow its queue, which minFrameCharge bounds in
// frames, and it asks for one reclaim at a time), and an ended connection
// keeps its slot until they left, so they are bounded by the slots. Counting them would let two busy ends deadlock: each with
// thousands of connections' grants queued, each stops reading the other,
// and neither's sends drain.
const controlQueueBound = 4096

// sendConnControl queues a control frame of live connection c (a blocked
// notice, a reclaim request; see controlQueueBound).
func (s *Session) sendConnControl(c *Conn, f *tunnelpb.Frame) {
	s.pushControl(ctrlItem{env: &tunnelpb.Envelope{Frame: f}, owner: c})
}

// sendPacedControl queues a control frame no connection bounds: an answer
// to a frame the peer sent (a refusal), a connection's Error, or a session
// frame.
func (s *Session) sendPacedControl(f *tunnelpb.Frame) {
	s.pushControl(ctrlItem{env: &tunnelpb.Envelope{Frame: f}, paced: true})
}

func (s *Session) pushControl(it ctrlItem) {
	q := &s.sender
	q.mu.Lock()
	if q.closed {
		q.mu.Unlock()
		return
	}
	q.pushLocked(it)
	q.mu.Unlock()
	notify(q.wake)
}

// pushLocked queues a new control entry and counts it: paced entries
// against controlQueueBound, a connection's entries on the connection.
func (q *sender) pushLocked(it ctrlItem) {
	q.ctrl.push(it)
	if c := it.conn(); c != nil {
		c.ctrlHeld++
	}
	if it.paced {
		q.paced++
		if q.paced > controlQueueBound {
			q.full.Store(true)
		}
	}
}

// sendReclaimAnswer queues the answer to a reclaim request for c, which
// gave released bytes of credit back. Answers c still owes share one queue
// entry: the sender still sends exactly one WindowUpdate per request, the
// first carrying every byte released until then and the others what was
// released since (0 unless credit came in between). The receiver only
// subtracts each released from what it granted, and c lowered its credit
// before any of these answers leaves, so reporting a release early is safe.
func (s *Session) sendReclaimAnswer(c *Conn, released int64) {
	s.owe(ctrlItem{answer: c}, &c.answerQueued, func() {
		c.answersOwed++
		c.answerReleased += released
	})
}

// sendGrant queues inc bytes of credit for c's peer. Grants not sent yet
// share one queue entry and leave as one WindowUpdate: the credit was
// counted as granted when decided, so the peer may already be sending
// against it, and sending it sooner, summed, changes nothing else.
func (s *Session) sendGrant(c *Conn, inc int64) {
	s.owe(ctrlItem{grant: c}, &c.grantQueued, func() { c.grantOwed += inc })
}

// owe records under the sender's lock what a connection owes its peer
// (record) and queues the entry that pays it (it), unless one already
// waits (*queued, guarded by the same lock).
func (s *Session) owe(it ctrlItem, queued *bool, record func()) {
	q := &s.sender
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed {
		return
	}
	record()
	if *queued {
		return
	}
	*queued = true
	q.pushLocked(it)
	notify(q.wake)
}

// popControlLocked takes the next control frame; the receive loop waiting
// for room is woken once the paced frames are down to half their bound. It
// also returns the connection to remove from the session's table, if this
// was the last thing holding an ended one there (see finish).
func (q *sender) popControlLocked() (*tunnelpb.Envelope, *Conn) {
	it := q.ctrl.pop()
	if it.flushed != nil {
		if q.batch != nil {
			// Sent means written: the stream still holds what came
			// before the mark until the loop flushes it.
			q.marks = append(q.marks, it.flushed)
		} else {
			close(it.flushed)
		}
		return nil, nil
	}
	if it.paced {
		q.paced--
	}
	if q.full.Load() && q.paced <= controlQueueBound/2 {
		q.full.Store(false)
		if q.roomWanted {
			q.roomWanted = false
			notify(q.room)
		}
	}
	env, again := it.env, false
	switch {
	case it.answer != nil:
		env, again = q.reclaimAnswerLocked(it)
	case it.grant != nil:
		env, again = q.grantLocked(it)
	}
	if again {
		q.ctrl.push(it) // still counted on its connection
		return env, nil
	}
	if c := it.conn(); c != nil {
		c.ctrlHeld--
		if removableLocked(c) {
			c.removed = true
			return env, c
		}
	}
	return env, nil
}

// removableLocked reports whether ended connection c has nothing left in
// front of the sender, so it may leave the session's table (and give its
// slot back). Its caller sets c.removed and calls removeConn.
func removableLocked(c *Conn) bool {
	return c.finished && !c.removed && c.sq.len() == 0 && c.ctrlHeld == 0
}

// grantLocked builds the WindowUpdate of the credit it.grant owes its peer
// (see sendGrant); an increment is a uint32, so past 4 GiB the rest is
// still owed (again: the entry goes back in the queue).
func (q *sender) grantLocked(it ctrlItem) (env *tunnelpb.Envelope, again bool) {
	c := it.grant
	inc := min(c.grantOwed, math.MaxUint32)
	c.grantOwed -= inc
	again = c.grantOwed > 0
	c.grantQueued = again
	c.s.count(windowUpdatesSent)
	return &tunnelpb.Envelope{Frame: &tunnelpb.Frame{Kind: &tunnelpb.Frame_WindowUpdate{
		WindowUpdate: &tunnelpb.WindowUpdate{ConnId: c.id, Increment: uint32(inc)},
	}}}, again
}

// reclaimAnswerLocked builds one of the reclaim answers it.answer owes
// (see sendReclaimAnswer): the first carries what was released meanwhile,
// the others 0. While more are owed the entry goes back in the queue.
func (q *sender) reclaimAnswerLocked(it ctrlItem) (env *tunnelpb.Envelope, again bool) {
	c := it.answer
	r := min(c.answerReleased, math.MaxUint32)
	c.answerReleased -= r
	c.answersOwed--
	again = c.answersOwed > 0
	c.answerQueued = again
	return &tunnelpb.Envelope{Frame: &tunnelpb.Frame{Kind: &tunnelpb.Frame_WindowUpdate{
		WindowUpdate: &tunnelpb.WindowUpdate{ConnId: c.id, Released: uint32(r)},
	}}}, again
}

// waitControlRoom returns once the control queue is within its bound, or
// false when the session ended first. The receive loop calls it before
// taking each frame from the peer (see controlQueueBound).
func (s *Session) waitControlRoom() bool {
	q := &s.sender
	for {
		if !q.full.Load() {
			return true
		}
		q.mu.Lock()
		if !q.full.Load() || q.closed {
			q.mu.Unlock()
			return !s.isDone()
		}
		q.roomWanted = true
		q.mu.Unlock()
		select {
		case <-q.room:
		case <-s.done:
			return false
		}
	}
}
