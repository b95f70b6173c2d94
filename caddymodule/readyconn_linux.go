package caddymodule

import (
	"io"
	"net"
	"syscall"

	"google.golang.org/grpc/mem"
)

// readyConn is the plaintext gRPC connection of an agent over TCP: the
// peeked guarded connection, read by gRPC with ReadOnReady. gRPC's
// transport (grpc-go ≥ 1.85, internal/transport/readyreader) uses that
// method when the net.Conn it reads offers it, and then takes a read buffer
// from its pool only once the socket is readable, instead of holding a
// bufio.Reader of grpc.ReadBufferSize (128 KiB here) for the connection's
// life: an idle agent connection pinned that much of the node's heap
// (bench/scale.sh). gRPC finds the method on a *net.TCPConn by itself, but
// not through the wrappers the node reads through (guardedConn, peekedConn),
// which is why they are skipped here: the guard only watches for the first
// byte, which was read (peekedConn.first) before this conn exists, and the
// deadlines gRPC sets go to the socket, whose poller Read below honours.
// A TLS connection cannot offer it: its records are decrypted into its own
// buffer.
type readyConn struct {
	*peekedConn
	raw syscall.RawConn
	// The read in progress, in fields so that ReadOnReady does not
	// allocate a closure per read (as gRPC's own reader does).
	bufSize int
	pool    mem.BufferPool
	buf     *[]byte
	n       int
	err     error
	doRead  func(fd uintptr) bool
}

// readyConnOf returns p with ReadOnReady when the socket under it is a
// plain TCP connection, else p.
func readyConnOf(p *peekedConn, socket net.Conn) net.Conn {
	tc, ok := socket.(*net.TCPConn)
	if !ok {
		return p
	}
	raw, err := tc.SyscallConn()
	if err != nil {
		return p
	}
	c := &readyConn{peekedConn: p, raw: raw}
	c.doRead = c.readFD
	return c
}

// readFD reads once into a buffer of the pool; it reports false (wait for
// readability, holding no buffer) when the socket has nothing yet.
func (c *readyConn) readFD(fd uintptr) bool {
	c.buf = c.pool.Get(c.bufSize)
	c.n, c.err = syscall.Read(int(fd), *c.buf) // syscall, as net does (the race detector's view of fds)
	if c.err != nil {
		c.pool.Put(c.buf)
		c.buf = nil
	}
	return c.err != syscall.EAGAIN && c.err != syscall.EWOULDBLOCK
}

// ReadOnReady implements gRPC's readyreader.Reader: it waits until the
// socket is readable, then reads up to bufSize bytes into a buffer from
// pool, which the caller returns to it.
func (c *readyConn) ReadOnReady(bufSize int, pool mem.BufferPool) (*[]byte, int, error) {
	if c.unread && bufSize > 0 {
		c.unread = false
		b := pool.Get(bufSize)
		(*b)[0] = c.first
		return b, 1, nil
	}
	c.bufSize, c.pool = bufSize, pool
	err := c.raw.Read(c.doRead)
	buf, n, readErr := c.buf, c.n, c.err
	c.buf, c.pool, c.err = nil, nil, nil
	switch {
	case err != nil:
		if buf != nil {
			pool.Put(buf)
		}
		return nil, 0, err
	case readErr != nil: // its buffer went back in readFD
		return nil, 0, readErr
	case n == 0:
		pool.Put(buf)
		return nil, 0, io.EOF
	}
	return buf, n, nil
}
