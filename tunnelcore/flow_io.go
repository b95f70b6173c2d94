package tunnelcore

import (
	"errors"
	"io"

	"go.uber.org/zap"
	"google.golang.org/grpc/mem"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// The datagrams of a flow: writing (into the bounded send queue), the
// receive loop's hand-over (into the bounded receive queue), reading. The
// receive queue is the Conn's own (recvQueue.rq), one buffer per datagram;
// the send queue is the Conn's place in the sender (sendSched.sq), charged
// to Conn.queued by datagramCharge.

// WriteDatagram queues p as one datagram for the peer and returns at once:
// it never waits for the peer, the stream or the reader. When the flow's
// send queue cannot take p (Config.DatagramQueue), p is dropped and counted
// and the error is ErrDatagramDropped; a p larger than MaxDatagram is
// refused (ErrDatagramTooLarge, counted too). Once the flow's write side
// ended it fails as Write does. It errs with ErrNotFlow on a connection.
func (c *Conn) WriteDatagram(p []byte) error {
	if c.flow == nil {
		return ErrNotFlow
	}
	return c.writeDatagram(p)
}

func (c *Conn) writeDatagram(p []byte) error {
	f := c.flow
	f.touch()
	if len(p) > MaxDatagram {
		f.count(&f.dropLarge, droppedTooLarge)
		return errTooLarge(len(p))
	}
	if isClosedChan(c.wdl.wait()) {
		return timeoutError{}
	}
	if err := c.flowWriteErr(); err != nil {
		return err
	}
	charge := datagramCharge(len(p))
	if c.queued.Add(charge) > int64(c.s.cfg.DatagramQueue) {
		c.queued.Add(-charge)
		f.count(&f.dropSend, droppedSendQueue)
		return ErrDatagramDropped
	}
	env := &tunnelpb.Envelope{ConnID: c.id, Payload: mem.BufferSlice{newDatagramBuffer(len(p), p)}}
	if !c.s.sender.enqueue(c, env, false) {
		// The write side ended meanwhile; discard gave the charge back.
		if err := c.flowWriteErr(); err != nil {
			return err
		}
		return ErrConnClosed
	}
	c.bytesWritten.Add(int64(len(p)))
	f.count(&f.sent, datagramsSent)
	if f.counters != nil {
		f.counters.BytesSent.Add(int64(len(p)))
	}
	return nil
}

// flowWriteErr is why c's write side takes no datagram, or nil while it
// does.
func (c *Conn) flowWriteErr() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.wstate == sendOpen {
		return nil
	}
	if c.werr != nil {
		return c.werr
	}
	if err := c.s.Err(); err != nil {
		return err
	}
	return ErrWriteClosed
}

// writeFlow is Write on a flow: p is one datagram. As on a UDP socket, a
// datagram the full queue dropped counts as written.
func (c *Conn) writeFlow(p []byte) (int, error) {
	err := c.writeDatagram(p)
	if err != nil && !errors.Is(err, ErrDatagramDropped) {
		return 0, err
	}
	return len(p), nil
}

// ReadDatagram returns the next datagram the peer sent, waiting for one
// (until the read deadline). A p shorter than the datagram gets its first
// len(p) bytes and the rest is discarded, as from a UDP socket. After the
// peer's Close it returns the queued datagrams, then io.EOF. It errs with
// ErrNotFlow on a connection.
func (c *Conn) ReadDatagram(p []byte) (int, error) {
	if c.flow == nil {
		return 0, ErrNotFlow
	}
	return c.readDatagram(p)
}

func (c *Conn) readDatagram(p []byte) (int, error) {
	b, err := c.takeDatagram()
	if err != nil {
		return 0, err
	}
	n := copy(p, b.ReadOnlyData())
	b.Free()
	return n, nil
}

// TakeDatagram waits for the next datagram, as ReadDatagram does, and
// hands over the buffer it is queued in instead of copying it out: the
// caller Frees it once done. A reader waiting here holds no buffer, where
// ReadDatagram's caller holds one as large as the largest datagram for as
// long as it waits: a thousand idle flows would hold 64 MiB. It errs with
// ErrNotFlow on a connection.
func (c *Conn) TakeDatagram() (mem.Buffer, error) {
	if c.flow == nil {
		return nil, ErrNotFlow
	}
	return c.takeDatagram()
}

