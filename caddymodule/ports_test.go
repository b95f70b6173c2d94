package caddymodule

import (
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/sluice-tunnel/sluice/internal/logthrottle"
)

// flakyListener fails its first Accept as a process out of file
// descriptors does, then hands out one connection, then waits for Close.
type flakyListener struct {
	calls  int
	conn   net.Conn
	closed chan struct{}
}

func (l *flakyListener) Accept() (net.Conn, error) {
	l.calls++
	switch l.calls {
	case 1:
		return nil, &net.OpError{Op: "accept", Net: "tcp", Err: os.NewSyscallError("accept4", syscall.EMFILE)}
	case 2:
		return l.conn, nil
	}
	<-l.closed
	return nil, &net.OpError{Op: "accept", Net: "tcp", Err: net.ErrClosed}
}

func (l *flakyListener) Close() error   { close(l.closed); return nil }
func (l *flakyListener) Addr() net.Addr { return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)} }

// TestPortServingOutlivesAnAcceptError: an agent port's accept loop waits
// out an error such as EMFILE (logged) and goes on accepting; it stops only
// once its listener is closed.
func TestPortServingOutlivesAnAcceptError(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	n := &node{acceptLog: logthrottle.New(10*time.Second, 1)}
	n.logger.Store(zap.New(core))
	m := newPortManager(n)
	client, server := net.Pipe()
	defer client.Close()
	ln := &flakyListener{conn: server, closed: make(chan struct{})}
	served := make(chan struct{})
	go func() { m.serve(&portClaim{port: 16379, ln: ln}); close(served) }()

	// With no route owning the port, the accepted connection is closed.
	client.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := client.Read(make([]byte, 1)); err == nil || os.IsTimeout(err) {
		t.Fatalf("the connection after the accept error was not served: %v", err)
	}
	if logs.FilterMessage("accepting on agent port route; retrying").Len() != 1 {
		t.Error("the accept error was not logged once")
	}
	ln.Close()
	select {
	case <-served:
	case <-time.After(5 * time.Second):
		t.Fatal("serve did not return once the listener closed")
	}
}
