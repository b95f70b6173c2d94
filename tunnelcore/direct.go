package tunnelcore

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
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
// stream keeps what it is good at: opening connections at no round trip,
// small exchanges, flow control for many connections on one socket.
//
// In the code, everything about a direct socket is in directSocket, which
// a Conn holds (Conn.direct) only once its socket is being opened or was
// attached: until then Read and Write look no further than that nil
// pointer.
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
	directDialing int32 = iota + 1 // DirectDial runs
	directOn                       // attached
	directFailed                   // tried and failed: the connection stays on the stream
)

// sockWrite is what this end's writes do with the direct socket.
type sockWrite uint8

const (
	sockWriteNone  sockWrite = iota // they go on the stream
	sockWriteMoved                  // they go to the socket (the move's marker Close is queued)
	sockWriteShut                   // CloseWrite half-closed the socket
)

// sockRead is where the peer's writes are read from.
type sockRead uint8

const (
	sockReadNone  sockRead = iota // the stream
	sockReadMoved                 // the socket, after the bytes buffered from the stream
	sockReadOn                    // the socket: the stream's bytes are read, the window's charge went back
	sockReadEOF                   // the reader read the socket's EOF
)

// directSocket is a connection's direct socket and where each direction
// stands on it. A Conn holds one (Conn.direct) from when its socket is
// being opened or was attached; until then the read and write paths look
// no further than that nil pointer. Its methods take a nil receiver as a
// connection without one.
type directSocket struct {
	state atomic.Int32 // directDialing, directOn or directFailed

	// closed is set once the connection is closed or aborted: a read of
	// the socket drops what it got after. readers counts the readers in a
	// read of the socket (enterRead); readersGone is closed once none is
	// left after the close, which the linger waits for.
	closed      atomic.Bool
	readers     atomic.Int32
	readersGone chan struct{}
	readersOnce sync.Once

	// mu guards the fields below (lock order: see the package doc).
	mu    sync.Mutex
	sock  net.Conn // nil while being opened
	write sockWrite
	read  sockRead
}

func newDirectSocket(state int32) *directSocket {
	d := &directSocket{readersGone: make(chan struct{})}
	d.state.Store(state)
	return d
}