func (c *Conn) takeDatagram() (mem.Buffer, error) {
	for {
		if isClosedChan(c.rdl.wait()) {
			return nil, timeoutError{}
		}
		c.mu.Lock()
		if c.rq.len() > 0 {
			b := c.rq.pop()
			size := b.Len()
			c.flow.held -= datagramCharge(size)
			c.buffered -= int64(size)
			c.mu.Unlock()
			c.s.buffered.Add(-int64(size))
			c.bytesRead.Add(int64(size))
			return b, nil
		}
		if err := c.readStateLocked(); err != nil {
			c.mu.Unlock()
			notify(c.readNotify) // the next waiting reader ends too
			return nil, err
		}
		c.mu.Unlock()
		if err := c.waitRead(); err != nil {
			return nil, err
		}
	}
}

// onDatagram is onData on a flow: the receive loop queues the datagram
// for the reader, or drops it (counted) when the queue is full or it is
// too large. It never waits.
func (c *Conn) onDatagram(payload mem.BufferSlice) {
	f := c.flow
	f.touch()
	n := payload.Len()
	if n > MaxDatagram {
		payload.Free()
		f.count(&f.dropLarge, droppedTooLarge)
		return
	}
	b := newDatagramBuffer(n, payloadParts(payload)...)
	payload.Free()
	charge := datagramCharge(n)
	c.mu.Lock()
	switch {
	case c.life.closed() || c.rstate == recvFailed:
		c.mu.Unlock()
		b.Free() // the reader is gone; the peer was or will be told
		return
	case c.rstate == recvEOF:
		c.mu.Unlock()
		b.Free()
		c.dataAfterClose()
		return
	case f.held+charge > int64(c.s.cfg.DatagramQueue):
		c.mu.Unlock()
		b.Free()
		f.count(&f.dropRecv, droppedRecvQueue)
		return
	}
	f.held += charge
	c.rq.push(b)
	c.buffered += int64(n)
	c.mu.Unlock()
	c.s.buffered.Add(int64(n))
	f.count(&f.received, datagramsReceived)
	if f.counters != nil {
		f.counters.BytesReceived.Add(int64(n))
	}
	notify(c.readNotify)
}

// payloadParts returns the byte slices of payload.
func payloadParts(payload mem.BufferSlice) [][]byte {
	parts := make([][]byte, len(payload))
	for i, b := range payload {
		parts[i] = b.ReadOnlyData()
	}
	return parts
}

// dataAfterClose fails c for DATA that came after the peer's Close.
func (c *Conn) dataAfterClose() {
	if ok, suppressed := c.s.peerLog.Allow(); ok {
		c.s.cfg.Logger.Warn("tunnel peer sent data after closing its direction; connection failed",
			zapConn(c.id), zap.Int("suppressed", suppressed))
	}
	c.fail(&PeerError{Code: tunnelpb.Error_PROTOCOL, Message: "data after close"}, tunnelpb.Error_PROTOCOL, "data after close")
}

// readFromFlow is ReadFrom on a flow: each read of r is one datagram
// (r is a UDP socket, say), until r ends (io.EOF: nil) or fails.
// Datagrams the full queue drops are counted and the copy goes on.
func (c *Conn) readFromFlow(r io.Reader) (int64, error) {
	buf := bufferPool.Get(MaxDatagram + 1)
	defer bufferPool.Put(buf)
	var total int64
	for {
		n, rerr := r.Read(*buf)
		if n > 0 {
			if err := c.writeDatagram((*buf)[:n]); err != nil && !errors.Is(err, ErrDatagramDropped) {
				return total, err
			}
			total += int64(n)
		}
		if rerr == io.EOF {
			return total, nil
		}
		if rerr != nil {
			return total, rerr
		}
	}
}

// writeToFlow is WriteTo on a flow: one Write of w per datagram, until
// the peer's Close (nil) or an error.
func (c *Conn) writeToFlow(w io.Writer) (int64, error) {
	var total int64
	for {
		b, err := c.takeDatagram()
		if err == io.EOF {
			return total, nil
		}
		if err != nil {
			return total, err
		}
		m, werr := w.Write(b.ReadOnlyData())
		b.Free()
		total += int64(m)
		if werr != nil {
			return total, werr
		}
	}
}
