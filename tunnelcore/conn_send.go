package tunnelcore

import (
	"io"
	"syscall"

	"google.golang.org/grpc/mem"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// sendState is the state of a connection's send direction.
type sendState uint8

const (
	sendOpen      sendState = iota // Write sends DATA on the stream
	sendFinQueued                  // CloseWrite or Close queued our FIN on the stream
	sendMoved                      // writes go to the direct socket; the stream's side ended with the move's marker
	sendFailed                     // writes fail with werr
)

// Write implements net.Conn. It returns once p is queued for the sender,
// waiting for credit from the peer and room in the queue as needed. On a
// datagram flow p is one datagram, queued or dropped at once (writeFlow).
func (c *Conn) Write(p []byte) (int, error) {
	if c.flow != nil {
		return c.writeFlow(p)
	}
	if err := c.lockWrites(); err != nil {
		return 0, err
	}
	defer c.unlockWrites()
	total := 0
	pool := bufferPool
	for len(p) > 0 {
		if d := c.direct.Load(); d != nil {
			if n, done, err := c.writeDirect(d, p); done {
				return total + n, err
			}
		}
		n, err := c.reserve(len(p))
		if err == errGoDirect {
			continue // a direct socket came while waiting for credit
		}
		if err != nil {
			return total, err
		}
		buf := pool.Get(n)
		copy(*buf, p[:n])
		if err := c.s.sendData(c, mem.NewBuffer(buf, pool)); err != nil {
			return total, err
		}
		p = p[n:]
		total += n
	}
	return total, nil
}

// ReadFrom implements io.ReaderFrom: it reads from r straight into the
// buffers it hands to the sender, sending no more than the peer's credit.
// From a TCP socket onto a plaintext lane, a connection whose reads show
// bulk moves its payloads inside the kernel instead (see splice.go). On a
// datagram flow each read of r is one datagram (readFromFlow).
func (c *Conn) ReadFrom(r io.Reader) (int64, error) {
	if c.flow != nil {
		return c.readFromFlow(r)
	}
	if err := c.lockWrites(); err != nil {
		return 0, err
	}
	defer c.unlockWrites()
	var src syscall.RawConn
	if c.s.sender.splice != nil {
		src = spliceSource(r)
	}
	var total int64
	bulk := false
	for {
		if d := c.direct.Load(); d != nil {
			if n, done, err := c.readFromDirect(d, r); done {
				return total + n, err
			}
		}
		if bulk {
			n, err := c.spliceFrom(src)
			total += n
			switch {
			case err == io.EOF:
				return total, nil
			case err == errGoDirect:
				continue
			case err != errSpliceOff:
				return total, err
			}
			// Copy until the next bulk read: past the urgent byte, or
			// until a pipe is to be had.
		}
		m, err := c.readFrame(r)
		total += int64(m)
		if err == errGoDirect {
			continue
		}
		if err != nil {
			if err == io.EOF {
				return total, nil
			}
			return total, err
		}
		bulk = src != nil && m >= spliceAbove
	}
}

// readFrame reads one frame's worth from r into a buffer and queues it,
// returning its length; io.EOF at r's end.
func (c *Conn) readFrame(r io.Reader) (int, error) {
	n, err := c.reserve(c.s.cfg.MaxFrameSize)
	if err != nil {
		return 0, err
	}
	pool := bufferPool
	buf := pool.Get(n)
	m, rerr := r.Read(*buf)
	if m < n {
		c.unreserve(int64(n), int64(m))
	}
	if m > 0 {
		buf = fitBuffer(buf, m)
		if err := c.s.sendData(c, mem.NewBuffer(buf, pool)); err != nil {
			return 0, err
		}
	} else {
		pool.Put(buf)
	}
	return m, rerr
}

// reserve waits until the connection may queue up to want bytes and
// charges them against the credit and the queue.
func (c *Conn) reserve(want int) (int, error) {
	for {
		if isClosedChan(c.wdl.wait()) {
			return 0, timeoutError{}
		}
		c.mu.Lock()
		if d := c.direct.Load(); d != nil && (c.wstate == sendOpen || c.wstate == sendMoved) && d.takesWrites() {
			c.mu.Unlock()
			return 0, errGoDirect
		}
		if c.wstate != sendOpen {
			err := c.werr
			if err == nil {
				err = ErrWriteClosed
			}
			c.mu.Unlock()
			// One wake-up ends every writer waiting here: a notice holds
			// a single token, and net.Conn allows concurrent Writes.
			notify(c.writeNotify)
			return 0, err
		}
		if room := int64(c.s.cfg.SendQueue) - c.queued.Load(); c.credit > 0 && room > 0 {
			// Never past SendQueue by more than one frame's minimum
			// charge: the sender only lowers queued, so the room
			// measured here is there, and the frame is cut to what its
			// buffer's charge fits in.
			n := int64(min(want, c.s.cfg.MaxFrameSize))
			n = fitRoom(min(n, c.credit, room), room)
			c.credit -= n
			c.queued.Add(frameCharge(n))
			c.mu.Unlock()
			return int(n), nil
		}
		noCredit := c.credit == 0
		tellBlocked := noCredit && !c.blockedSent
		if tellBlocked {
			c.blockedSent = true
		}
		c.mu.Unlock()
		if noCredit {
			c.s.count(creditWaits)
		}
		if tellBlocked {
			c.s.sendConnControl(c, &tunnelpb.Frame{Kind: &tunnelpb.Frame_WindowUpdate{
				WindowUpdate: &tunnelpb.WindowUpdate{ConnId: c.id, Blocked: true},
			}})
		}
		select {
		case <-c.writeNotify:
		case <-c.wdl.wait():
			return 0, timeoutError{}
		case <-c.s.done:
			c.mu.Lock()
			err := c.werr
			c.mu.Unlock()
			if err == nil {
				err = c.s.Err()
			}
			return 0, err
		}
	}
}

// unreserve gives back what a reservation of reserved bytes did not use.
func (c *Conn) unreserve(reserved, used int64) {
	c.mu.Lock()
	c.credit += reserved - used
	c.mu.Unlock()
	c.queued.Add(frameCharge(used) - frameCharge(reserved))
}

// dataRefused gives back the credit of n reserved bytes the sender refused
// (their queue allowance went back with the frame) and returns why the
// write side ended.
func (c *Conn) dataRefused(n int64) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.credit += n
	switch c.wstate {
	case sendFailed:
		return c.werr
	case sendFinQueued, sendMoved:
		return ErrWriteClosed
	}
	if err := c.s.Err(); err != nil {
		return err
	}
	return ErrConnClosed
}

