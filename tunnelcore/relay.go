package tunnelcore

import (
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"

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
// again. A Conn whose peer closed it (CANCELED) is the exception: what the
// peer sent before is still delivered, and both are closed once it is. Both
// are closed when Relay returns.
//
// Copies go through io.Copy, so a Conn on either side moves its buffers
// without an extra copy (Conn implements io.ReaderFrom and io.WriterTo).
func Relay(a, b net.Conn) RelayResult {
	var (
		res  RelayResult
		once sync.Once
		wg   sync.WaitGroup
		// For each side: its reader is done (everything it had is
		// copied), and its peer closed it (a Conn's CANCELED).
		readDone, peerClosed [2]atomic.Bool
	)
	conns := [2]net.Conn{a, b}
	abort := func(err error) {
		once.Do(func() {
			res.Err = err
			if err == nil {
				a.Close()
				b.Close()
				return
			}
			cut(a, err)
			cut(b, err)
		})
	}
	// closedByPeer ends the relay once side i's peer closed it and the
	// bytes it sent before are copied: whichever of the two comes last.
	closedByPeer := func(i int) {
		if peerClosed[i].Load() && readDone[i].Load() {
			abort(nil)
		}
	}
	pipe := func(i int, n *int64) {
		defer wg.Done()
		src, dst := conns[i], conns[1-i]
		var err error
		*n, err = io.Copy(dst, src)
		readDone[i].Store(true)
		if peerClosed[i].Load() || (err != nil && closedBy(src, err)) {
			peerClosed[i].Store(true)
			closedByPeer(i)
			return
		}
		if err != nil && closedBy(dst, err) {
			// Writing to a Conn whose peer closed it: that side ends
			// once its own bytes are copied (closedByPeer); until then
			// this direction has nowhere to go.
			return
		}
		if err != nil && !isClosedErr(err) {
			abort(err)
			return
		}
		if err != nil {
			abort(nil)
			return
		}
		if cw, ok := dst.(closeWriter); ok {
			if cerr := cw.CloseWrite(); cerr == nil {
				return
			}
		}
		abort(nil)
	}
	for i, x := range conns {
		if vc, ok := x.(*Conn); ok {
			vc.whenBroken(func() {
				if err := cutShort(vc.brokenErr()); err != nil {
					abort(err)
					return
				}
				peerClosed[i].Store(true)
				closedByPeer(i)
			})
			defer vc.whenBroken(nil)
		}
	}
	wg.Add(2)
	go pipe(0, &res.AToB)
	go pipe(1, &res.BToA)
	wg.Wait()
	once.Do(func() {}) // a break hook running late finds the result taken
	a.Close()
	b.Close()
	return res
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
