package tunnelcore

import (
	"errors"
	"io"
	"net"
	"sync"
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
// direction closes both connections, as does a Conn on either side
// breaking (aborted by either end, or its session ended): the real
// connection's read would otherwise wait for a peer that may never speak
// again.
//
// A Conn whose peer closed it (CANCELED) is the exception: what the peer
// sent before is still delivered, then the other side is half-closed and
// given closeFlush to close too, then both are closed. Meanwhile what the
// other side sends toward the Conn is read and dropped (its peer reads no
// more, and a side blocked writing may stop reading what it is sent). The
// delivery is given up, both sides cut and the result an error, if it moves
// no byte for closeLinger or the Conn's session ends first. Both are closed
// when Relay returns.
//
// Copies go through io.Copy, so a Conn on either side moves its buffers
// without an extra copy (Conn implements io.ReaderFrom and io.WriterTo).
func Relay(a, b net.Conn) RelayResult {
	return relayWith(a, b, closeLinger)
}

const (
	// closeLinger bounds a stalled delivery of what a Conn's peer sent
	// before it closed the Conn (see Relay).
	closeLinger = 30 * time.Second
	// closeFlush is how long a side given the last bytes and a half-close
	// after its peer closed may take to close too (reading what it still
	// sends, so that the close does not reset away what it was sent).
	closeFlush = time.Second
	// lingerBatch is the write batch of a Conn in delivery after its
	// peer's close, small so its progress shows (Conn.Counts).
	lingerBatch = 16 << 10
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
// it, delivered what it had and the other side had closeFlush to close
// after its half-close; it gives the delivery up when it moves no byte for
// r.linger or vc's session ends.
func (r *relay) afterPeerClose(i int, vc *Conn) {
	tick := time.NewTicker(r.linger / 10)
	defer tick.Stop()
	last, _ := vc.Counts()
	moved := time.Now()
	for {
		select {
		case <-r.done:
			return
		case <-r.copied[i]:
			flush := time.NewTimer(closeFlush)
			defer flush.Stop()
			select {
			case <-r.done:
			case <-flush.C:
				r.abort(nil)
			}
			return
		case <-vc.Session().Done():
			if !isClosedChan(r.copied[i]) {
				r.abort(errDeliveryCut)
				return
			}
			// Delivered as the session ended: the flush as above.
			select {
			case <-r.done:
			case <-time.After(closeFlush):
				r.abort(nil)
			}
			return
		case now := <-tick.C:
			if n, _ := vc.Counts(); n != last {
				last, moved = n, now
			} else if now.Sub(moved) >= r.linger && !isClosedChan(r.copied[i]) {
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
	*n, err = io.Copy(dst, src)
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
	case isClosedErr(err):
		r.abort(nil)
	default:
		r.abort(err)
	}
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
	if tc := tcpConnOf(c); tc != nil {
		tc.SetLinger(0)
		// Before c: a TLS layer closing first would send close_notify,
		// which says the stream is complete.
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
