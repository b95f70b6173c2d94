package tunnelcore

import (
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// RelayDatagrams carries datagrams both ways between flow and pc until
// either side ends, then closes both: UDP has no half-close, so the end of
// one direction is the end of the flow. pc is a connected UDP socket (the
// agent's, to its upstream: one per flow, so the upstream's replies come
// back to this flow's client alone) or any net.Conn whose Read returns one
// datagram and whose Write sends one (caddy-l4's connection for one client
// address of a UDP server).
//
// Nothing waits on the other side: a datagram the flow's send queue cannot
// take is dropped (and counted, FlowStats), and one the flow receives
// while its reader here is behind is dropped by the flow's receive queue.
// A connected socket's ECONNREFUSED (the upstream's port was closed when
// an earlier datagram arrived) drops that datagram and the relay goes on,
// as a UDP client would. The flow's idle timeout (Conn.SetIdleTimeout) is
// what ends a flow nobody closes.
//
// readSize is the most one Read of pc returns (0: any datagram,
// MaxDatagram): caddy-l4's connections return at most 9000 bytes, and a
// smaller buffer is held by each flow's reader while it waits. A pc that
// is a socket (a syscall.Conn, on Unix) holds none: its reader waits for
// a datagram before it takes a buffer, so idle flows cost no buffers.
//
// The result's AToB is the bytes from the flow to pc, BToA those from pc
// to the flow. Its Err is nil when the flow or pc ended (the peer's Close
// and CANCELED, this end's Close or idle timeout, pc's io.EOF or close), else the first
// failure: the peer's abort (a *PeerError, errors.Is ErrConnReset), the
// session's end (ErrSessionClosed), or pc's error.
func RelayDatagrams(flow *Conn, pc net.Conn, readSize int) RelayResult {
	if readSize <= 0 || readSize > MaxDatagram {
		readSize = MaxDatagram
	}
	r := &flowRelay{flow: flow, pc: pc}
	var release func()
	r.read, release = packetReader(pc, readSize)
	defer release()
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); r.toPacketConn() }()
	go func() { defer wg.Done(); r.toFlow() }()
	wg.Wait()
	return RelayResult{AToB: r.aToB.Load(), BToA: r.bToA.Load(), Err: r.err}
}

// flowRelay is one RelayDatagrams call.
type flowRelay struct {
	flow       *Conn
	pc         net.Conn
	read       func(use func([]byte)) error // reads one datagram of pc (packetReader)
	aToB, bToA atomic.Int64
	once       sync.Once
	err        error // set once, before both sides are closed
}

// end records err (nil: a clean end) as the result unless one was, and
// closes both sides, which ends the other direction.
func (r *flowRelay) end(err error) {
	r.once.Do(func() {
		r.err = err
		r.flow.Close()
		r.pc.Close()
	})
}

// toPacketConn writes each datagram of the flow to pc.
func (r *flowRelay) toPacketConn() {
	for {
		b, err := r.flow.takeDatagram()
		if err != nil {
			r.end(flowEndErr(err))
			return
		}
		n, err := r.pc.Write(b.ReadOnlyData())
		b.Free()
		if err != nil && !errors.Is(err, syscall.ECONNREFUSED) {
			r.end(packetEndErr(err))
			return
		}
		r.aToB.Add(int64(n))
	}
}

// toFlow queues each datagram pc reads on the flow.
func (r *flowRelay) toFlow() {
	var werr error
	queue := func(p []byte) {
		switch werr = r.flow.writeDatagram(p); {
		case werr == nil:
			r.bToA.Add(int64(len(p)))
		case errors.Is(werr, ErrDatagramDropped), errors.Is(werr, ErrDatagramTooLarge):
			werr = nil // counted by the flow; the next datagram may fit
		}
	}
	for {
		err := r.read(queue)
		if errors.Is(err, syscall.ECONNREFUSED) {
			continue
		}
		if err != nil {
			r.end(packetEndErr(err))
			return
		}
		if werr != nil {
			r.end(flowEndErr(werr))
			return
		}
	}
}

// packetReader returns a function that reads one datagram of pc, of at
// most size bytes, and hands it to use, and what gives its buffer back
// once the relay is over. On a socket it takes a pool buffer only once a
// datagram is there (socketDatagramReader); otherwise it holds one.
func packetReader(pc net.Conn, size int) (read func(use func([]byte)) error, release func()) {
	if read := socketDatagramReader(pc, size); read != nil {
		return read, func() {}
	}
	buf := bufferPool.Get(size)
	return func(use func([]byte)) error {
		n, err := pc.Read(*buf)
		if err == nil {
			use((*buf)[:n])
		}
		return err
	}, func() { bufferPool.Put(buf) }
}

// flowEndErr is the relay's result for the flow side ending with err: nil
// for a clean end (the peer's Close and CANCELED, which is how a flow
// ends: a writer may see the CANCELED first; this end's Close or idle
// timeout).
func flowEndErr(err error) error {
	var pe *PeerError
	switch {
	case err == io.EOF, errors.Is(err, ErrConnClosed), errors.Is(err, ErrWriteClosed):
		return nil
	case errors.As(err, &pe) && pe.Code == tunnelpb.Error_CANCELED:
		return nil
	}
	return err
}

// packetEndErr is the relay's result for pc ending with err: nil for its
// end (io.EOF: caddy-l4's idle timeout) or its close.
func packetEndErr(err error) error {
	if err == io.EOF || errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}
