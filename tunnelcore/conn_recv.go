package tunnelcore

import (
	"io"
	"net"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/mem"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// recvState is the state of a connection's receive direction.
type recvState uint8

const (
	recvOpen   recvState = iota // the peer's bytes come (on the stream, or on the direct socket once it moved)
	recvEOF                     // the peer half-closed its direction: the buffered bytes, then io.EOF
	recvFailed                  // reads fail with rerr once the buffer is empty
)

// Read implements net.Conn. After the peer's CloseWrite it returns the
// buffered bytes, then io.EOF. On a datagram flow each Read returns one
// datagram (ReadDatagram).
func (c *Conn) Read(p []byte) (int, error) {
	if c.flow != nil {
		return c.readDatagram(p)
	}
	if len(p) == 0 {
		return 0, nil
	}
	for {
		if isClosedChan(c.rdl.wait()) {
			return 0, timeoutError{}
		}
		c.mu.Lock()
		if c.hasBufferedLocked() {
			n := c.copyOutLocked(p)
			inc := c.consumeLocked(int64(n))
			c.mu.Unlock()
			c.grant(inc)
			return n, nil
		}
		if d := c.direct.Load(); d != nil && c.rstate != recvFailed && d.readMoved() {
			c.mu.Unlock()
			return c.readDirect(d, p)
		}
		if err := c.readStateLocked(); err != nil {
			c.mu.Unlock()
			notify(c.readNotify) // the next waiting reader ends too
			return 0, err
		}
		c.rwin.readerWaited = true
		c.mu.Unlock()
		if err := c.waitRead(); err != nil {
			return 0, err
		}
	}
}

// readStateLocked returns io.EOF or the read error once nothing is buffered.
func (c *Conn) readStateLocked() error {
	switch c.rstate {
	case recvEOF:
		return io.EOF
	case recvFailed:
		return c.rerr
	}
	return nil
}

func (c *Conn) waitRead() error {
	select {
	case <-c.readNotify:
		return nil
	case <-c.rdl.wait():
		return timeoutError{}
	case <-c.s.done:
		// The session's end fails its connections; record it here too, in
		// case c never reached the table the session failed, so that the
		// re-check finds an error instead of waiting again at once.
		c.onSessionEnd(c.s.err)
		return nil
	}
}

// copyOutLocked copies buffered bytes into p, freeing drained buffers.
func (c *Conn) copyOutLocked(p []byte) int {
	n := 0
	for n < len(p) && c.nextBufferLocked() {
		b := c.rq.items[c.rq.head]
		data := b.ReadOnlyData()
		m := copy(p[n:], data)
		n += m
		if m == len(data) {
			c.rq.pop().Free()
		} else {
			c.rq.items[c.rq.head] = b.Slice(m, len(data))
			b.Free()
		}
	}
	return n
}

// consumeLocked accounts bytes the reader took and returns the credit to grant.
func (c *Conn) consumeLocked(n int64) int64 {
	c.buffered -= n
	c.s.buffered.Add(-n)
	return c.tookLocked(n)
}

// consumeTakenLocked is consumeLocked for n bytes WriteTo took out of rq.
// Close or an abort may have dropped the buffer meanwhile, and taken these
// bytes off the buffered counts with it: they are not taken off twice.
func (c *Conn) consumeTakenLocked(n int64) int64 {
	counted := min(n, c.taken)
	c.taken -= counted
	c.buffered -= counted
	c.s.buffered.Add(-counted)
	return c.tookLocked(n)
}

// tookLocked accounts n bytes the reader took, already off the buffered
// counts, and returns the credit to grant.
func (c *Conn) tookLocked(n int64) int64 {
	c.countMoved(false, n)
	now := time.Now()
	c.rwin.lastConsume = now
	c.rwin.reclaimSettled = false
	if c.rstate != recvOpen || c.direct.Load().readMoved() {
		return 0
	}
	return c.rwin.consume(n, now, c.s.cfg.Budget, c.s.windowLimits)
}

func (c *Conn) grant(inc int64) {
	if inc <= 0 {
		return
	}
	c.s.sendGrant(c, inc)
}

// WriteTo implements io.WriterTo: it writes received buffers to w without
// copying them first, until EOF or an error. On a datagram flow it writes
// each datagram with one Write.
func (c *Conn) WriteTo(w io.Writer) (int64, error) {
	if c.flow != nil {
		return c.writeToFlow(w)
	}
	var total int64
	for {
		bufs, err := c.takeBuffered()
		if err == errReadMoved {
			n, err := c.writeDirectTo(c.direct.Load(), w)
			return total + n, err
		}
		if err == io.EOF {
			return total, nil
		}
		if err != nil {
			return total, err
		}
		taken := int64(mem.BufferSlice(bufs).Len())
		n, werr := writeBuffers(w, bufs)
		total += n
		for i, b := range bufs {
			b.Free()
			bufs[i] = nil
		}
		// What the writer failed to take is dropped with its buffers: it is
		// consumed either way.
		c.mu.Lock()
		inc := c.consumeTakenLocked(taken)
		c.mu.Unlock()
		c.grant(inc)
		if werr != nil {
			return total, werr
		}
	}
}

// coalesceLimit bounds the copy writeBuffers makes to turn many small
// buffers into one write.
const coalesceLimit = 256 << 10

// writeBuffers writes bufs to w with as few writes as it can. Received
// data arrives in gRPC's 16 KiB frame buffers: a TCP connection takes them
// in one writev; any other writer gets them copied into writes of up to
// 256 KiB, since a copy costs far less than a write per 16 KiB.
func writeBuffers(w io.Writer, bufs []mem.Buffer) (int64, error) {
	if len(bufs) == 1 {
		return writeFull(w, bufs[0].ReadOnlyData())
	}
	if tc, ok := w.(*net.TCPConn); ok {
		nb := make(net.Buffers, len(bufs))
		for i, b := range bufs {
			nb[i] = b.ReadOnlyData()
		}
		return nb.WriteTo(tc)
	}
	var total int64
	scratch := bufferPool.Get(coalesceLimit)
	defer bufferPool.Put(scratch)
	chunk := (*scratch)[:0]
	flush := func() error {
		if len(chunk) == 0 {
			return nil
		}
		n, err := writeFull(w, chunk)
		total += n
		chunk = chunk[:0]
		return err
	}
	for _, b := range bufs {
		data := b.ReadOnlyData()
		if len(data) >= coalesceLimit/2 {
			if err := flush(); err != nil {
				return total, err
			}
			n, err := writeFull(w, data)
			total += n
			if err != nil {
				return total, err
			}
			continue
		}
		if len(chunk)+len(data) > coalesceLimit {
			if err := flush(); err != nil {
				return total, err
			}
		}
		chunk = append(chunk, data...)
	}
	return total, flush()
}

func writeFull(w io.Writer, p []byte) (int64, error) {
	n, err := w.Write(p)
	if err == nil && n < len(p) {
		err = io.ErrShortWrite
	}
	return int64(n), err
}

// takeBuffered waits for data and removes every buffered buffer, leaving the
// bytes counted as buffered until the caller consumes them.
func (c *Conn) takeBuffered() ([]mem.Buffer, error) {
	for {
		if isClosedChan(c.rdl.wait()) {
			return nil, timeoutError{}
		}
		c.mu.Lock()
		if c.hasBufferedLocked() {
			bufs := c.takeBatchLocked()
			c.mu.Unlock()
			return bufs, nil
		}
		if d := c.direct.Load(); d != nil && c.rstate != recvFailed && d.readMoved() {
			c.mu.Unlock()
			return nil, errReadMoved
		}
		if err := c.readStateLocked(); err != nil {
			c.mu.Unlock()
			notify(c.readNotify) // the next waiting reader ends too
			return nil, err
		}
		c.rwin.readerWaited = true
		c.mu.Unlock()
		if err := c.waitRead(); err != nil {
			return nil, err
		}
	}
}

// writeToBatch bounds what one WriteTo write takes: the credit for a batch
// goes back to the peer (and the bytes count as moved, Counts) only once
// the batch is written, so with a window of several MiB and a slow writer a
// whole window would otherwise wait on one write.
const writeToBatch = 256 << 10

// SetWriteToBatch bounds what one write of WriteTo takes (default 256 KiB,
// at least one received buffer, 16 KiB from gRPC). Counts advances as each
// write completes, so a caller that watches Counts for idleness sets it
// small: a slow but steady reader then shows progress within its timeout,
// at the cost of more writes.
func (c *Conn) SetWriteToBatch(n int) {
	c.mu.Lock()
	c.batch = max(n, 1)
	c.mu.Unlock()
}

// takeBatchLocked removes buffered buffers from the front, up to about
// the write batch (at least one buffer).
func (c *Conn) takeBatchLocked() []mem.Buffer {
	var bufs []mem.Buffer
	size := 0
	limit := c.batch
	if limit == 0 {
		limit = writeToBatch
	}
	for c.nextBufferLocked() && (len(bufs) == 0 || size+c.rq.items[c.rq.head].Len() <= limit) {
		b := c.rq.pop()
		size += b.Len()
		bufs = append(bufs, b)
	}
	c.taken += int64(size)
	return bufs
}

// onData is called by the receive loop with a DATA payload for c.
func (c *Conn) onData(payload mem.BufferSlice) {
	if c.flow != nil {
		c.onDatagram(payload)
		return
	}
	n := int64(payload.Len())
	c.mu.Lock()
	if c.life.closed() || c.rstate == recvFailed {
		// Read side gone: drop, the peer was or will be told.
		c.mu.Unlock()
		payload.Free()
		return
	}
	if c.rstate == recvEOF || c.direct.Load().readMoved() {
		c.mu.Unlock()
		payload.Free()
		if ok, suppressed := c.s.peerLog.Allow(); ok {
			c.s.cfg.Logger.Warn("tunnel peer sent data after closing its direction; connection failed",
				zapConn(c.id), zap.Int("suppressed", suppressed))
		}
		c.fail(&PeerError{Code: tunnelpb.Error_PROTOCOL, Message: "data after close"}, tunnelpb.Error_PROTOCOL, "data after close")
		return
	}
	if !c.rwin.receive(n) {
		c.mu.Unlock()
		payload.Free()
		c.s.logFlowViolation(c.id)
		c.fail(ErrFlowControl, tunnelpb.Error_FLOW_CONTROL, "data beyond granted credit")
		return
	}
	c.bufferLocked(payload, n)
	c.buffered += n
	c.s.buffered.Add(n)
	c.mu.Unlock()
	notify(c.readNotify)
}

// onPeerClose is called when the peer half-closed its direction.
func (c *Conn) onPeerClose() {
	c.mu.Lock()
	if c.rstate == recvOpen {
		c.rstate = recvEOF
	}
	c.mu.Unlock()
	notify(c.readNotify)
}

// shouldReclaim reports whether c's reader has been idle long enough with a
// grown window, and marks the reclaim as sent.
func (c *Conn) shouldReclaim(now time.Time, after time.Duration) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.rwin.reclaimPending || c.rwin.reclaimSettled || c.rwin.size <= InitialWindow || c.rstate != recvOpen || c.direct.Load().readMoved() || now.Sub(c.rwin.lastConsume) < after {
		return false
	}
	c.rwin.reclaimPending = true
	return true
}
