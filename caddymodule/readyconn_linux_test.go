package caddymodule

import (
	"errors"
	"io"
	"net"
	"testing"

	"github.com/sluice-tunnel/sluice/internal/testnet"

	"google.golang.org/grpc/mem"
)

// TestReadyConnReadsOnReady: a plaintext agent connection offers gRPC
// ReadOnReady (so gRPC pins no read buffer while it is idle), which gives
// the peeked first byte, then what the socket has, then EOF.
func TestReadyConnReadsOnReady(t *testing.T) {
	client, server := testnet.TCPPair(t)
	conn := readyConnOf(&peekedConn{Conn: server, first: 'P', unread: true}, server)
	defer conn.Close()
	rr, ok := conn.(interface {
		ReadOnReady(int, mem.BufferPool) (*[]byte, int, error)
	})
	if !ok {
		t.Fatal("a plaintext TCP connection does not offer ReadOnReady")
	}
	pool := mem.DefaultBufferPool()
	var got []byte
	read := func() error {
		b, n, err := rr.ReadOnReady(16, pool)
		if n > 0 {
			got = append(got, (*b)[:n]...)
			pool.Put(b)
		}
		return err
	}
	if err := read(); err != nil || string(got) != "P" {
		t.Fatalf("first read: %q, %v", got, err)
	}
	if _, err := client.Write([]byte("RI * HTTP/2.0")); err != nil {
		t.Fatal(err)
	}
	client.(*net.TCPConn).CloseWrite()
	var end error
	for end == nil {
		end = read()
	}
	if !errors.Is(end, io.EOF) || string(got) != "PRI * HTTP/2.0" {
		t.Errorf("read %q, then %v; want the stream, then EOF", got, end)
	}
	if _, ok := readyConnOf(&peekedConn{Conn: server}, &peekedConn{Conn: server}).(*readyConn); ok {
		t.Error("a wrapped (TLS-like) connection offers ReadOnReady")
	}
}
