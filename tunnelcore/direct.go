package tunnelcore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"go.uber.org/zap"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// Direct sockets (proto/README §2.5). A connection that carried
// Config.DirectAbove bytes on the stream is given a socket of its own: the
// end with a DirectDial (the agent) opens it, the other end takes it with
// Session.AttachDirect, and then each end moves its direction at its next
// write: it sends a Close with moved set behind the DATA already queued,
// and writes everything after it to the socket. The reader takes the
// stream's bytes up to that Close, then reads the socket.
//
// Why: every byte on the shared stream is copied out of the stream's
// buffers into the reader's, after seven other connections' frames passed
// through the cache, and each hand-off between the stream's reader and a
// connection's reader is a wake-up. On a socket of its own, a connection is
// read straight into the reader's buffer, with TCP's flow control. The
// stream keeps
// what it is good at: opening connections at no round trip, small
// exchanges, flow control for many connections on one socket.
//
// What stays on the stream for a moved connection: its Error frames (an
// abort, or a Close telling the peer to stop sending), and the session's
// end, which ends the connection as before.

// DefaultDirectAbove is Config.DirectAbove's default: a connection moves to
// a socket of its own once it carried 1 MiB, which a page or an API call
// rarely does and a download does within milliseconds.
const DefaultDirectAbove = 1 << 20

// directDialTimeout bounds opening a direct socket; the connection goes on
// on the stream meanwhile, and for good if it fails.
const directDialTimeout = 10 * time.Second

// directLinger is how long a closed connection's socket stays open after
// its FIN (closeSocket): closing a socket with bytes unread resets the
// connection, which can discard what the peer has not read yet of what
// this end sent.
const directLinger = 2 * time.Second

// The states of a connection's direct socket.
const (
	directNone    int32 = iota // not tried
	directDialing              // DirectDial runs
	directOn                   // attached
	directFailed               // tried and failed: the connection stays on the stream
)

// ErrNotDirect is AttachDirect's error for a connection that cannot take a
// direct socket: unknown, ending, or already given one.
var ErrNotDirect = errors.New("connection cannot take a direct socket")

// ErrPrefaceUnanswered is what a DirectDial wraps when it presented the
// socket and got no answer in time: the peer may have taken it, and may
// move its direction to it. The connection fails rather than wait on a
// socket this end no longer has.
var ErrPrefaceUnanswered = errors.New("preface sent, no answer in time")

// Opening direct sockets is bounded per session: at most
// maxDirectDialing at once (each counts against the node's limit on
// connections that have not shown what they are until its preface), and
// none for directRetryAfter after one failed.
const (
	maxDirectDialing = 4
	directRetryAfter = time.Minute
)

// errGoDirect tells a writer waiting for credit that its writes go to the
// direct socket from now on.
var errGoDirect = errors.New("writes move to the direct socket")

// errReadMoved tells a reader that the stream's bytes are read and the rest
// comes from the direct socket.
var errReadMoved = errors.New("reads moved to the direct socket")

// AttachDirect gives connection id the socket the peer opened for it:
// it answers tunnelpb.LaneAccepted on sock, and this end's writes go to
// sock from its next write on. The caller closes sock on an error.
func (s *Session) AttachDirect(id uint64, sock net.Conn) error {
	c := s.lookup(id)
	if c == nil {
		return ErrNotDirect
	}
	return c.attach(sock, true)
}

// Direct reports whether c has a socket of its own.
func (c *Conn) Direct() bool { return c.directState.Load() == directOn }

// countMoved counts n bytes that crossed c and tries a direct socket once
// the connection carried DirectAbove.
func (c *Conn) countMoved(written bool, n int64) {
	var total int64
	if written {
		total = c.bytesWritten.Add(n) + c.bytesRead.Load()
	} else {
		total = c.bytesRead.Add(n) + c.bytesWritten.Load()
	}
	if c.s.cfg.DirectDial == nil || total < c.s.cfg.DirectAbove || c.directState.Load() != directNone {
		return
	}
	// Not now (too many opening, or a failure not long ago): a later
	// count tries again.
	if !c.s.takeDirectDial() {
		return
	}
	if c.directState.CompareAndSwap(directNone, directDialing) {
		go c.goDirect()
	} else {
		c.s.doneDirectDial(nil)
	}
}

