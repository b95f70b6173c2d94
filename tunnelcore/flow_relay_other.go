//go:build !unix

package tunnelcore

import "net"

// socketDatagramReader: elsewhere than Unix a flow's reader holds its
// buffer while it waits (packetReader).
func socketDatagramReader(net.Conn, int) func(use func([]byte)) error { return nil }
