package tunnelcore

import (
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// The reads, writes and closes of a direct socket (direct.go).

// writeSocket returns c's direct socket if its writes go there, moving
// them first if the socket came since the last write; nil: they go on the
// stream.
func (c *Conn) writeSocket(d *directSocket) (net.Conn, error) {
	c.mu.Lock()
	d.mu.Lock()
	sock, w := d.sock, d.write
	d.mu.Unlock()
	state, err := c.wstate, c.werr
	c.mu.Unlock()
	switch {
	case sock == nil || (state != sendOpen && w == sockWriteNone):
		return nil, nil
	case state == sendFailed:
		return nil, err
	case w == sockWriteShut:
		return nil, ErrWriteClosed
	case w == sockWriteMoved:
		return sock, nil
	}
	return c.moveWrites(d, sock)
}

// moveWrites moves c's open send direction to the direct socket.
func (c *Conn) moveWrites(d *directSocket, sock net.Conn) (net.Conn, error) {
	// The marker first, then the state. A Close or CloseWrite meanwhile
	// still finds the direction open on the stream and sends its FIN there
	// (before the marker or behind it: the peer reads EOF either way);
	// marked moved first, it would send nothing, and with the connection
	// finished the marker could be dropped: the peer would wait forever.
	queued := c.s.sender.enqueue(c, &tunnelpb.Envelope{Frame: &tunnelpb.Frame{Kind: &tunnelpb.Frame_Close{
		Close: &tunnelpb.Close{ConnId: c.id, Moved: true},
	}}}, true)
	c.mu.Lock()
	state, err := c.wstate, c.werr
	closedMeanwhile := state != sendOpen
	if !closedMeanwhile {
		// The stream's side of the direction is done: reserve and
		// CloseWrite take it as ended, Close sends no FIN for it.
		c.wstate = sendMoved
	}
	d.mu.Lock()
	d.write = sockWriteMoved
	if closedMeanwhile {
		d.write = sockWriteShut
	}
	d.mu.Unlock()
	c.mu.Unlock()
	switch {
	case state == sendFailed:
		return nil, err
	case closedMeanwhile:
		// Its FIN went on the stream, maybe behind the marker: the
		// socket ends too.
		closeSocketWrite(sock)
		return nil, ErrWriteClosed
	case !queued:
		return nil, ErrConnClosed
	}
	return sock, nil
}

// shutSocketWrite is CloseWrite on a direction that moved to sock.
func (c *Conn) shutSocketWrite(sock net.Conn) error {
	notify(c.writeNotify)
	if err := closeSocketWrite(sock); err != nil {
		// The socket failed under it (the peer reset it): the peer's
		// word if it came, else the socket's.
		if pe := c.peerErrOrNil(); pe != nil {
			return pe
		}
		return fmt.Errorf("direct socket: %w", err)
	}
	return nil
}

// writeDirect is Write on a connection with a direct socket: it writes p
// to the socket if c's writes go there (done), else leaves p to the
// stream.
func (c *Conn) writeDirect(d *directSocket, p []byte) (n int, done bool, err error) {
	sock, err := c.writeSocket(d)
	if sock == nil {
		return 0, err != nil, err
	}
	n, err = sock.Write(p)
	c.countMoved(true, int64(n))
	return n, true, c.socketErr(err, false)
}

// readFromDirect is ReadFrom on a connection with a direct socket: it
// copies r to the socket until r's end if c's writes go there (done),
// else leaves r to the stream.
func (c *Conn) readFromDirect(d *directSocket, r io.Reader) (n int64, done bool, err error) {
	sock, err := c.writeSocket(d)
	if sock == nil {
		return 0, err != nil, err
	}
	var inq func() int
	if rc, ok := r.(net.Conn); ok {
		inq = readQueue(rc)
	}
	n, rerr, werr := copyCounted(sock, r, inq, func(n int64) { c.countMoved(true, n) })
	if werr != nil {
		return n, true, c.socketErr(werr, false)
	}
	return n, true, rerr
}

// The buffers of a copy to or from a direct socket: it waits for bytes
// with a small one, which is all an idle connection holds, and takes a
// large one from the pool for a read only when that many bytes wait
// (bulk: one read and one write per 256 KiB, as a bare relay does).
// Where the socket cannot tell (not Linux), every read takes the medium.
const (
	copyBufferSmall  = 16 << 10
	copyBufferMedium = 64 << 10
	copyBufferLarge  = 256 << 10
)

// copyCounted copies src to dst until src's end, calling count with each
// write's bytes, so that Counts shows a slow but steady stream moving (an
// idle watcher polls it). It returns src's error and dst's apart. It does
// not splice: on one host, a reader of spliced bytes got them as a chain
// of page fragments, and reading those cost Caddy more than the copy
// spared the agent (bench/README.md, "Direct sockets"); and a splice
// returns only once its whole count moved, which a trickle takes long to.
func copyCounted(dst io.Writer, src io.Reader, inq func() int, count func(int64)) (total int64, rerr, werr error) {
	for {
		buf := bufferPool.Get(copyBufferFor(inq))
		n, err := src.Read(*buf)
		if n > 0 {
			m, err := dst.Write((*buf)[:n])
			total += int64(m)
			count(int64(m))
			if err == nil && m < n {
				err = io.ErrShortWrite
			}
			if err != nil {
				bufferPool.Put(buf)
				return total, nil, err
			}
		}
		bufferPool.Put(buf)
		switch {
		case err == io.EOF:
			return total, nil, nil
		case err != nil:
			return total, err, nil
		}
	}
}

// copyBufferFor is the buffer size for the next read, given what waits
// in the source's socket (inq; nil: not known).
func copyBufferFor(inq func() int) int {
	switch {
	case inq == nil:
		return copyBufferMedium
	case inq() > copyBufferSmall:
		return copyBufferLarge
	}
	return copyBufferSmall
}

// readSocket returns the socket c's reader reads once the stream's bytes
// are read, waiting for it while it is being opened. It returns c's read
// error instead when the connection ended.
func (c *Conn) readSocket(d *directSocket) (net.Conn, error) {
	for {
		c.mu.Lock()
		failed, err := c.rstate == recvFailed, c.rerr
		d.mu.Lock()
		sock := d.sock
		// The stream's bytes are read and no more come there: the
		// window's budget goes back (kept until now, as it bounded what
		// was still buffered).
		release := !failed && d.read == sockReadMoved
		if release {
			d.read = sockReadOn
		}
		d.mu.Unlock()
		if release {
			c.rwin.release(c.s.cfg.Budget)
		}
		c.mu.Unlock()
		if failed {
			return nil, err
		}
		if sock != nil {
			return sock, nil
		}
		if err := c.waitRead(); err != nil {
			return nil, err
		}
	}
}

// readDirect reads from the direct socket into p.
func (c *Conn) readDirect(d *directSocket, p []byte) (int, error) {
	sock, err := c.readSocket(d)
	if err != nil {
		return 0, err
	}
	if !d.enterRead() {
		return 0, ErrConnClosed
	}
	n, err := sock.Read(p)
	d.leaveRead()
	if d.closed.Load() {
		// Closed meanwhile: the bytes came after the Close.
		return 0, ErrConnClosed
	}
	c.countMoved(false, int64(n))
	if err == io.EOF {
		return n, d.sawEOF()
	}
	return n, c.socketErr(err, true)
}

// sawEOF records that the peer's direction ended on the socket and
// returns io.EOF: a FIN is the end of a whole stream, also when the peer
// aborted after it (as on the stream, where an abort after the FIN leaves
// the buffered bytes and EOF to the reader). An abort resets the socket
// instead of ending it.
func (d *directSocket) sawEOF() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.read = sockReadEOF
	return io.EOF
}