// CloseWrite half-closes the connection: the peer reads EOF after the bytes
// already written, and may still send.
func (c *Conn) CloseWrite() error {
	c.mu.Lock()
	if d := c.direct.Load(); d != nil && c.wstate != sendFailed {
		if sock, shut := d.shutWrite(); sock != nil || shut {
			c.mu.Unlock()
			if !shut {
				return nil // shut already
			}
			return c.shutSocketWrite(sock)
		}
	}
	switch c.wstate {
	case sendFailed:
		// A session that ended under the connection, with nothing else
		// ending it, is an error to report; after Close or an abort by
		// either end, the direction is simply done.
		err := c.werr
		cut := c.life == lifeBroken && c.endHow == ConnSessionEnded
		c.mu.Unlock()
		if cut {
			return err
		}
		return nil
	case sendFinQueued, sendMoved:
		c.mu.Unlock()
		return nil
	}
	c.wstate = sendFinQueued
	c.mu.Unlock()
	notify(c.writeNotify)
	c.s.sendFIN(c)
	return nil
}

// onWindowUpdate is called with the peer's flow control for c.
func (c *Conn) onWindowUpdate(u *tunnelpb.WindowUpdate) {
	if c.flow != nil {
		return // a flow has no credit (proto/README §6.1)
	}
	var released, topUp int64
	c.mu.Lock()
	if u.GetBlocked() {
		c.rwin.peerBlocked = true
	}
	if inc := int64(u.GetIncrement()); inc > 0 {
		c.credit += inc
		c.blockedSent = false
	}
	above := int64(u.GetReclaimAbove())
	if above > 0 && c.credit > above {
		// The peer's reader is idle: give back the credit above what it
		// keeps, so it can release its budget.
		released = c.credit - above
		c.credit = above
	}
	if u.GetReleased() > 0 || (u.GetReclaimAbove() == 0 && u.GetIncrement() == 0 && !u.GetBlocked() && c.rwin.reclaimPending) {
		c.rwin.reclaimed(int64(u.GetReleased()), c.s.cfg.Budget)
		c.rwin.reclaimPending = false
		c.rwin.reclaimSettled = true
		if c.rstate == recvOpen && !c.direct.Load().readMoved() {
			topUp = c.rwin.topUp()
		}
	}
	c.mu.Unlock()
	c.grant(topUp)
	if u.GetIncrement() > 0 {
		notify(c.writeNotify)
	}
	if above > 0 {
		c.s.sendReclaimAnswer(c, released)
	}
}
