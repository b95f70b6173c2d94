package tunnelcore

import (
	"io"
	"net"
	"syscall"
)

// readyReads returns the socket of a bare TCP lane, which its laneReader
// reads once it is readable (readReady); nil for any other conn (TLS has
// its own buffer: the socket's readiness says nothing about it).
func readyReads(conn net.Conn) syscall.RawConn {
	tc, ok := conn.(*net.TCPConn)
	if !ok {
		return nil
	}
	raw, err := tc.SyscallConn()
	if err != nil {
		return nil
	}
	return raw
}

// readReady reads into the chunk once the socket is readable, and takes
// the chunk only then: while the socket has nothing, a reader between
// messages holds no chunk. An idle lane otherwise pinned a 256 KiB chunk
// for as long as its agent was idle (bench/scale.sh: most of a node's
// memory per idle session). A busy lane costs nothing more: the read that
// finds data is the one that would have been made.
func (l *laneReader) readReady() (int, error) {
	var n int
	var rerr error
	err := l.raw.Read(func(fd uintptr) bool {
		if l.chunk == nil {
			l.newChunk()
		}
		n, rerr = syscall.Read(int(fd), l.buf[l.wr:]) // syscall, as net does (the race detector's view of fds)
		if rerr == syscall.EAGAIN || rerr == syscall.EWOULDBLOCK {
			if l.rd == l.wr {
				l.dropChunk() // nothing of it is ours: wait without it
			}
			return false
		}
		return true
	})
	switch {
	case err != nil:
		return 0, err
	case rerr != nil:
		return 0, rerr
	case n == 0:
		return 0, io.EOF
	}
	return n, nil
}
