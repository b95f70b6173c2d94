package caddymodule

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/sluice-tunnel/sluice/internal/testwait"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// TestControlConnectionsWithoutTheTokenAreBounded: connections that never
// present the token count against max_pending_streams_per_address (past
// it the oldest is evicted), a connection that uses up its credential
// failures is closed, and the rest are closed after the time allowed,
// while a connection that carried a Connect with the token stays.
func TestControlConnectionsWithoutTheTokenAreBounded(t *testing.T) {
	n := testNode(t)
	tok := "secret"
	storeToken(t, n, tok)
	n.opts.Store(&nodeOptions{maxPending: 64, maxPendingPerAddr: 3, advertiseTimeout: time.Minute, drainGrace: time.Second})
	n.guard.timing.Store(&guardTiming{firstByte: time.Second, pending: time.Second, preface: time.Second})

	// An agent, proven by its Connect, before the idle ones.
	st, err := connectStream(t, controlClient(t, n), "secret")
	if err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, 5*time.Second, "the agent's stream authorized", func() bool { return n.pending.count() == 1 })

	// Clients with a wrong token: each Connect is refused at its headers.
	var clients []*grpc.ClientConn
	for i := range 4 {
		c := controlClient(t, n)
		s, err := connectStream(t, c, "wrong")
		if err == nil {
			_, err = s.Recv()
		}
		if status.Code(err) != codes.Unauthenticated {
			t.Fatalf("client %d: %v, want Unauthenticated", i, err)
		}
		clients = append(clients, c)
	}
	// The fourth took the place of the first (max_pending_streams_per_address 3).
	testwait.Until(t, 5*time.Second, "the oldest pending connection evicted", func() bool {
		return clients[0].GetState() != connectivity.Ready
	})
	for i, c := range clients {
		wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
		for c.GetState() == connectivity.Ready && c.WaitForStateChange(wctx, connectivity.Ready) {
		}
		wcancel()
		if c.GetState() == connectivity.Ready {
			t.Fatalf("client %d without the token still connected after the time allowed", i)
		}
	}
	testwait.Until(t, 5*time.Second, "no connection pending", func() bool { return n.guard.pendingCount() == 0 })
	if got := n.authFailures.Load(); got < 4 {
		t.Fatalf("%d credential failures counted, want at least 4", got)
	}

	// The agent's connection outlived them: its Advertise is answered.
	if err := st.Send(&tunnelpb.Frame{Kind: &tunnelpb.Frame_Advertise{Advertise: &tunnelpb.Advertise{
		AgentId: "agent-a", InitialWindow: tunnelcore.InitialWindow, Routes: []*tunnelpb.Route{{Host: "app.test"}},
	}}}); err != nil {
		t.Fatal(err)
	}
	f, err := st.Recv()
	if err != nil || f.GetAdvertiseAck() == nil {
		t.Fatalf("the agent's stream after the idle connections were closed: %v %v", f, err)
	}
}

// TestWrongTokensCloseTheConnection: each stream with a wrong token is
// refused and counted, and the connection is closed at the
// maxAuthFailuresPerConn-th, however many streams the client tries.
func TestWrongTokensCloseTheConnection(t *testing.T) {
	n := testNode(t)
	tok := "secret"
	storeToken(t, n, tok)
	n.opts.Store(&nodeOptions{maxPending: 64, maxPendingPerAddr: 16, advertiseTimeout: time.Minute, drainGrace: time.Second})
	cc, err := grpc.NewClient(n.listener.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(tunnelpb.Codec{})))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	cc.Connect()
	testwait.Until(t, 5*time.Second, "connected", func() bool { return cc.GetState() == connectivity.Ready })
	for i := range maxAuthFailuresPerConn {
		s, err := connectStream(t, cc, "wrong")
		if err == nil {
			_, err = s.Recv()
		}
		if i < maxAuthFailuresPerConn-1 && status.Code(err) != codes.Unauthenticated {
			t.Fatalf("attempt %d: %v, want Unauthenticated", i, err)
		}
	}
	testwait.Until(t, 5*time.Second, "the connection closed", func() bool { return cc.GetState() != connectivity.Ready })
	if got := n.authFailures.Load(); got != maxAuthFailuresPerConn {
		t.Fatalf("%d failures counted, want %d", got, maxAuthFailuresPerConn)
	}
}

