package tunnelcore

import (
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/mem"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// sender is the goroutine that writes frames to the stream. Control frames
// (window updates, session frames, refusals) go first; connection frames are
// taken one at a time from the connections round-robin, so a busy connection
// cannot starve the others. It blocks in FrameStream.Send while the stream
// is not ready (gRPC flow control), and nothing queues without bound in
// front of it: each connection's queue is bounded by Config.SendQueue. A
// payload spliced into a plaintext lane (sendSpliced) is queued and written
// by the sender too, in its connection's turn.
type sender struct {
	s    *Session
	wake chan struct{}

	// sendingSince is when the Send in progress started (unix nanos), 0
	// while none is: the stall watchdog reads it.
	sendingSince atomic.Int64

	mu     sync.Mutex
	ctrl   fifo[ctrlItem]
	paced  int // entries of ctrl that count against controlQueueBound
	ready  fifo[*Conn]
	closed bool

	// batch is the stream when it holds frames until flushed
	// (batchingStream), else nil; marks are the Flush marks the sender
	// reached whose frames the stream may still hold.
	batch batchingStream
	marks []chan struct{}

	// splice is the stream when it can take spliced payloads, else nil.
	splice splicingStream

	// full is set while the paced control frames are over their bound,
	// until they are down to half (read by the receive loop without the
	// lock, per frame);
	// room wakes the receive loop waiting for that (roomWanted set).
	full       atomic.Bool
	room       chan struct{}
	roomWanted bool
}

// sendSched is a connection's place in the sender: the frames it queued
// and what it owes its peer. It is embedded in Conn, and every field is
// guarded by the sender's mu (never by the connection's own).
type sendSched struct {
	sq             fifo[*tunnelpb.Envelope]
	inReady        bool  // c is in the sender's ready queue
	finished       bool  // no more frames will be queued; remove once sq drains
	removed        bool  // c left the session's table (removeConn)
	dataDone       bool  // our FIN or abort went to the sender: DATA is refused
	answersOwed    int64 // reclaim requests not answered yet
	answerReleased int64 // credit given back, not reported in an answer yet
	answerQueued   bool  // the control queue holds this connection's answers
	grantOwed      int64 // credit decided for the peer, not sent yet
	grantQueued    bool  // the control queue holds this connection's grant
	ctrlHeld       int   // control queue entries of this connection
}

// batchingStream is a FrameStream that may hold frames Send was given
// until Flush (ConnStream: one writev for many small frames, as gRPC's
// writer puts many frames in one write). The sender flushes whenever it
// has nothing more queued, and at each Session.Flush mark.
type batchingStream interface {
	FrameStream
	Flush() error
	// Holding reports whether Send holds small frames worth letting
	// others join before Flush.
	Holding() bool
}

func (q *sender) init(s *Session) {
	q.s = s
	q.batch, _ = s.stream.(batchingStream)
	if sp, ok := s.stream.(splicingStream); ok && sp.canSplice() {
		q.splice = sp
	}
	q.wake = make(chan struct{}, 1)
	q.room = make(chan struct{}, 1)
}

// minFrameCharge is the least a queued DATA frame counts against
// Config.SendQueue: the smallest buffer the pool hands out, which even a
// one-byte frame holds. Counting payload bytes alone, a peer granting credit
// a byte at a time while it stopped reading would have each connection queue
// a quarter of a million one-byte frames, each holding a buffer and an
// envelope.
const minFrameCharge = 4 << 10

// frameCharge is what a DATA frame of n payload bytes counts against the
// connection's queue allowance: the size of the pool buffer it is held in
// (Write and ReadFrom put every frame in the pool tier of its length, see
// fitBuffer), at least minFrameCharge.
func frameCharge(n int64) int64 {
	if n <= 0 {
		return 0
	}
	return int64(bufferSize(int(n)))
}

func (s *Session) sendConnFrame(c *Conn, f *tunnelpb.Frame) {
	s.sender.enqueue(c, &tunnelpb.Envelope{Frame: f}, false)
}

// sendFIN queues c's Close frame: DATA queued after it is refused.
func (s *Session) sendFIN(c *Conn) {
	s.sender.enqueue(c, &tunnelpb.Envelope{Frame: &tunnelpb.Frame{Kind: &tunnelpb.Frame_Close{Close: &tunnelpb.Close{ConnId: c.id}}}}, true)
}

// sendData queues a DATA frame of b, whose bytes Conn.reserve charged. It
// fails, freeing b and giving the reservation back, once c's write side
// ended in front of the sender (its FIN or abort is queued or sent): a
// writer that reserved before a concurrent Close or CloseWrite must not
// put DATA behind the FIN, which the peer would take as a protocol
// violation that throws away the bytes written before it.
func (s *Session) sendData(c *Conn, b mem.Buffer) error {
	n := int64(b.Len())
	if !s.sender.enqueue(c, &tunnelpb.Envelope{ConnID: c.id, Payload: mem.BufferSlice{b}}, false) {
		return c.dataRefused(n)
	}
	c.countMoved(true, n)
	return nil
}

// sendSpliced queues a DATA frame of c whose payload waits in a pipe
// (see splice.go), whose bytes Conn.reserve charged, and reports whether
// it did (not once c's write side or the session ended); f.done tells when
// the sender wrote it or dropped it.
func (s *Session) sendSpliced(c *Conn, f *splicedFrame) bool {
	return s.sender.enqueue(c, &tunnelpb.Envelope{ConnID: c.id, Deferred: f}, false)
}

// enqueue queues env for c and reports whether it did; fin marks the last
// frame of c's byte stream, after which DATA is refused. A frame refused
// (the session or c ended) is discarded.
func (q *sender) enqueue(c *Conn, env *tunnelpb.Envelope, fin bool) bool {
	q.mu.Lock()
	if q.closed || c.removed || (c.dataDone && env.IsData()) {
		q.mu.Unlock()
		q.discard(c, env)
		return false
	}
	if fin {
		c.dataDone = true
	}
	c.sq.push(env)
	if !c.inReady {
		c.inReady = true
		q.ready.push(c)
	}
	q.mu.Unlock()
	notify(q.wake)
	return true
}

// discard frees a frame that will never be sent and returns its bytes to
// the connection's queue allowance.
func (q *sender) discard(c *Conn, env *tunnelpb.Envelope) {
	if env.IsData() {
		if c != nil {
			c.queued.Add(-c.dataCharge(env.DataLen()))
		}
		env.Payload.Free()
		if f, ok := env.Deferred.(*splicedFrame); ok {
			f.done <- errFrameDropped
		}
	}
}

// purge drops every frame c has queued (the connection was aborted).
func (s *Session) purge(c *Conn) {
	q := &s.sender
	q.mu.Lock()
	c.dataDone = true
	frames := c.sq.drain()
	q.mu.Unlock()
	for _, env := range frames {
		q.discard(c, env)
	}
	notify(c.writeNotify)
}

// finish marks c as ending: it leaves the session's table once its queued
// frames have left the sender.
func (s *Session) finish(c *Conn) {
	c.markSlotClosing()
	q := &s.sender
	q.mu.Lock()
	c.finished = true
	remove := removableLocked(c)
	if remove {
		c.removed = true
	}
	q.mu.Unlock()
	if remove {
		s.removeConn(c)
	}
}

// next returns the next frame to send and the connection it belongs to, or
// nil once the session ended. On a batching stream it also returns nil,
// without waiting, when nothing is queued (wait false) or it reached a
// Flush mark: the stream is to be flushed.
func (q *sender) next(wait bool) (*tunnelpb.Envelope, *Conn) {
	for {
		q.mu.Lock()
		if q.closed {
			q.mu.Unlock()
			return nil, nil
		}
		if q.ctrl.len() > 0 {
			env, ended := q.popControlLocked()
			q.mu.Unlock()
			if ended != nil {
				q.s.removeConn(ended)
			}
			if env == nil { // a Flush mark
				if q.batch != nil {
					return nil, nil
				}
				continue
			}
			return env, nil
		}
		if q.ready.len() > 0 {
			c := q.ready.pop()
			if c.sq.len() == 0 { // purged while waiting its turn
				c.inReady = false
				q.mu.Unlock()
				continue
			}
			env := c.sq.pop()
			remove := false
			if c.sq.len() > 0 {
				q.ready.push(c)
			} else {
				c.inReady = false
				if removableLocked(c) {
					c.removed = true
					remove = true
				}
			}
			q.mu.Unlock()
			if env.IsData() {
				c.queued.Add(-c.dataCharge(env.DataLen()))
				notify(c.writeNotify)
			}
			if remove {
				q.s.removeConn(c)
			}
			return env, c
		}
		q.mu.Unlock()
		if !wait {
			return nil, nil
		}
		select {
		case <-q.wake:
		case <-q.s.done:
			return nil, nil
		}
	}
}

func (q *sender) loop() {
	wait, yielded := q.batch == nil, false
	for {
		env, _ := q.next(wait)
		if env == nil {
			if q.batch == nil || q.ended() {
				return
			}
			if !wait && !yielded && q.batch.Holding() && !q.marked() {
				// Nothing queued, a few small frames held: let the
				// goroutines that are about to queue run first, as
				// gRPC's writer does before it flushes, so that their
				// frames share the write.
				yielded = true
				runtime.Gosched()
				continue
			}
			// Still nothing, or a Flush mark: write what the stream
			// holds, then wait for more (a mark may be followed by more).
			if err := q.flushStream(); err != nil {
				q.s.CloseWithError(err)
				return
			}
			wait, yielded = true, false
			continue
		}
		wait, yielded = q.batch == nil, false
		q.sendingSince.Store(time.Now().UnixNano())
		err := q.send(env)
		q.sendingSince.Store(0)
		if err != nil {
			env.Payload.Free()
			q.s.CloseWithError(err)
			return
		}
	}
}

// send writes one frame: a spliced payload after its header, anything
// else through FrameStream.Send.
func (q *sender) send(env *tunnelpb.Envelope) error {
	f, ok := env.Deferred.(*splicedFrame)
	if !ok {
		return q.s.stream.Send(env)
	}
	err := q.splice.sendSpliced(env.ConnID, f.pipe, f.n)
	if err != nil {
		// End the session before the relay hears: it must report the
		// session's end (a cut), not a connection closed (a clean end).
		q.s.CloseWithError(err)
	}
	f.done <- err
	return err
}

// ended reports whether the sender was shut down or the session ended.
func (q *sender) ended() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.closed || q.s.isDone()
}

// marked reports whether a Flush mark waits for the next flush: next
// returned for it, and a yield would let more frames come before the
// flush, which under load might never come (Flush would wait out its
// context).
func (q *sender) marked() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.marks) > 0
}

// flushStream flushes a batching stream and closes the Flush marks it
// covered.
func (q *sender) flushStream() error {
	q.sendingSince.Store(time.Now().UnixNano())
	err := q.batch.Flush()
	q.sendingSince.Store(0)
	if err != nil {
		return err
	}
	q.mu.Lock()
	marks := q.marks
	q.marks = nil
	q.mu.Unlock()
	for _, m := range marks {
		close(m)
	}
	return nil
}

// shutdown stops the sender and frees everything still queued.
func (q *sender) shutdown() {
	q.mu.Lock()
	q.closed = true
	q.ctrl.drain()
	q.paced = 0
	var frames []*tunnelpb.Envelope
	var owners []*Conn
	for q.ready.len() > 0 {
		c := q.ready.pop()
		c.inReady = false
		for _, env := range c.sq.drain() {
			frames = append(frames, env)
			owners = append(owners, c)
		}
	}
	q.mu.Unlock()
	for i, env := range frames {
		q.discard(owners[i], env)
	}
}
