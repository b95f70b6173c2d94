//go:build !linux

package tunnelcore

import "net"

// unacked returns 0: only Linux tells (see outq_linux.go); an abort may
// then drop what the peer has not acknowledged.
func unacked(net.Conn) int { return 0 }

// waiting returns -1: only Linux tells (see outq_linux.go).
func waiting(any) int { return -1 }
