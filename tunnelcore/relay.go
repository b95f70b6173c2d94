package tunnelcore

import (
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
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
// sent before is still delivered, then both are closed. Meanwhile what the
// other side sends toward it is read and dropped (its peer reads no more,
// and a side blocked writing may stop reading what it is sent), and the
// delivery is given up (both closed) if it moves no byte for closeLinger,
// or the Conn's session ends. Both are closed when Relay returns.
//
// Copies go through io.Copy, so a Conn on either side moves its buffers
// without an extra copy (Conn implements io.ReaderFrom and io.WriterTo).
func Relay(a, b net.Conn) RelayResult {
	r := &relay{conns: [2]net.Conn{a, b}, done: make(chan struct{})}
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

// closeLinger bounds the delivery of what a Conn's peer sent before it
// closed the Conn: if the other side takes none of it for this long, the
// relay ends without the rest, as it would have at the close.
const closeLinger = 10 * time.Second

// relay is one Relay call.
type relay struct {
	conns [2]net.Conn
	res   RelayResult
	once  sync.Once
	wg    sync.WaitGroup
	done  chan struct{} // closed when Relay returns
	// For each side: its reader is done (everything it had is copied),
	// and its peer closed it (a Conn's CANCELED).
	readDone, peerClosed [2]atomic.Bool
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
	r.peerClosed[i].Store(true)
	if !r.closedByPeer(i) {
		go r.linger(vc)
	}
}

// closedByPeer ends the relay once side i's peer closed it and the bytes
// it sent before are copied, whichever of the two comes last; it reports
// whether it did.
func (r *relay) closedByPeer(i int) bool {
	if r.peerClosed[i].Load() && r.readDone[i].Load() {
		r.abort(nil)
		return true
	}
	return false
}

// linger gives up the delivery out of vc, whose peer closed it, once it
// moves no byte for closeLinger or vc's session ends.
func (r *relay) linger(vc *Conn) {
	tick := time.NewTicker(closeLinger / 10)
	defer tick.Stop()
	last, _ := vc.Counts()
	moved := time.Now()
	for {
		select {
		case <-r.done:
			return
		case <-vc.Session().Done():
			r.abort(nil)
			return
		case now := <-tick.C:
			if n, _ := vc.Counts(); n != last {
				last, moved = n, now
			} else if now.Sub(moved) >= closeLinger {
				r.abort(nil)
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
	r.readDone[i].Store(true)
	if r.peerClosed[i].Load() || (err != nil && closedBy(src, err)) {
		r.peerClosed[i].Store(true)
		r.closedByPeer(i)
		return
	}
	if err != nil && closedBy(dst, err) {
		// dst's peer closed it and reads no more: drop what src sends
		// until the relay ends (closedByPeer, linger), so that src does
		// not block writing while its own reader waits on it.
		io.Copy(io.Discard, src)
		return
	}
	switch {
	case err != nil && !isClosedErr(err):
		r.abort(err)
	case err != nil:
		r.abort(nil)
	default:
		if cw, ok := dst.(closeWriter); ok && cw.CloseWrite() == nil {
			return
		}
		r.abort(nil)
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
