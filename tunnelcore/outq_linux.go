package tunnelcore

import (
	"net"
	"syscall"
	"unsafe"
)

// unacked returns the bytes written to c that its peer has not
// acknowledged yet (SIOCOUTQ), or 0 when it cannot tell.
func unacked(c net.Conn) int {
	tc := tcpConnOf(c)
	if tc == nil {
		return 0
	}
	raw, err := tc.SyscallConn()
	if err != nil {
		return 0
	}
	var n int32
	raw.Control(func(fd uintptr) {
		_, _, errno := syscall.Syscall(syscall.SYS_IOCTL, fd, syscall.TIOCOUTQ, uintptr(unsafe.Pointer(&n)))
		if errno != 0 {
			n = 0
		}
	})
	return int(n)
}
