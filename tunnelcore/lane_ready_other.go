//go:build !linux

package tunnelcore

import (
	"net"
	"syscall"
)

// readyReads returns nil: a laneReader reads its conn (see
// lane_ready_linux.go).
func readyReads(net.Conn) syscall.RawConn { return nil }

func (l *laneReader) readReady() (int, error) { panic("tunnelcore: readReady without a socket") }
