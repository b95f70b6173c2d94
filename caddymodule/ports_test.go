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
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
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

// TestLateAdvertiseClaimsNothingForAnEndedSession: an Advertise dispatched
// as its session ended, and admitted after the end released the session's
// ports, binds nothing: the port would otherwise stay bound to a dead
// session, refusing every other agent.
func TestLateAdvertiseClaimsNothingForAnEndedSession(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	n := newNode("test", ln, nil, zap.NewNop())
	defer n.drainNow()
	defer n.ports.closeAll()
	probe, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := uint32(probe.Addr().(*net.TCPAddr).Port)
	probe.Close()
	n.opts.Store(&nodeOptions{portRange: portRange{lo: port, hi: port}, tcpBind: "127.0.0.1"})

	a, b := tunnelcore.Pipe(4)
	defer b.Close(nil)
	sess, err := tunnelcore.NewSession(a, tunnelcore.Config{Role: tunnelcore.RoleNode})
	if err != nil {
		t.Fatal(err)
	}
	sess.Close()
	agent := &agentSession{agentID: "agent-a", sess: sess}
	n.admitMu.Lock()
	n.readmitLocked(agent, []*tunnelpb.Route{{Name: "p", ListenPort: port, Target: "tcp://127.0.0.1:9"}})
	n.admitMu.Unlock()
	if e := n.ports.owner(port); e != nil {
		t.Fatalf("port %d bound for the ended session of %s", port, e.agent.agentID)
	}
}