// takeDirectDial reports whether a connection may open its direct socket
// now, and counts it until doneDirectDial.
func (s *Session) takeDirectDial() bool {
	if time.Now().UnixNano() < s.directRetryAt.Load() {
		return false
	}
	select {
	case s.directDialing <- struct{}{}:
		return true
	default:
		return false
	}
}

// doneDirectDial ends a count of takeDirectDial; a failure (err not nil,
// the session still up) holds further attempts off for directRetryAfter,
// and says so once.
func (s *Session) doneDirectDial(err error) {
	<-s.directDialing
	if err == nil || errors.Is(err, ErrNotDirect) || s.Err() != nil {
		return
	}
	s.directRetryAt.Store(time.Now().Add(directRetryAfter).UnixNano())
	if ok, suppressed := s.directLog.Allow(); ok {
		s.cfg.Logger.Warn("direct socket unavailable; connections stay on the data lane for a while",
			zap.Duration("retry_after", directRetryAfter), zap.Int("suppressed", suppressed), zap.Error(err))
	}
}

// goDirect opens c's direct socket and attaches it.
func (c *Conn) goDirect() {
	ctx, cancel := context.WithTimeout(context.Background(), directDialTimeout)
	defer cancel()
	go func() {
		select {
		case <-c.s.done:
			cancel()
		case <-ctx.Done():
		}
	}()
	sock, err := c.s.cfg.DirectDial(ctx, c.id)
	if err == nil {
		if err = c.attach(sock, false); err != nil {
			sock.Close()
		}
	}
	c.s.doneDirectDial(err)
	if err != nil {
		c.directFailed(err)
	}
}

// directFailed records that c stays on the stream. A peer that moved its
// direction meanwhile took a socket this end never got: the connection
// fails.
func (c *Conn) directFailed(err error) {
	c.mu.Lock()
	c.directState.Store(directFailed)
	// The peer moved meanwhile, or may yet: its bytes would go to a
	// socket this end does not have.
	stranded := (c.rmoved || errors.Is(err, ErrPrefaceUnanswered)) && c.rerr == nil
	c.mu.Unlock()
	if stranded {
		c.fail(fmt.Errorf("direct socket: %w", err), tunnelpb.Error_INTERNAL, "direct socket not answered in time")
	}
	notify(c.readNotify)
}

// attach makes sock c's direct socket. answer: this end is the one the
// socket was opened to, and tells the opener it took it.
func (c *Conn) attach(sock net.Conn, answer bool) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.sock != nil || c.closed || c.broken || c.rerr != nil || (c.readEOF && c.wclosed) {
		return ErrNotDirect
	}
	if answer {
		// Under mu: the answer must reach the socket before any byte this
		// end moves there (a writer moves once sock is set). One byte to
		// a fresh socket does not block.
		sock.SetWriteDeadline(time.Now().Add(directDialTimeout))
		if _, err := sock.Write([]byte{tunnelpb.LaneAccepted}); err != nil {
			return fmt.Errorf("answering a direct socket: %w", err)
		}
	}
	sock.SetReadDeadline(c.rdlAt)
	sock.SetWriteDeadline(c.wdlAt)
	c.sock = sock
	c.directState.Store(directOn)
	c.s.direct.Add(1)
	notify(c.readNotify)
	notify(c.writeNotify) // a writer waiting for credit moves instead
	return nil
}

// lockWrites serialises Write and ReadFrom, as a TCP socket's writes are:
// the writer that finds the direct socket attached moves the direction,
// and no other writer's DATA may follow the Close that marks the move. A
// writer waiting for another gives up at its deadline.
func (c *Conn) lockWrites() error {
	select {
	case c.wlock <- struct{}{}:
		return nil
	default:
	}
	select {
	case c.wlock <- struct{}{}:
		return nil
	case <-c.wdl.wait():
		return timeoutError{}
	case <-c.ended:
		// Closed or aborted while another writer held the lock (a
		// ReadFrom waiting on its source), as a socket's Close ends its
		// waiting writers.
		c.mu.Lock()
		err := c.werr
		c.mu.Unlock()
		if err == nil {
			err = ErrConnClosed
		}
		return err
	}
}