// TestSilentConnectionClosedAfterFirstByteTime: a connection that sends
// nothing is closed after the first-byte time, long before the time a
// connection has to authenticate.
func TestSilentConnectionClosedAfterFirstByteTime(t *testing.T) {
	n := testNode(t)
	n.opts.Store(&nodeOptions{maxPending: 64, maxPendingPerAddr: 16})
	n.guard.timing.Store(&guardTiming{firstByte: 200 * time.Millisecond, pending: time.Minute, preface: time.Minute})
	c, err := net.Dial("tcp", n.listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, io.EOF) && !isReset(err) {
		t.Fatalf("silent connection: read %v, want it closed by the node", err)
	}
	testwait.Until(t, 5*time.Second, "no connection pending", func() bool { return n.guard.pendingCount() == 0 })
}

// TestLanePrefaceStaysPendingUntilItsTicket: a connection that sends the
// first byte of a lane preface and stops is still pending (it counts, and
// is evicted past the per-address limit) and is closed after the preface
// time.
func TestLanePrefaceStaysPendingUntilItsTicket(t *testing.T) {
	n := testNode(t)
	n.opts.Store(&nodeOptions{maxPending: 64, maxPendingPerAddr: 4})
	n.guard.timing.Store(&guardTiming{firstByte: time.Minute, pending: time.Minute, preface: 300 * time.Millisecond})
	var conns []net.Conn
	for range 10 {
		c, err := net.Dial("tcp", n.listener.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if _, err := c.Write([]byte("S")); err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	testwait.Until(t, 5*time.Second, "at most the per-address limit pending", func() bool { return n.guard.pendingCount() <= 4 })
	for i, c := range conns {
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := c.Read(make([]byte, 1)); !errors.Is(err, io.EOF) && !isReset(err) {
			t.Fatalf("connection %d with a bare lane preface byte: read %v, want it closed", i, err)
		}
	}
	testwait.Until(t, 5*time.Second, "no connection pending", func() bool { return n.guard.pendingCount() == 0 })
}

// TestGuardCountsNetworks: past prefixPerAddress times the per-address
// limit from one /24 (or /64), the oldest pending connection of that
// network is evicted, and other networks keep theirs.
func TestGuardCountsNetworks(t *testing.T) {
	n := testNode(t)
	n.opts.Store(&nodeOptions{maxPending: 1000, maxPendingPerAddr: 2})
	g := n.guard
	admit := func(addr string) *guardedConn { return admitFrom(t, g, addr) }
	other := admit("[2001:db8:1::1]:1000")
	var first []*guardedConn
	for i := range prefixPerAddress * 2 {
		first = append(first, admit(net.JoinHostPort(fmt.Sprintf("2001:db8::%x", i+1), "1000")))
	}
	if got := g.pendingCount(); got != 1+prefixPerAddress*2 {
		t.Fatalf("%d pending, want %d", got, 1+prefixPerAddress*2)
	}
	admit("[2001:db8::ff]:1000") // same /64: evicts the oldest of it
	if first[0].state != connEvicted || first[1].state != connPending || other.state != connPending {
		t.Fatalf("states after the /64 filled: first %v, second %v, other network %v", first[0].state, first[1].state, other.state)
	}
	v4 := admit("192.0.2.1:1")
	admit("192.0.2.1:2")
	admit("192.0.2.1:3") // same address: evicts its oldest
	if v4.state != connEvicted {
		t.Fatalf("the address's oldest connection is %v, want evicted", v4.state)
	}
}

// TestGuardOnUnixSocket: connections of a unix-socket listener, whose peers
// all share one address, are tracked as themselves: after rounds of
// overlapping connections, as many as the node allows are pending at once.
func TestGuardOnUnixSocket(t *testing.T) {
	dir, err := os.MkdirTemp("", "sluice-guard")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	ln, err := net.Listen("unix", filepath.Join(dir, "control.sock"))
	if err != nil {
		t.Fatal(err)
	}
	n := newNode("test", nil, zap.NewNop())
	if err := n.serve(func() (net.Listener, error) { return ln, nil }); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.drainNow)
	t.Cleanup(func() { ln.Close() })
	n.opts.Store(&nodeOptions{maxPending: 8, maxPendingPerAddr: 1})
	g := n.guard
	dial := func() net.Conn {
		c, err := net.Dial("unix", filepath.Join(dir, "control.sock"))
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	for range 20 {
		a, b := dial(), dial()
		testwait.Until(t, 5*time.Second, "both pending", func() bool { return g.pendingCount() == 2 })
		a.Close()
		b.Close()
		testwait.Until(t, 5*time.Second, "none pending", func() bool { return g.pendingCount() == 0 })
	}
	for range 3 {
		c := dial()
		defer c.Close()
	}
	testwait.Until(t, 5*time.Second, "three pending at once", func() bool { return g.pendingCount() == 3 })
}

// admitFrom admits a pipe whose peer has address addr into g, closed when
// the test ends.
func admitFrom(t *testing.T, g *connGuard, addr string) *guardedConn {
	t.Helper()
	a, b := net.Pipe()
	t.Cleanup(func() { a.Close(); b.Close() })
	gc := g.admit(addrConn{Conn: a, remote: fakeAddr(addr)})
	t.Cleanup(func() { gc.Close() })
	return gc
}

// addrConn is a connection with the remote address a test gives it.
type addrConn struct {
	net.Conn
	remote net.Addr
}

func (c addrConn) RemoteAddr() net.Addr { return c.remote }

type fakeAddr string

func (a fakeAddr) Network() string { return "tcp" }
func (a fakeAddr) String() string  { return string(a) }

func isReset(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && !op.Timeout()
}

// TestWrongTokensDoNotCloseAnAuthenticatedConnection: on a connection that
// carries an authenticated stream (an agent's, or a proxy's shared by many
// clients), streams with wrong tokens are refused one by one and the
// connection, with its session, stays.
func TestWrongTokensDoNotCloseAnAuthenticatedConnection(t *testing.T) {
	n := testNode(t)
	tok := "secret"
	storeToken(t, n, tok)
	n.opts.Store(&nodeOptions{maxPending: 64, maxPendingPerAddr: 16, advertiseTimeout: time.Minute, drainGrace: time.Second})
	cc := controlClient(t, n)
	st, err := connectStream(t, cc, "secret")
	if err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, 5*time.Second, "the agent's stream authorized", func() bool { return n.pending.count() == 1 })
	for i := range 2 * maxAuthFailuresPerConn {
		s, err := connectStream(t, cc, "wrong")
		if err == nil {
			_, err = s.Recv()
		}
		if status.Code(err) != codes.Unauthenticated {
			t.Fatalf("wrong token %d on the agent's connection: %v, want Unauthenticated", i, err)
		}
	}
	if err := st.Send(&tunnelpb.Frame{Kind: &tunnelpb.Frame_Advertise{Advertise: &tunnelpb.Advertise{
		AgentId: "agent-a", InitialWindow: tunnelcore.InitialWindow, Routes: []*tunnelpb.Route{{Host: "app.test"}},
	}}}); err != nil {
		t.Fatal(err)
	}
	if f, err := st.Recv(); err != nil || f.GetAdvertiseAck() == nil {
		t.Fatalf("the agent's stream after wrong tokens beside it: %v %v", f, err)
	}
}

// TestTokenNeedsTheBearerScheme: the token alone, without "Bearer ", is
// refused.
func TestTokenNeedsTheBearerScheme(t *testing.T) {
	n := testNode(t)
	tok := "secret"
	storeToken(t, n, tok)
	for header, want := range map[string]bool{"Bearer secret": true, "secret": false, "Bearer secre": false, "Bearer secrets": false, "Basic secret": false} {
		if _, ok := n.identify(context.Background(), metadata.Pairs("authorization", header)); ok != want {
			t.Errorf("authorization %q accepted %v, want %v", header, ok, want)
		}
	}
}

// TestGuardEvictsFromTheBusiestSite: when the node's pending pool is full,
// the connection evicted comes from the site (/24, /48) holding the most
// pending connections, not the oldest overall: an agent's connection,
// older than a flood from one site, stays.
func TestGuardEvictsFromTheBusiestSite(t *testing.T) {
	n := testNode(t)
	n.opts.Store(&nodeOptions{maxPending: 8, maxPendingPerAddr: 100})
	g := n.guard
	admit := func(addr string) *guardedConn { return admitFrom(t, g, addr) }
	agent := admit("192.0.2.1:4000")
	var flood []*guardedConn
	for i := range 7 {
		flood = append(flood, admit(fmt.Sprintf("198.51.100.%d:1000", i+1)))
	}
	for i := range 20 {
		flood = append(flood, admit(fmt.Sprintf("198.51.100.%d:2000", i+10)))
	}
	if agent.state != connPending {
		t.Fatalf("the agent's connection is %v after a flood from one /24, want pending", agent.state)
	}
	if got := g.pendingCount(); got != 8 {
		t.Fatalf("%d pending, want max_pending_streams (8)", got)
	}
	if flood[0].state != connEvicted {
		t.Fatalf("the flood's oldest is %v, want evicted", flood[0].state)
	}
	// IPv6: a /48 is one site, however many /64s it spreads over.
	v6agent := admit("[2001:db8:1::1]:1")
	for i := range 20 {
		admit(fmt.Sprintf("[2001:db8:2:%x::1]:1", i))
	}
	if v6agent.state != connPending {
		t.Fatalf("an agent's IPv6 connection is %v after a flood from another /48, want pending", v6agent.state)
	}
}
