package tunnelcore

import (
	"net"
	"syscall"

	"golang.org/x/sys/unix"
)

// socketProgress returns a reader of the bytes the peer's TCP acknowledged
// on c (TCP_INFO tcpi_bytes_acked, Linux 4.1+; 0 on older kernels, which
// leaves the watchdog timing blocked Sends alone), or nil when c is not a
// TCP connection.
func socketProgress(c net.Conn) func() uint64 {
	rc := rawTCPConn(c)
	if rc == nil {
		return nil
	}
	return func() uint64 { return bytesAcked(rc) }
}

// rawTCPConn is the TCP socket under c, or nil when there is none.
func rawTCPConn(c net.Conn) syscall.RawConn {
	tc := tcpConnOf(c)
	if tc == nil {
		return nil
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return nil
	}
	return rc
}

func bytesAcked(rc syscall.RawConn) uint64 {
	var acked uint64
	_ = rc.Control(func(fd uintptr) {
		if info, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO); err == nil {
			acked = info.Bytes_acked
		}
	})
	return acked
}

// readQueue returns a reader of the bytes c's socket holds that this end
// has not read yet (SIOCINQ), or nil when c is not a TCP connection.
func readQueue(c net.Conn) func() int {
	return socketIoctl(c, unix.SIOCINQ)
}

// socketIoctl returns a reader of an int ioctl of c's TCP socket (0 when
// it fails), or nil when c is not a TCP connection.
func socketIoctl(c net.Conn, req uint) func() int {
	rc := rawTCPConn(c)
	if rc == nil {
		return nil
	}
	return func() int {
		n := 0
		_ = rc.Control(func(fd uintptr) {
			if q, err := unix.IoctlGetInt(int(fd), req); err == nil {
				n = q
			}
		})
		return n
	}
}

// sendQueue returns a reader of the bytes c's socket holds that its peer
// has not acknowledged (SIOCOUTQ: not sent yet, or in flight), or nil when c
// is not a TCP connection. Closing a socket while it holds bytes its peer
// has not read can lose them: a close with unread input resets the
// connection, and the reset drops the send queue.
func sendQueue(c net.Conn) func() int {
	return socketIoctl(c, unix.SIOCOUTQ)
}