func (c *Conn) unlockWrites() { <-c.wlock }

// writeSocket returns c's direct socket if its writes go there, moving
// them first if the socket came since the last write; nil: they go on the
// stream.
func (c *Conn) writeSocket() (net.Conn, error) {
	c.mu.Lock()
	if c.sock == nil || (c.wclosed && !c.wmoved) {
		c.mu.Unlock()
		return nil, nil
	}
	if c.werr != nil {
		err := c.werr
		c.mu.Unlock()
		return nil, err
	}
	if c.wshut {
		c.mu.Unlock()
		return nil, ErrWriteClosed
	}
	sock := c.sock
	if c.wmoved {
		c.mu.Unlock()
		return sock, nil
	}
	c.mu.Unlock()
	// The marker first, then the state. A Close or CloseWrite meanwhile
	// still finds the direction open on the stream and sends its FIN there
	// (before the marker or behind it: the peer reads EOF either way);
	// marked moved first, it would send nothing, and with the connection
	// finished the marker could be dropped: the peer would wait forever.
	queued := c.s.sender.enqueue(c, &tunnelpb.Envelope{Frame: &tunnelpb.Frame{Kind: &tunnelpb.Frame_Close{
		Close: &tunnelpb.Close{ConnId: c.id, Moved: true},
	}}}, true)
	c.mu.Lock()
	closedMeanwhile, err := c.wclosed, c.werr
	// The stream's side of the direction is done: reserve and CloseWrite
	// take it as closed, Close sends no FIN for it.
	c.wmoved, c.wclosed = true, true
	c.wshut = c.wshut || closedMeanwhile
	c.mu.Unlock()
	switch {
	case err != nil:
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

// writeDirect writes p to the direct socket.
func (c *Conn) writeDirect(sock net.Conn, p []byte) (int, error) {
	n, err := sock.Write(p)
	c.countMoved(true, int64(n))
	return n, c.socketErr(err, false)
}

// readFromDirect copies r to the direct socket until r's end.
func (c *Conn) readFromDirect(sock net.Conn, r io.Reader) (int64, error) {
	var inq func() int
	if rc, ok := r.(net.Conn); ok {
		inq = readQueue(rc)
	}
	n, rerr, werr := copyCounted(sock, r, inq, func(n int64) { c.countMoved(true, n) })
	if werr != nil {
		return n, c.socketErr(werr, false)
	}
	return n, rerr
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
func (c *Conn) readSocket() (net.Conn, error) {
	for {
		c.mu.Lock()
		sock, err := c.sock, c.rerr
		if !c.windowGone && err == nil {
			// The stream's bytes are read and no more come there: the
			// window's budget goes back (kept until now, as it bounded
			// what was still buffered).
			c.windowGone = true
			c.rwin.release(c.s.cfg.Budget)
		}
		c.mu.Unlock()
		if err != nil {
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
func (c *Conn) readDirect(p []byte) (int, error) {
	sock, err := c.readSocket()
	if err != nil {
		return 0, err
	}
	if !c.enterSocketRead() {
		return 0, ErrConnClosed
	}
	n, err := sock.Read(p)
	c.leaveSocketRead()
	if c.closedFlag.Load() {
		// Closed meanwhile: the bytes came after the Close.
		return 0, ErrConnClosed
	}
	c.countMoved(false, int64(n))
	if err == io.EOF {
		return n, c.socketEOF()
	}
	return n, c.socketErr(err, true)
}

// socketEOF records that the peer's direction ended on the socket and
// returns io.EOF: a FIN is the end of a whole stream, also when the peer
// aborted after it (as on the stream, where an abort after the FIN leaves
// the buffered bytes and EOF to the reader). An abort resets the socket
// instead of ending it.
func (c *Conn) socketEOF() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sockEOF = true
	return io.EOF
}

// socketReader reads c's direct socket as one counted reader per Read
// (enterSocketRead): a copy blocked writing elsewhere does not hold the
// close's linger back.
type socketReader struct {
	c    *Conn
	sock net.Conn
}

func (r *socketReader) Read(p []byte) (int, error) {
	if !r.c.enterSocketRead() {
		return 0, ErrConnClosed
	}
	defer r.c.leaveSocketRead()
	return r.sock.Read(p)
}

// enterSocketRead counts a reader of the direct socket; false: the
// connection is closed, and no read may start (the linger reads alone).
func (c *Conn) enterSocketRead() bool {
	c.sockReaders.Add(1)
	if c.closedFlag.Load() {
		c.leaveSocketRead()
		return false
	}
	return true
}

func (c *Conn) leaveSocketRead() {
	if c.sockReaders.Add(-1) == 0 && c.closedFlag.Load() {
		c.readersOnce.Do(func() { close(c.readersGone) })
	}
}

// socketReadersGone returns a channel closed once no reader of the
// direct socket is left (asked after closedFlag is set).
func (c *Conn) socketReadersGone() <-chan struct{} {
	if c.sockReaders.Load() == 0 {
		c.readersOnce.Do(func() { close(c.readersGone) })
	}
	return c.readersGone
}

// writeDirectTo copies the direct socket to w until its end.
func (c *Conn) writeDirectTo(w io.Writer) (int64, error) {
	sock, err := c.readSocket()
	if err != nil {
		return 0, err
	}
	n, rerr, werr := copyCounted(w, &socketReader{c: c, sock: sock}, readQueue(sock), func(n int64) { c.countMoved(false, n) })
	if rerr != nil {
		return n, c.socketErr(rerr, true)
	}
	if werr == nil {
		if err := c.socketEOF(); err != io.EOF {
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
		if own := c.endErr(reading); own != nil {
			return own // Close kicked a blocked reader with a past deadline
		}
		return timeoutError{}
	}
	if c.endErr(reading) == nil && c.peerErrOrNil() == nil {
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
	if own := c.endErr(reading); own != nil {
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

// endErr is the connection's own error for a read or a write: it was
// closed, aborted, or its session ended.
func (c *Conn) endErr(reading bool) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if reading {
		if c.rerr != nil && c.rerr != c.peerErr {
			return c.rerr
		}
		return nil
	}
	if c.werr != nil && c.werr != c.peerErr {
		return c.werr
	}
	if c.wshut {
		return ErrWriteClosed // CloseWrite shut the socket under a blocked write
	}
	return nil
}

func (c *Conn) peerErrOrNil() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.peerErr
}

// markEnded wakes what waits for c's end (a writer waiting for the write
// lock, a failed socket call waiting for the peer's word).
func (c *Conn) markEnded() {
	c.endOnce.Do(func() { close(c.ended) })
}

// onPeerMoved is called when the peer moved its direction to the direct
// socket.
func (c *Conn) onPeerMoved() {
	c.mu.Lock()
	if c.rerr != nil || c.readEOF || c.rmoved {
		c.mu.Unlock()
		return
	}
	if c.sock == nil && c.directState.Load() != directDialing {
		c.mu.Unlock()
		if ok, suppressed := c.s.peerLog.Allow(); ok {
			c.s.cfg.Logger.Warn("tunnel peer moved a connection to a direct socket it does not have; connection failed",
				zapConn(c.id), zap.Int("suppressed", suppressed))
		}
		c.fail(&PeerError{Code: tunnelpb.Error_PROTOCOL, Message: "moved without a direct socket"}, tunnelpb.Error_PROTOCOL, "moved without a direct socket")
		return
	}
	c.rmoved = true
	// No more of this direction comes on the stream. Its window's charge
	// stays while the bytes it admitted are buffered (readSocket gives it
	// back).
	c.mu.Unlock()
	notify(c.readNotify)
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
