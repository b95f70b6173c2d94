package caddymodule

import (
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/sluice-tunnel/sluice/internal/route"
	"github.com/sluice-tunnel/sluice/internal/testwait"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// TestUDPOptionsProvision: the defaults fill in, and what cannot work is
// refused at load.
func TestUDPOptionsProvision(t *testing.T) {
	o, err := (&UDPOptions{}).provision()
	if err != nil || o.maxFlows != DefaultMaxUDPFlows || o.maxFlowsPerAddr != DefaultMaxUDPFlowsPerAddress || o.portRange.lo != 0 {
		t.Fatalf("defaults: %+v, %v", o, err)
	}
	o, err = (&UDPOptions{UDPPortRange: "15300-15399", UDPBind: "127.0.0.1", MaxUDPFlows: 10, MaxUDPFlowsPerAddress: 2}).provision()
	if err != nil || o.portRange != (portRange{lo: 15300, hi: 15399, spans: "15300-15399"}) || o.bind != "127.0.0.1" || o.maxFlows != 10 || o.maxFlowsPerAddr != 2 {
		t.Fatalf("set: %+v, %v", o, err)
	}
	for _, tc := range []struct {
		opts UDPOptions
		want string
	}{
		{UDPOptions{UDPPortRange: "5-1"}, `udp_port_range: "5-1" is not a port range`},
		{UDPOptions{UDPBind: "127.0.0.1"}, "udp_bind: \"127.0.0.1\" without udp_port_range binds nothing"},
		{UDPOptions{UDPPortRange: "15300", UDPBind: "192.0.2.1"}, "udp_bind: \"192.0.2.1\""},
		{UDPOptions{MaxUDPFlows: -1}, "must not be negative"},
	} {
		if _, err := tc.opts.provision(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %q", tc.opts, err, tc.want)
		}
	}
}

// TestResolveKeepsTCPAndUDPApart: a layer4 name finds the routes of its
// transport only: a TCP server's `sluice svc` never opens a connection to
// a UDP service named svc, nor a UDP server's a flow to a TCP one.
func TestResolveKeepsTCPAndUDPApart(t *testing.T) {
	n := testNode(t)
	tcpSess, _ := testSessionPair(t)
	udpSess, _ := testSessionPair(t)
	tcpAgent := &agentSession{agentID: "agent-a", sess: tcpSess}
	udpAgent := &agentSession{agentID: "agent-b", sess: udpSess}
	for a, rt := range map[*agentSession]*tunnelpb.Route{
		tcpAgent: {Name: "svc", Target: "tcp://127.0.0.1:9"},
		udpAgent: {Name: "svc", Target: "udp://127.0.0.1:9"},
	} {
		entries, rejected := validateRoutes([]*tunnelpb.Route{rt})
		if len(rejected) > 0 {
			t.Fatal(rejected)
		}
		n.reg.bind(a, entries, nil)
		n.reg.register(a, entries)
	}
	if e := n.resolveTCP(TCPTarget{Route: "svc"}); e == nil || e.agent != tcpAgent {
		t.Errorf("TCP: %v", e)
	}
	if e := n.resolveUDP(UDPTarget{Route: "svc"}); e == nil || e.agent != udpAgent || e.kind != route.NamedUDP {
		t.Errorf("UDP: %v", e)
	}
	if e := n.resolveUDP(UDPTarget{Route: "nothing"}); e != nil {
		t.Errorf("UDP, unknown name: %v", e)
	}
}

// udpPortTestNode is a node whose udp_port_range is one free loopback
// port, with its flow limits, and an agent session whose flows echo each
// datagram prefixed with the flow's client address; it returns the node
// and the port.
func udpPortTestNode(t *testing.T, maxFlows, perAddr int) (*node, uint32) {
	t.Helper()
	n := testNode(t)
	t.Cleanup(n.udp.ports.closeAll)
	probe, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := uint32(probe.LocalAddr().(*net.UDPAddr).Port)
	probe.Close()
	n.opts.Store(&nodeOptions{udp: udpNodeOptions{portRange: portRange{lo: port, hi: port}, bind: "127.0.0.1", maxFlows: maxFlows, maxFlowsPerAddr: perAddr}})
	sess, accepted := testSessionPair(t)
	go func() {
		for f := range accepted {
			go func() {
				buf := make([]byte, tunnelcore.MaxDatagram)
				for {
					m, err := f.ReadDatagram(buf)
					if err != nil {
						return
					}
					f.WriteDatagram(append([]byte(f.Info().RemoteAddr+" "), buf[:m]...))
				}
			}()
		}
	}()
	a := &agentSession{agentID: "agent-a", sess: sess}
	n.admitMu.Lock()
	entries, rejected := n.admit(a, []*tunnelpb.Route{{Name: "dns", ListenPort: port, Target: "udp://127.0.0.1:53"}}, nil)
	n.reg.register(a, entries)
	n.admitMu.Unlock()
	if len(rejected) > 0 || n.udp.ports.owner(port) == nil {
		t.Fatalf("port %d not claimed: %v", port, rejected)
	}
	return n, port
}

// ask sends msg from c and returns the reply.
func ask(t *testing.T, c *net.UDPConn, msg string) (string, error) {
	t.Helper()
	if _, err := c.Write([]byte(msg)); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(2 * time.Second))
	buf := make([]byte, 100)
	m, err := c.Read(buf)
	return string(buf[:m]), err
}

// TestUDPPortGivesEachClientItsFlow: a claimed UDP port carries each
// client address's datagrams in a flow of its own (the agent sees the
// client's address), and each client gets its own flow's replies.
func TestUDPPortGivesEachClientItsFlow(t *testing.T) {
	n, port := udpPortTestNode(t, 100, 100)
	for i := range 3 {
		c, err := net.DialUDP("udp", nil, &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: int(port)})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		for j := range 2 {
			msg := fmt.Sprintf("client %d, datagram %d", i, j)
			got, err := ask(t, c, msg)
			if want := c.LocalAddr().String() + " " + msg; err != nil || got != want {
				t.Fatalf("got %q, %v; want %q", got, err, want)
			}
		}
	}
	if st := n.udp.ports.snapshot(); len(st) != 1 || st[0].Network != "udp" || st[0].Owner != "agent-a" {
		t.Errorf("status %+v", st)
	}
}

// TestUDPFlowLimits: past max_udp_flows_per_address a client address of
// the same IP gets no flow (its datagrams are dropped and counted), until
// a flow ends.
func TestUDPFlowLimits(t *testing.T) {
	n, port := udpPortTestNode(t, 100, 1)
	dial := func() *net.UDPConn {
		c, err := net.DialUDP("udp", nil, &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: int(port)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	first, second := dial(), dial()
	if _, err := ask(t, first, "one"); err != nil {
		t.Fatal(err)
	}
	if got, err := ask(t, second, "two"); err == nil {
		t.Fatalf("a second flow of 127.0.0.1 answered %q", got)
	}
	if n.udp.refused[udpMaxFlowsPerAddr].Load() == 0 {
		t.Error("the refused client was not counted")
	}
	n.udp.ports.closeAll() // ends every flow: the limits come back
	testwait.Until(t, 5*time.Second, "the flows' limits to come back", func() bool { return n.udp.flows.count() == 0 })
}