// socketReader reads a direct socket as one counted reader per Read
// (enterRead): a copy blocked writing elsewhere does not hold the close's
// linger back.
type socketReader struct {
	d    *directSocket
	sock net.Conn
}

func (r *socketReader) Read(p []byte) (int, error) {
	if !r.d.enterRead() {
		return 0, ErrConnClosed
	}
	defer r.d.leaveRead()
	return r.sock.Read(p)
}

// writeDirectTo copies the direct socket to w until its end.
func (c *Conn) writeDirectTo(d *directSocket, w io.Writer) (int64, error) {
	sock, err := c.readSocket(d)
	if err != nil {
		return 0, err
	}
	n, rerr, werr := copyCounted(w, &socketReader{d: d, sock: sock}, readQueue(sock), func(n int64) { c.countMoved(false, n) })
	if rerr != nil {
		return n, c.socketErr(rerr, true)
	}
	if werr == nil {
		if err := d.sawEOF(); err != io.EOF {
			return n, err
		}
	}
	return n, werr
}

// socketErr is the error to report for err from the direct socket: the
// connection's own when it ended (closing or aborting it closes the
// socket under a blocked call), the peer's abort, a timeout as the
// stream's deadlines report it.
func (c *Conn) socketErr(err error, reading bool) error {
	if err == nil || err == io.EOF {
		return err
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		if own := c.ownErr(reading); own != nil {
			return own // Close kicked a blocked reader with a past deadline
		}
		return timeoutError{}
	}
	if c.ownErr(reading) == nil && c.peerErrOrNil() == nil {
		// The socket failed under the call: the peer's abort resets it,
		// and its Error, or the session's end, comes on the stream, which
		// can be a little behind. Said by the stream, the error is the
		// peer's; else the socket's own.
		t := time.NewTimer(peerWordWait)
		select {
		case <-c.ended:
		case <-c.s.done:
			c.onSessionEnd(c.s.Err())
		case <-t.C:
		}
		t.Stop()
	}
	if own := c.ownErr(reading); own != nil {
		return own
	}
	if peer := c.peerErrOrNil(); peer != nil {
		return peer
	}
	return fmt.Errorf("direct socket: %w", err)
}

