//go:build !linux

package caddymodule

import "net"

// readyConnOf returns p: gRPC reads sockets with ReadOnReady on Linux only
// (see readyconn_linux.go).
func readyConnOf(p *peekedConn, _ net.Conn) net.Conn { return p }
