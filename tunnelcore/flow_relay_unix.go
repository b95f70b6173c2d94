//go:build unix

package tunnelcore

import (
	"net"
	"syscall"
)

// socketDatagramReader returns a reader of one datagram of pc that waits
// for the socket to be readable before it takes a pool buffer, and gives
// the buffer back once use returns: a flow's reader blocked on an idle
// socket holds no memory. Nil when pc is no socket.
func socketDatagramReader(pc net.Conn, size int) func(use func([]byte)) error {
	sc, ok := pc.(syscall.Conn)
	if !ok {
		return nil
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	return func(use func([]byte)) error {
		var buf *[]byte
		var n int
		var rerr error
		err := raw.Read(func(fd uintptr) bool {
			buf = bufferPool.Get(size)
			for {
				n, rerr = syscall.Read(int(fd), *buf)
				if rerr != syscall.EINTR {
					break
				}
			}
			if rerr == syscall.EAGAIN {
				bufferPool.Put(buf)
				buf = nil
				return false // wait until readable
			}
			return true
		})
		if buf == nil {
			return err
		}
		defer bufferPool.Put(buf)
		if rerr != nil {
			return rerr
		}
		use((*buf)[:n])
		return err
	}
}
