package tunnelcore

import (
	"errors"
	"io"
	"net"
	"sync"
	"syscall"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// closeWriter is a connection that can half-close (TCP, TLS, Conn).
type closeWriter interface {
	CloseWrite() error
}

// RelayResult reports what a relay moved and why it ended.
type RelayResult struct {
	// AToB and BToA are the bytes copied in each direction.
	AToB, BToA int64
	// Err is the first error that was not a clean end of stream (nil when
	// both directions ended with EOF).
	Err error
}

// Relay copies bytes both ways between a and b until both directions end,
// propagating half-closes: when one side's reader reaches EOF, the other
// side's writer is closed with CloseWrite (or Close when it cannot
// half-close) and the opposite direction continues. An error in either
// direction cuts both connections (a Conn is aborted, a TCP connection
// reset) and is the result, as does a Conn on either side breaking (aborted
// by either end, or its session ended): the real connection's read would
// otherwise wait for a peer that may never speak again.
//
// A Conn whose peer closed it (CANCELED) is the exception: what the peer
// sent before is still delivered, then the other side is half-closed, and
// both are closed once it acknowledged every byte (a TCP connection; others
// get closeFlush) or closed too. Meanwhile what the other side sends toward
// the Conn is read and dropped (its peer reads no more, and a side blocked
// writing may stop reading what it is sent). The delivery is given up,
// both cut and the result errDeliveryCut, if it makes no progress for
// closeLinger or the Conn's session ends first.
//
// Copies go through io.Copy, so a Conn on either side moves its buffers
// without an extra copy (Conn implements io.ReaderFrom and io.WriterTo).
func Relay(a, b net.Conn) RelayResult {
	return relayWith(a, b, closeLinger)
}

const (
	// closeLinger bounds a delivery, after a Conn's peer closed it, that
	// makes no progress (see Relay).
	closeLinger = 30 * time.Second
	// closeFlush is how long a side that is not a TCP connection, given
	// the last bytes and a half-close after its peer closed, may take to
	// close too.
	closeFlush = time.Second
	// lingerBatch is the write batch of a Conn in delivery after its
	// peer's close, small so its progress shows (Conn.Counts).
	lingerBatch = 16 << 10
	// lingerPoll is how often a delivery after a peer's close is checked.
	lingerPoll = 50 * time.Millisecond
	// resetDelivery bounds each wait of a relay whose socket's peer reset
	// the connection: for the socket's reader to take what the peer sent
	// before, and for the Conn to send it (see deliverThenAbort).
	resetDelivery = 2 * time.Second
)

// errDeliveryCut is the result of a relay that gave up delivering what a
// Conn's peer sent before it closed.
var errDeliveryCut = errors.New("tunnel: the connection's peer closed, and what it sent could not all be delivered")

// relayWith is Relay with the stall bound of a delivery after a peer's
// close.
func relayWith(a, b net.Conn, linger time.Duration) RelayResult {
	r := &relay{conns: [2]net.Conn{a, b}, done: make(chan struct{}), linger: linger}
	for i := range r.copied {
		r.copied[i] = make(chan struct{})
	}
	for i, x := range r.conns {
		if vc, ok := x.(*Conn); ok {
			vc.whenBroken(func() { r.broken(i, vc) })
			defer vc.whenBroken(nil)
		}
	}
	r.wg.Add(2)
	go r.pipe(0, &r.res.AToB)
	go r.pipe(1, &r.res.BToA)
	r.wg.Wait()
	r.once.Do(func() {}) // a break hook running late finds the result taken
	close(r.done)
	a.Close()
	b.Close()
	return r.res
}

// relay is one Relay call.
type relay struct {
	conns  [2]net.Conn
	linger time.Duration
	res    RelayResult
	once   sync.Once
	wg     sync.WaitGroup
	done   chan struct{}    // closed when Relay returns
	copied [2]chan struct{} // closed when side i's reader is done
}

// abort ends the relay: a nil err closes both sides, another cuts them.
func (r *relay) abort(err error) {
	r.once.Do(func() {
		r.res.Err = err
		if err == nil {
			r.conns[0].Close()
			r.conns[1].Close()
			return
		}
		cut(r.conns[0], err)
		cut(r.conns[1], err)
	})
}

// broken is side i's hook: its Conn vc broke.
func (r *relay) broken(i int, vc *Conn) {
	if err := cutShort(vc.brokenErr()); err != nil {
		r.abort(err)
		return
	}
	vc.SetWriteToBatch(lingerBatch)
	go r.afterPeerClose(i, vc)
}

// afterPeerClose ends the relay once side i's Conn vc, whose peer closed
// it, delivered what it had to the other side and that side acknowledged
// it (or closed too); it gives the delivery up when it makes no progress
// for r.linger or vc's session ends first.
func (r *relay) afterPeerClose(i int, vc *Conn) {
	other := r.conns[1-i]
	queued, acked := sendQueue(other), socketProgress(other)
	progress := func() uint64 {
		n, _ := vc.Counts()
		if acked != nil {
			n += int64(acked()) // bytes the peer took of an in-flight write
		}
		return uint64(n)
	}
	tick := time.NewTicker(lingerPoll)
	defer tick.Stop()
	sessionDone := vc.Session().Done()
	last, moved := progress(), time.Now()
	var flushBy time.Time // without a send queue to watch, once delivered
	for {
		select {
		case <-r.done:
			return
		case <-sessionDone:
			if !isClosedChan(r.copied[i]) {
				r.abort(errDeliveryCut)
				return
			}
			sessionDone = nil // delivered: the flush below still applies
		case now := <-tick.C:
			if n := progress(); n != last {
				last, moved = n, now
			}
			if isClosedChan(r.copied[i]) {
				switch {
				case queued != nil && queued() == 0:
					r.abort(nil) // every byte acknowledged
					return
				case queued == nil && flushBy.IsZero():
					flushBy = now.Add(closeFlush)
				case queued == nil && now.After(flushBy):
					r.abort(nil)
					return
				}
			}
			if now.Sub(moved) >= r.linger {
				r.abort(errDeliveryCut)
				return
			}
		}
	}
}

// pipe copies side i to the other side.
func (r *relay) pipe(i int, n *int64) {
	defer r.wg.Done()
	src, dst := r.conns[i], r.conns[1-i]
	var err error
	*n, err = copyConn(dst, src)
	close(r.copied[i])
	switch {
	case err == nil || closedBy(src, err):
		// EOF, or the peer's close without one: half-close dst.
		if cw, ok := dst.(closeWriter); ok && cw.CloseWrite() == nil {
			return
		}
		r.abort(nil)
	case closedBy(dst, err):
		// dst's peer closed it and reads no more: drop what src sends
		// until the relay ends (afterPeerClose), so that src does not
		// block writing while its own reader waits on it.
		io.Copy(io.Discard, src)
	case isClosedErr(err) && !errors.Is(err, ErrSessionClosed):
		r.abort(nil)
	default:
		r.deliverThenAbort(err) // a session's end too: the stream was cut short
	}
}

// deliverThenAbort cuts the relay after err. When err is the socket's peer
// resetting the connection (ECONNRESET, EPIPE), what that peer sent before
// its reset reaches the Conn's peer first, as it would reach a client of
// the socket itself: a server that answers an upload early (a 413, a 401)
// and closes with the body unread resets the connection right after its
// answer. An abort drops the Conn's queued frames, and a socket closed
// with unread bytes drops those, so it waits, at most resetDelivery each,
// for the socket's reader to finish and for the Conn's queue to drain.
func (r *relay) deliverThenAbort(err error) {
	vc, sock := r.connSides()
	if vc == nil || !isPeerReset(err) {
		r.abort(err)
		return
	}
	wait := time.NewTimer(resetDelivery)
	select {
	case <-r.copied[sock]:
	case <-wait.C:
	}
	wait.Stop()
	vc.awaitSent(resetDelivery)
	r.abort(err)
}

// connSides returns the relay's Conn and the index of its other side, or
// nil when not exactly one side is a Conn.
func (r *relay) connSides() (*Conn, int) {
	a, aok := r.conns[0].(*Conn)
	b, bok := r.conns[1].(*Conn)
	switch {
	case aok && !bok:
		return a, 1
	case bok && !aok:
		return b, 0
	}
	return nil, 0
}

// isPeerReset reports whether err is a socket's peer resetting (or having
// closed) the connection under a read or write.
func isPeerReset(err error) bool {
	return errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// copyConn is io.Copy, except that a Conn reading a TCP socket is given
// the socket itself: io.Copy prefers the socket's WriteTo, which hands the
// Conn a wrapper that hides the socket, and with it splicing.
func copyConn(dst, src net.Conn) (int64, error) {
	if vc, ok := dst.(*Conn); ok {
		if _, ok := src.(*net.TCPConn); ok {
			return vc.ReadFrom(src)
		}
	}
	return io.Copy(dst, src)
}

// closedBy reports whether err is c's peer having closed c (a Conn's
// CANCELED), a clean end rather than a cut.
func closedBy(c net.Conn, err error) bool {
	vc, ok := c.(*Conn)
	if !ok {
		return false
	}
	var perr *PeerError
	return errors.As(err, &perr) && perr.Code == tunnelpb.Error_CANCELED && cutShort(vc.brokenErr()) == nil && vc.isBroken()
}

// cut ends c after a relay error so that whoever is behind it learns the
// stream was cut short rather than finished: a virtual connection is
// aborted (its peer reads an error, not EOF), a TCP connection reset. A
// close would pass a truncated stream off as a whole one to a protocol
// that ends its messages at close.
func cut(c net.Conn, err error) {
	if x, ok := c.(*Conn); ok {
		if x.isBroken() { // its peer knows already
			x.Close()
			return
		}
		x.Abort(tunnelpb.Error_RESET, err.Error())
		return
	}
	resetSocket(c)
}

// resetSocket closes c with a reset of its TCP socket, closed before c: a
// TLS layer closing first would send a close_notify, which says the
// stream is complete, and could block on a peer that stopped reading.
func resetSocket(c net.Conn) {
	if tc := tcpConnOf(c); tc != nil {
		tc.SetLinger(0)
		tc.Close()
	}
	c.Close()
}

// cutShort is the error a relay ends with when its virtual connection
// broke with err: nil (close both sides normally) when the peer only
// closed it (CANCELED, which follows a Close), err otherwise (the peer's
// relay cut its stream, the session ended), which cut passes on.
func cutShort(err error) error {
	var perr *PeerError
	if errors.As(err, &perr) && perr.Code == tunnelpb.Error_CANCELED {
		return nil
	}
	return err
}

func isClosedErr(err error) bool {
	return errors.Is(err, net.ErrClosed) || errors.Is(err, io.EOF) || errors.Is(err, ErrConnClosed)
}