// peerWordWait bounds how long a failed socket call waits for the stream
// to say why (socketErr).
const peerWordWait = time.Second

// ownErr is the connection's own error for a read or a write: it was
// closed, aborted, or its session ended.
func (c *Conn) ownErr(reading bool) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	peer := c.peerErrLocked()
	if reading {
		if c.rstate == recvFailed && c.rerr != peer {
			return c.rerr
		}
		return nil
	}
	if c.wstate == sendFailed && c.werr != peer {
		return c.werr
	}
	if c.direct.Load().writeShut() {
		return ErrWriteClosed // CloseWrite shut the socket under a blocked write
	}
	return nil
}

// closeSocket ends c's direct socket: at once with a reset (abort: the
// peer's reads fail), at once with a FIN when the peer's direction ended
// too (peerDone), or else with a FIN now and the close directLinger later:
// closing with bytes unread resets the connection, which can discard what
// the peer has not read yet of what this end sent, and the peer stops
// sending once it has the Close's CANCELED.
func closeSocket(sock net.Conn, abort, peerDone bool, readersGone <-chan struct{}) {
	if sock == nil {
		return
	}
	if abort {
		resetSocket(sock)
		return
	}
	tc := tcpConnOf(sock)
	if tc == nil {
		sock.Close()
		return
	}
	tc.CloseWrite()
	if peerDone {
		tc.Close()
		sock.Close()
		return
	}
	go linger(sock, readersGone)
}

// linger reads and drops what still comes on a closed connection's
// socket, once its own readers have returned (readersGone), until the
// peer's FIN or directLinger, then closes it: closed with bytes unread,
// the socket would be reset, and a reset discards what this end's send
// queue still holds of what it wrote.
func linger(sock net.Conn, readersGone <-chan struct{}) {
	deadline := time.Now().Add(directLinger)
	t := time.NewTimer(directLinger)
	select {
	case <-readersGone:
	case <-t.C:
	}
	t.Stop()
	sock.SetReadDeadline(deadline)
	io.Copy(io.Discard, sock)
	if tc := tcpConnOf(sock); tc != nil {
		tc.Close()
	}
	sock.Close()
}

// closeSocketWrite half-closes a direct socket: a FIN on its TCP socket.
// Under TLS too: a TLS reader takes a FIN at a record's end as EOF, and
// the TLS conn under gRPC's credentials offers no CloseWrite of its own.
func closeSocketWrite(sock net.Conn) error {
	if tc := tcpConnOf(sock); tc != nil {
		return tc.CloseWrite()
	}
	return nil
}