// socket returns the attached socket, nil if none.
func (d *directSocket) socket() net.Conn {
	if d == nil {
		return nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.sock
}

// readMoved reports whether the peer moved its direction to the socket.
func (d *directSocket) readMoved() bool {
	if d == nil {
		return false
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.read >= sockReadMoved
}

// readEOF reports whether the reader read the socket's EOF.
func (d *directSocket) readEOF() bool {
	if d == nil {
		return false
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.read == sockReadEOF
}

// writeMoved reports whether this end's writes moved to the socket.
func (d *directSocket) writeMoved() bool {
	if d == nil {
		return false
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.write >= sockWriteMoved
}

// writeShut reports whether CloseWrite half-closed the socket.
func (d *directSocket) writeShut() bool {
	if d == nil {
		return false
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.write == sockWriteShut
}

// takesWrites reports whether a socket is attached that this end's
// writes go to, or are to move to at the next write.
func (d *directSocket) takesWrites() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.sock != nil && d.write != sockWriteShut
}

// shutWrite marks this end's direction on the socket shut, once. It
// returns the socket to half-close and true when it did so now; the
// socket and false when it was shut already; nil and false when the
// writes never moved.
func (d *directSocket) shutWrite() (net.Conn, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	switch d.write {
	case sockWriteMoved:
		d.write = sockWriteShut
		return d.sock, true
	case sockWriteShut:
		return d.sock, false
	}
	return nil, false
}

// closeLocked, under the connection's mu as it closes or aborts, marks the
// socket's reads closed and returns the socket, if attached, with its
// blocked reader woken (under the connection's mu, so that no
// SetReadDeadline undoes it).
func (d *directSocket) closeLocked() net.Conn {
	if d == nil {
		return nil
	}
	d.closed.Store(true)
	sock := d.socket()
	if sock != nil {
		sock.SetReadDeadline(time.Now())
	}
	return sock
}

// enterRead counts a reader of the socket; false: the connection is
// closed, and no read may start (the linger reads alone).
func (d *directSocket) enterRead() bool {
	d.readers.Add(1)
	if d.closed.Load() {
		d.leaveRead()
		return false
	}
	return true
}

func (d *directSocket) leaveRead() {
	if d.readers.Add(-1) == 0 && d.closed.Load() {
		d.readersOnce.Do(func() { close(d.readersGone) })
	}
}

// socketReadersGone returns a channel closed once no reader of the
// socket is left (asked after closed is set).
func (d *directSocket) socketReadersGone() <-chan struct{} {
	if d.readers.Load() == 0 {
		d.readersOnce.Do(func() { close(d.readersGone) })
	}
	return d.readersGone
}

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
func (c *Conn) Direct() bool {
	d := c.direct.Load()
	return d != nil && d.state.Load() == directOn
}

// countMoved counts n bytes that crossed c and tries a direct socket once
// the connection carried DirectAbove.
func (c *Conn) countMoved(written bool, n int64) {
	var total int64
	if written {
		total = c.bytesWritten.Add(n) + c.bytesRead.Load()
	} else {
		total = c.bytesRead.Add(n) + c.bytesWritten.Load()
	}
	if c.s.cfg.DirectDial == nil || total < c.s.cfg.DirectAbove || c.direct.Load() != nil {
		return
	}
	// Not now (too many opening, or a failure not long ago): a later
	// count tries again.
	if !c.s.takeDirectDial() {
		return
	}
	if d := newDirectSocket(directDialing); c.direct.CompareAndSwap(nil, d) {
		go c.goDirect(d)
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
func (c *Conn) goDirect(d *directSocket) {
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
		c.directFailed(d, err)
	}
}

// directFailed records that c stays on the stream. A peer that moved its
// direction meanwhile took a socket this end never got: the connection
// fails.
func (c *Conn) directFailed(d *directSocket, err error) {
	c.mu.Lock()
	d.state.CompareAndSwap(directDialing, directFailed)
	// The peer moved meanwhile, or may yet: its bytes would go to a
	// socket this end does not have.
	stranded := (d.readMoved() || errors.Is(err, ErrPrefaceUnanswered)) && c.rstate != recvFailed
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
	if c.flow != nil || c.life != lifeOpen || c.rstate == recvFailed || (c.rstate == recvEOF && c.wstate != sendOpen) || c.direct.Load().socket() != nil {
		return ErrNotDirect // a flow never moves (proto/README §6.1)
	}
	if answer {
		// Under mu: the answer must reach the socket before any byte this
		// end moves there (a writer moves once the socket is attached).
		// One byte to a fresh socket does not block.
		sock.SetWriteDeadline(time.Now().Add(directDialTimeout))
		if _, err := sock.Write([]byte{tunnelpb.LaneAccepted}); err != nil {
			return fmt.Errorf("answering a direct socket: %w", err)
		}
	}
	sock.SetReadDeadline(c.rdl.when())
	sock.SetWriteDeadline(c.wdl.when())
	d := c.direct.Load()
	if d == nil {
		d = newDirectSocket(directOn)
		if !c.direct.CompareAndSwap(nil, d) {
			d = c.direct.Load() // a dial began meanwhile
		}
	}
	d.mu.Lock()
	d.sock = sock
	d.mu.Unlock()
	d.state.Store(directOn)
	c.s.direct.Add(1)
	notify(c.readNotify)
	notify(c.writeNotify) // a writer waiting for credit moves instead
	return nil
}

// onPeerMoved is called when the peer moved its direction to the direct
// socket.
func (c *Conn) onPeerMoved() {
	c.mu.Lock()
	d := c.direct.Load()
	if c.rstate != recvOpen || d.readMoved() {
		c.mu.Unlock()
		return
	}
	if d.socket() == nil && (d == nil || d.state.Load() != directDialing) {
		c.mu.Unlock()
		if ok, suppressed := c.s.peerLog.Allow(); ok {
			c.s.cfg.Logger.Warn("tunnel peer moved a connection to a direct socket it does not have; connection failed",
				zapConn(c.id), zap.Int("suppressed", suppressed))
		}
		c.fail(&PeerError{Code: tunnelpb.Error_PROTOCOL, Message: "moved without a direct socket"}, tunnelpb.Error_PROTOCOL, "moved without a direct socket")
		return
	}
	// No more of this direction comes on the stream. Its window's charge
	// stays while the bytes it admitted are buffered (readSocket gives it
	// back).
	d.mu.Lock()
	d.read = sockReadMoved
	d.mu.Unlock()
	c.mu.Unlock()
	notify(c.readNotify)
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
