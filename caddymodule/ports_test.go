package caddymodule

import (
	"net"
	"os"
	"strconv"
	"strings"
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
	n, port := portTestNode(t)

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

// portTestNode is a node whose tcp_port_range is one free loopback port.
func portTestNode(t *testing.T) (*node, uint32) {
	t.Helper()
	n := testNode(t)
	t.Cleanup(n.ports.closeAll)
	probe, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := uint32(probe.Addr().(*net.TCPAddr).Port)
	probe.Close()
	n.opts.Store(&nodeOptions{portRange: portRange{lo: port, hi: port}, tcpBind: "127.0.0.1"})
	return n, port
}

// advertisePort has session a (re-)advertise a route on port.
func advertisePort(n *node, a *agentSession, port uint32) {
	n.admitMu.Lock()
	defer n.admitMu.Unlock()
	routes := []*tunnelpb.Route{{Name: "p", ListenPort: port, Target: "tcp://127.0.0.1:9"}}
	if n.reg.agents[a.key()] == a {
		n.readmitLocked(a, routes)
		return
	}
	entries, _ := n.admit(a, routes, nil)
	a.advertised = routes
	n.reg.register(a, entries)
}

// TestStandbyKeepsItsClaimOnReadmit: an agent that claimed a port first
// and became the standby when a smaller id joined stays the standby when
// its routes are re-admitted (a repeated Advertise, a reload of the port
// options, also one that rebinds every port), and takes the port over when
// the owner's routes go.
func TestStandbyKeepsItsClaimOnReadmit(t *testing.T) {
	for _, how := range []string{"repeated Advertise", "new tcp_port_range", "new tcp_bind"} {
		t.Run(how, func(t *testing.T) {
			n, port := portTestNode(t)
			sb, _ := testSessionPair(t)
			sa, _ := testSessionPair(t)
			b := &agentSession{agentID: "agent-b", sess: sb}
			a := &agentSession{agentID: "agent-a", sess: sa}
			advertisePort(n, b, port)
			advertisePort(n, a, port)
			if o := n.ports.owner(port); o == nil || o.agent != a {
				t.Fatalf("owner %v, want agent-a", o)
			}
			switch how {
			case "repeated Advertise":
				advertisePort(n, b, port)
			case "new tcp_port_range":
				old := n.opts.Load()
				wider := *old
				wider.portRange = portRange{lo: port - 1, hi: port}
				n.opts.Store(&wider)
				n.applyPortOptions(old, &wider)
			case "new tcp_bind":
				old := n.opts.Load()
				moved := *old
				moved.tcpBind = "127.0.0.2"
				n.opts.Store(&moved)
				n.applyPortOptions(old, &moved)
			}
			if o := n.ports.owner(port); o == nil || o.agent != a {
				t.Fatalf("owner after the re-admission %v, want agent-a", o)
			}
			n.admitMu.Lock()
			n.releasePorts(a.currentRoutes(&n.reg.mu))
			n.admitMu.Unlock()
			if o := n.ports.owner(port); o == nil || o.agent != b {
				t.Fatalf("owner after agent-a's routes went: %v, want the standby agent-b", o)
			}
		})
	}
}

// TestNoPortBoundWhileDraining: once the node drains (its ports closed), a
// repeated Advertise binds none again.
func TestNoPortBoundWhileDraining(t *testing.T) {
	n, port := portTestNode(t)
	s, _ := testSessionPair(t)
	a := &agentSession{agentID: "agent-a", sess: s}
	advertisePort(n, a, port)
	if n.ports.owner(port) == nil {
		t.Fatal("port not bound")
	}
	n.draining.Store(true)
	n.ports.closeAll()
	advertisePort(n, a, port)
	if o := n.ports.owner(port); o != nil {
		t.Fatalf("port %d bound again while the node drains", port)
	}
	if c, err := net.Dial("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(int(port)))); err == nil {
		c.Close()
		t.Fatalf("port %d accepts connections while the node drains", port)
	}
}

// TestPortBindsAndReleasesAreLoggedThrottled: an agent that keeps claiming
// and dropping its port routes (one Advertise may carry 1024 of them)
// cannot make the node log a line per bind and release.
func TestPortBindsAndReleasesAreLoggedThrottled(t *testing.T) {
	n, port := portTestNode(t)
	core, logs := observer.New(zap.InfoLevel)
	n.logger.Store(zap.New(core))
	s, _ := testSessionPair(t)
	a := &agentSession{agentID: "agent-a", sess: s}
	advertisePort(n, a, port)
	const rounds = 100
	for range rounds {
		n.admitMu.Lock()
		n.readmitLocked(a, []*tunnelpb.Route{{Name: "web", Host: "app.test", Target: "http://127.0.0.1:9"}})
		n.admitMu.Unlock()
		advertisePort(n, a, port)
	}
	if n.ports.owner(port) == nil {
		t.Fatal("the port is not bound after the last Advertise")
	}
	binds := logs.FilterMessage("listening for agent port route").Len()
	releases := logs.FilterMessage("released agent port route").Len()
	if binds+releases > 64 {
		t.Fatalf("%d binds and %d releases logged for %d of each", binds, releases, rounds)
	}
}

// TestParsePortList: tcp_port_range and udp_port_range take ports and
// ranges, comma-separated, in any order; overlapping and adjacent pieces
// merge; a bad piece fails naming the option and the piece.
func TestParsePortList(t *testing.T) {
	for _, tc := range []struct {
		in, canon string
		in1, out  []uint32 // ports inside, and outside, the set
	}{
		{"16000-16999", "16000-16999", []uint32{16000, 16500, 16999}, []uint32{15999, 17000}},
		{"17000", "17000", []uint32{17000}, []uint32{16999, 17001}},
		{"16000-16099,17000", "16000-16099,17000", []uint32{16000, 16099, 17000}, []uint32{16100, 16999, 17001}},
		{" 17000 , 16000 - 16099 ", "16000-16099,17000", []uint32{16050, 17000}, []uint32{16500}},
		{"9000-9010,8080", "8080,9000-9010", []uint32{8080, 9005}, []uint32{8081, 9011}},
		{"16000-16099,16050-16199,16200", "16000-16200", []uint32{16000, 16150, 16200}, []uint32{16201}},
		{"5,5,6,8", "5-6,8", []uint32{5, 6, 8}, []uint32{7, 9}},
		{"1-65535", "1-65535", []uint32{1, 65535}, []uint32{0}},
	} {
		r, err := parsePortList("tcp_port_range", tc.in)
		if err != nil {
			t.Fatalf("%q: %v", tc.in, err)
		}
		if r.String() != tc.canon {
			t.Errorf("%q: canonical %q, want %q", tc.in, r.String(), tc.canon)
		}
		for _, p := range tc.in1 {
			if !r.contains(p) {
				t.Errorf("%q: %d must be inside", tc.in, p)
			}
		}
		for _, p := range tc.out {
			if r.contains(p) {
				t.Errorf("%q: %d must be outside", tc.in, p)
			}
		}
	}
	// The same set written differently is the same portRange: a reload
	// that only reorders the list changes nothing.
	a, _ := parsePortRange("17000,16000-16099")
	b, _ := parsePortRange("16000-16050,16051-16099,17000")
	if a != b {
		t.Errorf("%v != %v", a, b)
	}
	if r, err := parsePortRange(""); err != nil || r.lo != 0 || r.contains(16000) || r.String() != "unset" {
		t.Errorf("empty: %+v %v", r, err)
	}
	for _, tc := range []struct{ option, in, want string }{
		{"tcp_port_range", "16000-16099,abc", `tcp_port_range: "16000-16099,abc": piece "abc" is not a port`},
		{"tcp_port_range", "16000-16099,", `tcp_port_range: "16000-16099,": piece "" is not a port`},
		{"udp_port_range", "17000,0", `udp_port_range: "17000,0": piece "0" is not a port`},
		{"udp_port_range", "9-1,20", `udp_port_range: "9-1,20": piece "9-1"`},
		{"tcp_port_range", "70000", `tcp_port_range: "70000" is not a port range`},
		{"udp_port_range", "5-1", `udp_port_range: "5-1" is not a port range`},
	} {
		if _, err := parsePortList(tc.option, tc.in); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %v, want %q", tc.in, err, tc.want)
		}
	}
}
