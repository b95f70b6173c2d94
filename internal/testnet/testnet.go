// Package testnet owns the loopback fixtures tests share: a connected pair
// of real TCP sockets, closed when the test ends.
package testnet

import (
	"net"
	"testing"
)

// TCPPair returns both ends of a TCP connection on 127.0.0.1; both are
// closed at the test's cleanup.
func TCPPair(t testing.TB) (client, server net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	client, err = net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	server, err = ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { server.Close() })
	return client, server
}
