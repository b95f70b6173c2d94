package tunnelcore

import (
	"net"
	"syscall"
	"unsafe"
)

// waiting returns the bytes c's socket holds unread (FIONREAD), or -1
// when it cannot tell.
func waiting(c any) int {
	return sockIoctl(c, syscall.TIOCINQ, -1)
}

// unacked returns the bytes written to c that its peer has not
// acknowledged yet (SIOCOUTQ), or 0 when it cannot tell.
func unacked(c net.Conn) int {
	return sockIoctl(c, syscall.TIOCOUTQ, 0)
}

// sockIoctl reads an int ioctl of c's TCP socket, or returns otherwise.
func sockIoctl(c any, req uintptr, otherwise int) int {
	if u, ok := c.(interface{ NetConn() net.Conn }); ok {
		c = u.NetConn()
	}
	nc, ok := c.(net.Conn)
	if !ok {
		return otherwise
	}
	tc := tcpConnOf(nc)
	if tc == nil {
		return otherwise
	}
	raw, err := tc.SyscallConn()
	if err != nil {
		return otherwise
	}
	n := int32(otherwise)
	raw.Control(func(fd uintptr) {
		_, _, errno := syscall.Syscall(syscall.SYS_IOCTL, fd, req, uintptr(unsafe.Pointer(&n)))
		if errno != 0 {
			n = int32(otherwise)
		}
	})
	return int(n)
}
