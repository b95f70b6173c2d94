package tunnelcore

import (
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/mem"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// sender is the only goroutine that writes to the stream. Control frames
// (window updates, session frames, refusals) go first; connection frames are
// taken one at a time from the connections round-robin, so a busy connection
// cannot starve the others. It blocks in FrameStream.Send while the stream is
// not ready (gRPC flow control), and nothing queues without bound in front of
// it: each connection's queue is bounded by Config.SendQueue.
type sender struct {
	s    *Session
	wake chan struct{}

	// sendingSince is when the Send in progress started (unix nanos), 0
	// while none is: the stall watchdog reads it.
	sendingSince atomic.Int64

	mu     sync.Mutex
	ctrl   fifo[*tunnelpb.Envelope]
	ready  fifo[*Conn]
	closed bool
}

func (q *sender) init(s *Session) {
	q.s = s
	q.wake = make(chan struct{}, 1)
}

func (s *Session) sendControl(f *tunnelpb.Frame) {
	q := &s.sender
	q.mu.Lock()
	if q.closed {
		q.mu.Unlock()
		return
	}
	q.ctrl.push(&tunnelpb.Envelope{Frame: f})
	q.mu.Unlock()
	notify(q.wake)
}

func (s *Session) sendConnFrame(c *Conn, f *tunnelpb.Frame) {
	s.sender.enqueue(c, &tunnelpb.Envelope{Frame: f})
}

func (s *Session) sendData(c *Conn, b mem.Buffer) {
	c.bytesWritten.Add(int64(b.Len()))
	s.sender.enqueue(c, &tunnelpb.Envelope{ConnID: c.id, Payload: mem.BufferSlice{b}})
}

func (q *sender) enqueue(c *Conn, env *tunnelpb.Envelope) {
	q.mu.Lock()
	if q.closed || c.removed {
		q.mu.Unlock()
		q.discard(c, env)
		return
	}
	c.sq.push(env)
	if !c.inReady {
		c.inReady = true
		q.ready.push(c)
	}
	q.mu.Unlock()
	notify(q.wake)
}

// discard frees a frame that will never be sent and returns its bytes to
// the connection's queue allowance.
func (q *sender) discard(c *Conn, env *tunnelpb.Envelope) {
	if env.IsData() {
		if c != nil {
			c.queued.Add(-int64(env.Payload.Len()))
		}
		env.Payload.Free()
	}
}

// purge drops every frame c has queued (the connection was aborted).
func (s *Session) purge(c *Conn) {
	q := &s.sender
	q.mu.Lock()
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
	remove := c.sq.len() == 0 && !c.removed
	if remove {
		c.removed = true
	}
	q.mu.Unlock()
	if remove {
		s.removeConn(c)
	}
}

// next returns the next frame to send and the connection it belongs to, or
// nil once the session ended.
func (q *sender) next() (*tunnelpb.Envelope, *Conn) {
	for {
		q.mu.Lock()
		if q.closed {
			q.mu.Unlock()
			return nil, nil
		}
		if q.ctrl.len() > 0 {
			env := q.ctrl.pop()
			q.mu.Unlock()
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
				if c.finished && !c.removed {
					c.removed = true
					remove = true
				}
			}
			q.mu.Unlock()
			if env.IsData() {
				c.queued.Add(-int64(env.Payload.Len()))
				notify(c.writeNotify)
			}
			if remove {
				q.s.removeConn(c)
			}
			return env, c
		}
		q.mu.Unlock()
		select {
		case <-q.wake:
		case <-q.s.done:
			return nil, nil
		}
	}
}

func (q *sender) loop() {
	for {
		env, _ := q.next()
		if env == nil {
			return
		}
		q.sendingSince.Store(time.Now().UnixNano())
		err := q.s.stream.Send(env)
		q.sendingSince.Store(0)
		if err != nil {
			env.Payload.Free()
			q.s.CloseWithError(err)
			return
		}
	}
}

// shutdown stops the sender and frees everything still queued.
func (q *sender) shutdown() {
	q.mu.Lock()
	q.closed = true
	q.ctrl.drain()
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
